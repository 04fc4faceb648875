"""Pooling over packed hidden states: method (sentence-transformers names), then matryoshka slice, then normalize.

A pure function of hidden states and metadata (vLLM's pooler shape): ``cls`` = first pooled token, ``lasttoken`` =
``h[cu[1:] - 1]``, ``mean`` / ``weightedmean`` accumulated in float32, ``max`` per feature. Tokens before
``pool_start`` (an instruction) are attended to but not pooled.

    >>> emb = pool(hidden, meta, "mean", pool_start=None, backend="torch")       # (B, H) float32
    >>> emb = finish(emb, truncate_dim=128, normalize=True)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from lab.attention import ops
from lab.batch import AttnMeta
from lab.kernels.reference import POOLING_METHODS

__all__ = ["POOLING_METHODS", "finish", "pool", "pooled_rows"]


def pool(hidden: torch.Tensor, meta: AttnMeta, method: str, *, pool_start: torch.Tensor | None = None,
         weight_offset: torch.Tensor | None = None) -> torch.Tensor:
    """Pool ``(T, H)`` packed hidden states into ``(B, H)`` float32, one row per sequence of ``meta``."""
    if method not in POOLING_METHODS:
        raise ValueError(f"unknown pooling {method!r}; valid: {', '.join(POOLING_METHODS)}")
    k = ops(meta)
    if method == "max" and meta.backend == "triton":  # the fused kernel covers the others; max is rare
        k = ops("torch")
    return k.segment_pool(hidden, meta.cu_seqlens, method, pool_start=pool_start, weight_offset=weight_offset)


def pooled_rows(lengths: list[int], method: str, pool_start: list[int] | None = None) -> np.ndarray | None:
    """The one packed row per sequence that ``cls`` / ``lasttoken`` pooling reads (the rows ``pool`` gathers), or
    ``None`` for poolings over many rows (and for an empty sequence or a ``cls`` past its sequence's end)."""
    if method not in ("cls", "lasttoken") or not lengths or min(lengths) < 1:
        return None
    n = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(n)
    if method == "lasttoken":
        return ends - 1
    ps = np.zeros_like(n) if pool_start is None else np.asarray(pool_start, dtype=np.int64)
    if (ps >= n).any():
        return None
    return ends - n + ps


def finish(pooled: torch.Tensor, *, truncate_dim: int | None, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation (before normalization, so truncated vectors are unit length), then L2 normalize."""
    if truncate_dim is not None:
        if truncate_dim > pooled.shape[-1]:
            raise ValueError(f"truncate_dim={truncate_dim} exceeds the embedding size {pooled.shape[-1]}")
        pooled = pooled[:, :truncate_dim]
    if normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled
