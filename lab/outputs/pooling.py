"""Pooling methods: pick and reduce each sequence's rows of packed hidden states (the "method" half of a pooler).

vLLM's split: a pooler is a **method** (which rows, reduced how: here) times a **head** (what the reduced rows
become: ``lab.outputs.heads``). A method is a pure function of the hidden states ``(T, H)``, the step's ``AttnMeta``
and ``pool_start`` (tokens before it, an instruction, are attended to but not pooled):

- ``cls`` (first pooled token), ``lasttoken`` (``h[cu[1:] - 1]``), ``mean`` / ``weightedmean`` (float32 sums;
  weighted by 1-based position, as SGPT), ``max`` per feature: ``(B, H)`` float32 through the kernel set of the
  step's backend (``lab.ops.attention.ops``);
- ``tokens``: every pooled row of each sequence, a list of ``(L_i - pool_start_i, H)`` float32 tensors (the rows
  ``mean`` averages).

``rows()`` names the single packed row per sequence a method reads (``cls``, ``lasttoken``): the executor then asks
a model that ``computes_output_rows`` to run its last layer for those rows only, and ``from_rows`` turns them into
the method's output. Adding a method: subclass ``PoolingMethod`` and ``register`` it: the ``pooling`` knob,
``configure`` and the panel then offer it.

    >>> method = pooling_method("mean")
    >>> pooled = method(hidden, meta, pool_start)          # (B, H) float32
"""

from __future__ import annotations

import numpy as np
import torch

from lab.kernels.reference import SEGMENT_REDUCTIONS
from lab.ops.attention import ops
from lab.ops.batch import AttnMeta

__all__ = ["METHODS", "PoolingMethod", "knob_values", "pool_spans", "pooling_method", "register"]


class PoolingMethod:
    """Reduces each sequence of a packed step to its output: ``(B, H)`` float32, or a list of B tensors. ``knob``:
    offered as a value of the ``pooling`` knob (``knob_values``)."""

    name: str = ""
    knob: bool = True

    def __call__(self, hidden: torch.Tensor, meta: AttnMeta, pool_start: torch.Tensor | None):
        raise NotImplementedError

    def rows(self, lengths: list[int], pool_start: list[int]) -> np.ndarray | None:
        """The one packed row per sequence this method reads, or ``None`` when it reads many (or when a sequence
        is empty / its instruction covers it)."""
        return None

    def from_rows(self, selected: torch.Tensor) -> torch.Tensor:
        """The output from the hidden states of ``rows()`` alone, ``(B, H)``."""
        return selected.float()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class SegmentPool(PoolingMethod):
    """``cls``, ``mean``, ``max``, ``lasttoken`` and ``weightedmean``: one fused segment reduction per step."""

    def __init__(self, name: str):
        if name not in SEGMENT_REDUCTIONS:
            raise ValueError(f"unknown pooling {name!r}; valid: {', '.join(SEGMENT_REDUCTIONS)}")
        self.name = name

    def __call__(self, hidden: torch.Tensor, meta: AttnMeta, pool_start: torch.Tensor | None) -> torch.Tensor:
        k = ops(meta)
        if self.name == "max" and meta.backend == "triton":  # the fused kernel covers the others; max is rare
            k = ops("torch")
        return k.segment_pool(hidden, meta.cu_seqlens, self.name, pool_start=pool_start)

    def rows(self, lengths: list[int], pool_start: list[int]) -> np.ndarray | None:
        if self.name not in ("cls", "lasttoken") or not lengths or min(lengths) < 1:
            return None
        n = np.asarray(lengths, dtype=np.int64)
        ends = np.cumsum(n)
        if self.name == "lasttoken":
            return ends - 1
        ps = np.asarray(pool_start, dtype=np.int64)
        if (ps >= n).any():
            return None
        return ends - n + ps


class AllTokens(PoolingMethod):
    """Every pooled row: ``[h[start + pool_start_i : end]]`` per sequence, float32 (``tokens[i].mean(0)`` is the
    ``mean`` pooling of sequence i)."""

    name = "tokens"
    knob = False  # the ``tokens`` output's method, not a way to pool one vector per input

    def __call__(self, hidden: torch.Tensor, meta: AttnMeta, pool_start: torch.Tensor | None) -> list[torch.Tensor]:
        ps = [0] * meta.num_seqs if pool_start is None else pool_start.tolist()
        out, start = [], 0
        for n, p in zip(meta.seqlens, ps):
            out.append(hidden[start + min(p, n) : start + n].float())
            start += n
        return out


# name -> method: the pooling vocabulary (the ``pooling`` knob's values, ``knob_values``; the panel's choices).
# llm2vec's ``eos_token`` reads the last token (``lasttoken``) of an input its EOS text was appended to
# (``lab.engine.framing``).
METHODS: dict[str, PoolingMethod] = {name: SegmentPool(name) for name in SEGMENT_REDUCTIONS}
METHODS["eos_token"] = METHODS["lasttoken"]
METHODS["tokens"] = AllTokens()


def register(name: str, method: PoolingMethod) -> PoolingMethod:
    """Add ``method`` to ``METHODS`` under ``name``: the ``pooling`` knob, ``configure`` and the panel then offer it
    (when ``method.knob``). Returns it.

        >>> register("first_two", FirstTwo())        # a PoolingMethod subclass; Engine(..., pooling="first_two")
    """
    if not isinstance(method, PoolingMethod):
        raise TypeError(f"a pooling method must be a lab.outputs.pooling.PoolingMethod, got {type(method).__name__}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a pooling method's name must be a non-empty string, got {name!r}")
    METHODS[name] = method
    return method


def knob_values() -> tuple[str, ...]:
    """The values the ``pooling`` knob takes: the registered methods' names that pool one vector per input."""
    return tuple(name for name, method in METHODS.items() if method.knob)


def pooling_method(name: str) -> PoolingMethod:
    """The method of a name in ``METHODS`` (``cls``, ``mean``, ``max``, ``lasttoken``, ``weightedmean``,
    ``eos_token``, ``tokens``, and any ``register`` added)."""
    method = METHODS.get(name)
    if method is None:
        raise ValueError(f"unknown pooling {name!r}; valid: {', '.join(METHODS)}")
    return method


def pool_spans(
    method: PoolingMethod,
    hidden: torch.Tensor,
    meta: AttnMeta,
    pool_start: torch.Tensor | None,
    pool_end: list[int] | None,
):
    """``method`` over each sequence's pooled span ``[pool_start_i, pool_end_i)``: the span's rows gathered into a
    packed tensor of their own (``pool_end`` ``None``: every span runs to its sequence's end, ``method`` as is).
    ``lasttoken`` always reads each sequence's last token, whatever its span (a prompt's last token,
    PromptEOL-style); ``cls`` reads the span's first.

        >>> pooled = pool_spans(pooling_method("mean"), hidden, meta, pool_start, [3, 5])    # tokens [ps_i, 3), ...
    """
    if pool_end is None or method.name == "lasttoken":
        return method(hidden, meta, pool_start)
    starts = [0] * meta.num_seqs if pool_start is None else pool_start.tolist()
    pieces, lengths, offset = [], [], 0
    for n, p, e in zip(meta.seqlens, starts, pool_end):
        e = max(1, min(e, n))
        p = min(p, e - 1)
        pieces.append(torch.arange(offset + p, offset + e))
        lengths.append(e - p)
        offset += n
    rows = torch.cat(pieces).to(hidden.device)
    spans = AttnMeta.from_lengths(lengths, causal=meta.causal, device=hidden.device, backend=meta.backend)
    return method(hidden.index_select(0, rows), spans, None)
