"""The model contract: what the engine, the executor and the adapters may ask of a model, and nothing else.

Every packed model family (``bert.py``, ``decoder.py``) and the transformers fallback (``hf_fallback.py``) subclass
``PackedModel``. The engine reads only the attributes and methods declared here; it never probes a model with
``hasattr`` / ``getattr``. A model sees flat tokens, their positions and an ``AttnMeta``; never the batch layout.

**One forward, in stages.** ``forward`` is defined once, here, as ``embed`` -> ``run_layers`` -> ``finish``. The
KV path (``lab.engine.kv_path``: chunked prefill layer by layer, the shared-prefix cache) calls the same three stages
on slices of the rows, so there is no second implementation to keep in sync. A family implements the stages:

- ``embed(input_ids, positions, token_type_ids, meta)`` -> the input of layer 0, ``(T, hidden)``;
- ``run_layers(x, positions, meta, layers, residual, output_rows)`` -> ``(x, residual)`` after ``layers`` (a
  ``range``); pre-norm families carry the residual sum apart (``None`` for post-norm ones);
- ``finish(x, residual, meta, last)`` -> hidden states: ``last`` = the model's last layer ran (apply a final norm
  if the family has one), else transformers' ``hidden_states[k]`` of the layers that ran.

A model that cannot run in stages (the padded fallback) overrides ``forward`` and sets ``staged = False``: the
executor then never sends it down the KV path. Adding a family: subclass ``PackedModel``, implement the stages and
``load_hf_state_dict``, register its architectures in ``lab.models.REGISTRY``.

    >>> hidden = model(input_ids, positions, meta, token_type_ids)              # (T, hidden)
    >>> rows = model(input_ids, positions, meta, output_rows=sel)               # (B, hidden): sel.rows only
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lab.ops.batch import AttnMeta, OutputRows
from lab.ops.plan import CpuPlan
from lab.ops.probes import Decision, Probe, decide


class PackedModel(nn.Module):
    """Base class of every model the engine runs. Class attributes describe the family; see the module doc."""

    is_decoder: bool = False
    default_causal: bool = False  # the attention the checkpoint was trained with
    packed: bool = True  # False: runs padded batches inside (``padding`` counts the waste)
    staged: bool = True  # ``embed`` / ``run_layers`` / ``finish`` exist: the KV path may drive it
    computes_output_rows: bool = False  # ``forward(..., output_rows=...)`` runs its last layer for those rows only
    config: dict  # the folder's config.json
    hidden_size: int
    num_layers: int | None = None  # ``None``: unknown (then only the last layer can be pooled)
    max_positions: int | None = None  # the longest sequence its positions cover, when the family knows it
    classifier: nn.Module | None  # a sequence-classification head over the first token, if loaded

    def __init__(self):
        super().__init__()
        # an instance attribute, not a class one: a class attribute would shadow the submodule once one is set
        self.classifier = None
        # this model's CPU plan (``lab.ops.plan``): the fast-path choices decided by ``cpu_probes`` on this machine
        # for the current dtype (by the runner's planner) and the weight copies made for them; the layers and their
        # GEMMs read it. Empty: each family's defaults (and always off the CPU). One model per engine, so one plan.
        self.plan = CpuPlan()
        # weight-layout choices (name -> candidate) made by ``layout_probes`` before the weights load, fixed for the
        # model's life (the engine makes them on CPU; empty: the checkpoint's own layout)
        self.layout: dict[str, str] = {}

    def layout_probes(self, dtype: torch.dtype) -> Iterator[Probe]:
        """Choices of how this family lays out its weights, as probes on random tensors of its shapes (one thread).
        ``choose_layouts`` decides them before ``load_hf_state_dict``, which reads ``layout``."""
        return iter(())

    def choose_layouts(self, dtype: torch.dtype, forced: dict[str, str] | None = None) -> list[Decision]:
        """Decide ``layout_probes`` (measured once per process and shape class; ``forced``, an engine's
        ``cpu_paths``, or ``LAB_CPU_<NAME>`` forces one) into ``layout``; call before loading weights. Unlike
        ``plan``, a later dtype or worker change keeps them."""
        decided = [decide(probe, forced=forced) for probe in self.layout_probes(dtype)]
        self.layout.update({d.name: d.choice for d in decided})
        return decided

    def attach_plan(self, module: nn.Module) -> None:
        """Give the GEMM modules of ``module`` (a head loaded after construction) this model's plan."""
        for m in module.modules():
            if "plan" in vars(m):
                m.plan = self.plan

    def cpu_probes(self, dtype: torch.dtype, threads: int) -> Iterator[Probe]:
        """The CPU fast-path choices of this family at ``dtype``, as probes over its own shapes and weights, each
        timed with ``threads`` intra-op threads (one CPU worker's share). A generator: the planner puts each
        decision into ``plan`` (a trial of it: ``CpuPlan.trial``) before asking for the next probe, so later probes
        run with earlier choices; a candidate may set its own choice in ``plan`` before it runs a layer."""
        return iter(())

    def ffn_rows(self, device: torch.device, dtype: torch.dtype) -> int | None:
        """The most tokens whose MLP inner rows an eager step holds at once under the current plan (``None``: the
        whole step's); ``lab.runtime.memory`` reads it to size a step."""
        return None

    # ------------------------------------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMeta,
        token_type_ids: torch.Tensor | None = None,
        *,
        output_rows: OutputRows | None = None,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` after the first ``num_layers`` layers (``None`` = all; 0 = the embedding
        output), or with ``output_rows`` only those rows ``(B, hidden)``, the last computed layer computing no
        others (``computes_output_rows`` models; plain steps only, no cached keys/values)."""
        depth = self.layers_to_run(num_layers)
        if output_rows is not None and meta.kv is not None:
            raise ValueError("output_rows needs a plain prefill step (no cached keys/values in meta.kv)")
        longest = meta.max_seqlen
        if meta.kv is not None and meta.kv.has_prefix:
            longest = max(p + n for p, n in zip(meta.kv.prefix_lens, meta.seqlens))
        self.check_context(longest)
        x = self.embed(input_ids, positions, token_type_ids, meta)
        if depth == 0:  # the embedding output (of the kept rows only)
            return x if output_rows is None else x[output_rows.rows]
        x, residual = self.run_layers(x, positions, meta, range(depth), None, output_rows)
        return self.finish(x, residual, meta, last=depth == self.num_layers)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None, meta: AttnMeta
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not run in stages")

    def run_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMeta,
        layers: range,
        residual: torch.Tensor | None = None,
        output_rows: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError(f"{type(self).__name__} does not run in stages")

    def finish(self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttnMeta, *, last: bool) -> torch.Tensor:
        return x if residual is None else x + residual

    def layers_to_run(self, num_layers: int | None) -> int:
        """How many layers a forward runs: ``num_layers`` (0 = the embedding output only), or all for ``None``.
        The Engine's ``layer`` knob resolves negative values before they get here."""
        total = self.num_layers
        if num_layers is None:
            return total
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 0 <= num_layers <= (total or 0):
            raise ValueError(f"num_layers={num_layers!r} but this model has {total} layers; valid: 0..{total} or None")
        return num_layers

    def check_context(self, longest: int) -> None:
        """Refuse a sequence (with its cached prefix) of ``longest`` tokens that the model would get wrong."""
        if self.max_positions is not None and longest > self.max_positions:
            raise ValueError(f"a sequence spans {longest} tokens but this model has {self.max_positions} positions")

    def padding(self, meta: AttnMeta) -> int:
        """Padding tokens a forward over ``meta`` computes: 0 for packed models."""
        return 0

    # ----------------------------------------------------------------------------------------------- outputs
    @property
    def has_lm_head(self) -> bool:
        """``lm_logits`` works: a decoder with an LM head (or tied input embeddings)."""
        return False

    def lm_logits(self, hidden: torch.Tensor, token_ids: list[int] | None = None) -> torch.Tensor:
        """Language-model logits ``(N, V)`` of hidden states ``(N, hidden)``, or only the columns ``token_ids``."""
        raise ValueError(f"{type(self).__name__} has no language-model head")

    @property
    def token_heads(self) -> tuple[str, ...]:
        """Per-token heads loaded with the checkpoint, by name (``token_head`` runs them): ``mlm`` (masked-LM
        logits, what SPLADE reads), ``sparse_linear`` (bge-m3's lexical weight), ``colbert_linear`` (bge-m3's
        ColBERT projection). Empty when the checkpoint has none."""
        return ()

    def token_head(self, name: str, hidden: torch.Tensor) -> torch.Tensor:
        """Head ``name`` of ``token_heads`` on hidden states ``(N, hidden)``: ``mlm`` -> ``(N, vocab)`` logits,
        ``sparse_linear`` -> ``(N, 1)``, ``colbert_linear`` -> ``(N, d)``; raw outputs in the weights' dtype (the
        activations and reductions around them are the outputs layer's, ``lab.outputs.kinds``)."""
        raise ValueError(f"{type(self).__name__} has no per-token head {name!r}")

    # -------------------------------------------------------------------------------------------- adapters
    def hf_linear_map(self) -> dict[str, tuple[str, slice | torch.Tensor] | None]:
        """Each transformers Linear -> our parameter and its rows, a slice or an index tensor (LoRA merges through
        it; ``lab.adapt.merge``)."""
        raise ValueError(f"{type(self).__name__} cannot merge adapters (no map from transformers' Linear names)")

    @staticmethod
    def hf_module_name(name: str) -> str:
        """A transformers module name with the checkpoint / PEFT prefixes the family accepts removed."""
        return name
