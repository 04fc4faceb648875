"""Fused segment pooling in Triton: must match ``lab.kernels.reference.segment_pool``.

One program per sequence holds the whole hidden row (``BLOCK_H`` = next power of two of ``H``) and walks its
tokens ``BLOCK_T`` at a time, accumulating in float32 (vLLM: mean pooling "otherwise precision will be lost
significantly"), then stores the row once. ``cls`` and ``lasttoken`` load one row. Index rules (``pool_start``
clamped to the sequence end, ``cls`` clamped to the last row, the 1-based weighted-mean positions within the pooled
span) follow the reference line for line. No normalization: ``lab.outputs.heads.EmbeddingHead`` does that afterwards.

    >>> emb = segment_pool(hidden, cu_seqlens, "mean")    # hidden (T, H) -> (B, H) float32
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lab.kernels.reference import SEGMENT_REDUCTIONS

from ._launch import check_device

# read at import, when @triton.jit decorated the kernel (see lab.kernels.attention)
_METHOD_CODE = {"cls": 0, "lasttoken": 1, "mean": 2, "weightedmean": 3, "max": 4}
MAX_HIDDEN = 32768


@triton.jit(do_not_specialize=["total"])  # the token count changes every step: no recompiles for it
def _segment_pool_kernel(
    H,
    CU,
    POOL_START,
    OUT,
    stride_t,
    hidden,
    total,
    METHOD: tl.constexpr,
    HAS_START: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    seq = tl.program_id(0)
    start = tl.load(CU + seq).to(tl.int32)
    end = tl.load(CU + seq + 1).to(tl.int32)
    if HAS_START:  # instruction tokens: attended, not pooled
        start = tl.minimum(start + tl.load(POOL_START + seq).to(tl.int32), end)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < hidden

    if METHOD == 0:  # cls: first pooled token (the reference clamps into the tensor)
        row = tl.minimum(start, total - 1).to(tl.int64)
        acc = tl.load(H + row * stride_t + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    elif METHOD == 1:  # lasttoken
        row = tl.maximum(end - 1, 0).to(tl.int64)
        acc = tl.load(H + row * stride_t + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    elif METHOD == 4:  # max
        acc = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        offs_t = tl.arange(0, BLOCK_T)
        for t0 in range(start, end, BLOCK_T):
            rows = t0 + offs_t  # (BLOCK_T,)
            mask = (rows < end)[:, None] & h_mask[None, :]
            x = tl.load(H + rows[:, None].to(tl.int64) * stride_t + offs_h[None, :], mask=mask, other=float("-inf"))
            acc = tl.maximum(acc, tl.max(x.to(tl.float32), 0))
        acc = tl.where(h_mask, acc, 0.0)
    else:  # mean / weightedmean: weighted sum over the pooled span, float32
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        denom = tl.zeros((BLOCK_T,), dtype=tl.float32)
        offs_t = tl.arange(0, BLOCK_T)
        for t0 in range(start, end, BLOCK_T):
            rows = t0 + offs_t
            row_mask = rows < end
            x = tl.load(
                H + rows[:, None].to(tl.int64) * stride_t + offs_h[None, :],
                mask=row_mask[:, None] & h_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            if METHOD == 3:  # 1-based position within the pooled span
                w = (rows - start + 1).to(tl.float32)
            else:
                w = tl.full((BLOCK_T,), 1.0, dtype=tl.float32)
            w = tl.where(row_mask, w, 0.0)
            acc += tl.sum(x * w[:, None], 0)
            denom += w
        acc = acc / tl.maximum(tl.sum(denom, 0), 1e-9)
    tl.store(OUT + seq.to(tl.int64) * hidden + offs_h, acc, mask=h_mask)


def segment_pool(
    hidden: torch.Tensor,
    cu_seqlens: torch.Tensor,
    method: str,
    *,
    pool_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool packed ``hidden`` ``(total, H)`` per sequence into ``(B, H)`` float32; see ``reference.segment_pool``."""
    if method not in SEGMENT_REDUCTIONS:
        raise ValueError(f"unknown pooling {method!r}; valid: {', '.join(SEGMENT_REDUCTIONS)}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a (total, H) tensor, got {getattr(hidden, 'shape', type(hidden))}")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a (B + 1,) int tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    total, h = hidden.shape
    b = cu_seqlens.numel() - 1
    if pool_start is not None and (pool_start.shape != (b,) or pool_start.is_floating_point()):
        raise ValueError(f"pool_start must be a ({b},) int tensor, got {pool_start.dtype} {tuple(pool_start.shape)}")
    if h > MAX_HIDDEN:
        raise ValueError(f"hidden size {h} > {MAX_HIDDEN} is not supported by the fused kernel")
    for name, t in (("hidden", hidden), ("cu_seqlens", cu_seqlens), ("pool_start", pool_start)):
        if t is not None:
            check_device(name, t)
    out = torch.zeros((b, h), dtype=torch.float32, device=hidden.device)
    if b == 0 or h == 0 or total == 0:
        return out  # (the reference cannot index an empty tensor; zeros are the sensible answer)
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    block_h = triton.next_power_of_2(h)
    block_t = max(2, min(32, 8192 // block_h))
    _segment_pool_kernel[(b,)](
        hidden,
        cu_seqlens,
        pool_start if pool_start is not None else cu_seqlens,  # a placeholder, never read without HAS_START
        out,
        hidden.stride(0),
        h,
        total,
        METHOD=_METHOD_CODE[method],
        HAS_START=pool_start is not None,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        num_warps=4 if block_h <= 1024 else 8,
    )
    return out
