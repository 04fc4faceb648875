"""Fallback for architectures without a packed implementation: transformers ``AutoModel`` on padded batches.

It keeps the packed interface (flat tokens + ``AttnMeta`` in, packed hidden states out) by padding inside, so the
executor and poolers are unchanged; ``padding(meta)`` counts the waste, which the engine reports in
``stats.padded_tokens``. It does not run in stages (``staged = False``), so the KV path never drives it.
"""

from __future__ import annotations

import torch

from lab.models.base import PackedModel
from lab.ops.batch import AttnMeta, OutputRows


class HFFallbackModel(PackedModel):
    """transformers ``AutoModel`` behind the ``PackedModel`` contract (padded batches inside)."""

    packed = False
    staged = False

    def __init__(self, path: str, config: dict):
        super().__init__()
        from transformers import AutoModel

        self.hf = AutoModel.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        self.hf.eval()
        self.config = config
        self.hidden_size = config.get("hidden_size") or self.hf.config.hidden_size
        self.is_decoder = bool(config.get("is_decoder")) or any(
            a.endswith("ForCausalLM") for a in config.get("architectures") or []
        )
        self.default_causal = self.is_decoder
        self.pad_id = config.get("pad_token_id") or 0
        # for the ``layer`` knob (``None`` where the config does not say: then only the last layer can be pooled)
        self.num_layers = getattr(self.hf.config, "num_hidden_layers", None)

    def padding(self, meta: AttnMeta) -> int:
        return meta.num_seqs * meta.max_seqlen - meta.num_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMeta,
        token_type_ids=None,
        *,
        output_rows: OutputRows | None = None,
        num_layers: int | None = None,
    ):
        """Packed hidden states ``(T, hidden)``: ``last_hidden_state``, or with ``num_layers`` below the model's
        layer count transformers' ``hidden_states[num_layers]`` (0 = the embedding output; the whole model runs)."""
        if meta.causal != self.default_causal:
            raise ValueError(
                "this architecture runs through the transformers fallback, which cannot change its attention "
                "direction; leave bidirectional=None for it"
            )
        if meta.kv is not None or output_rows is not None:
            raise ValueError("chunked prefill / prefix cache need a packed implementation; this model has none")
        b, longest = meta.num_seqs, meta.max_seqlen
        ids = input_ids.new_full((b, longest), self.pad_id)
        mask = torch.zeros(b, longest, dtype=torch.long, device=input_ids.device)
        types = None if token_type_ids is None else torch.zeros_like(ids)
        for i, (s, n) in enumerate(zip(meta.cu_seqlens[:-1].tolist(), meta.seqlens)):
            ids[i, :n] = input_ids[s : s + n]
            mask[i, :n] = 1
            if types is not None:
                types[i, :n] = token_type_ids[s : s + n]
        kw = {} if types is None else {"token_type_ids": types}
        if num_layers is None or num_layers == self.num_layers:
            hidden = self.hf(input_ids=ids, attention_mask=mask, **kw).last_hidden_state  # (B, L, H)
        else:
            hidden = self.hf(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kw).hidden_states
            hidden = hidden[num_layers]
        return hidden[mask.bool()]  # (T, H) in packed order
