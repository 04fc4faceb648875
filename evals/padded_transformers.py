"""The length-sorted padded transformers embedder (``PaddedTransformersEmbedder``), the way llm2vec embeds with a
decoder: ``AutoModel`` over right-padded batches with an attention mask, pooled on the padded output. The baseline
of ``evals/bench_decoder.py`` and ``evals/bench_scaling.py``."""

from __future__ import annotations

import copy


class PaddedTransformersEmbedder:
    """The length-sorted padded transformers embedder (what llm2vec does), as a benchmark system.

    ``AutoModel`` (transformers' own attention, ``sdpa`` by default) over right-padded batches of ``batch_size``
    texts sorted longest first, with an attention mask; mean pooling masks the padding, lasttoken takes each row's
    last real token. The model is loaded in float32 and kept: another dtype runs a cast copy of it, so switching
    back to float32 runs the loaded weights again, not weights rounded by a trip through bfloat16. Tokenization
    matches ``lab.engine.inputs.InputProcessor``: truncation at ``max_length`` (one token less when EOS is appended),
    then EOS appended unless the text already ends with it. Returns float32 numpy rows in input order (not normalized;
    compare by cosine).
    """

    def __init__(
        self,
        path: str,
        *,
        batch_size: int = 16,
        dtype: str = "float32",
        device: str = "cpu",
        pooling: str = "mean",
        max_length: int = 512,
        append_eos: bool = False,
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.float32_model = AutoModel.from_pretrained(path, dtype=torch.float32).eval().to(device)
        self.model = self.float32_model
        self.device = torch.device(device)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        self.batch_size, self.max_length = batch_size, max_length
        self.dtype = None
        self.configure(dtype=dtype, pooling=pooling, append_eos=append_eos)

    def configure(
        self,
        *,
        dtype: str | None = None,
        pooling: str | None = None,
        append_eos: bool | None = None,
        batch_size: int | None = None,
    ) -> PaddedTransformersEmbedder:
        if dtype is not None and dtype != self.dtype:
            self.model = self.float32_model  # the previous cast copy (if any) is freed
            if dtype != "float32":
                self.model = copy.deepcopy(self.float32_model).to(getattr(self.torch, dtype))
            self.dtype = dtype
        if pooling is not None:
            if pooling not in ("mean", "lasttoken"):
                raise ValueError(f"baseline pooling must be mean or lasttoken, got {pooling!r}")
            self.pooling = pooling
        if append_eos is not None:
            self.append_eos = append_eos and self.tokenizer.eos_token_id is not None
        if batch_size is not None:
            self.batch_size = batch_size
        return self

    @property
    def name(self) -> str:
        return f"padded transformers (batch {self.batch_size})"

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        limit = self.max_length - 1 if self.append_eos else self.max_length
        ids = self.tokenizer(texts, truncation=True, max_length=limit, return_attention_mask=False)["input_ids"]
        if self.append_eos:
            eos = self.tokenizer.eos_token_id
            ids = [x if x and x[-1] == eos else x + [eos] for x in ids]
        return ids

    def padded_tokens(self, texts: list[str]) -> int:
        lengths = sorted((len(x) for x in self.tokenize(texts)), reverse=True)
        b = self.batch_size
        return sum(lengths[i] * len(lengths[i : i + b]) - sum(lengths[i : i + b]) for i in range(0, len(lengths), b))

    def __call__(self, texts: list[str]):
        import numpy as np

        torch = self.torch
        ids = self.tokenize(texts)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = np.empty((len(ids), self.model.config.hidden_size), dtype=np.float32)
        with torch.inference_mode():
            for s in range(0, len(order), self.batch_size):
                rows = order[s : s + self.batch_size]
                lengths = [len(ids[i]) for i in rows]
                width = max(lengths)
                input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for j, i in enumerate(rows):
                    input_ids[j, : lengths[j]] = torch.tensor(ids[i])
                    mask[j, : lengths[j]] = 1
                input_ids, mask = input_ids.to(self.device), mask.to(self.device)
                hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
                if self.pooling == "mean":
                    m = mask.unsqueeze(-1).float()
                    pooled = (hidden.float() * m).sum(1) / m.sum(1)
                else:
                    last = torch.tensor(lengths, device=self.device) - 1
                    pooled = hidden[torch.arange(len(rows), device=self.device), last].float()
                out[rows] = pooled.cpu().numpy()
        return out
