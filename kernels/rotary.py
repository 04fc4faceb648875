"""Rotary position embedding in Triton, in place: must match ``lab.kernels.reference.apply_rotary``.

NeoX / Llama layout: the head dim splits into halves ``(x1, x2)``, rotated as ``x1*cos - x2*sin`` and
``x2*cos + x1*sin`` with per-token ``cos``/``sin`` of shape ``(T, D/2)``. One program per (token, block of heads)
loads that token's cos/sin once. Like the reference, cos/sin are first rounded to ``x.dtype``; the products are
then taken in float32 and rounded once (the reference rounds each product in ``x.dtype``, a slightly larger error).

    >>> apply_rotary(q, cos, sin)      # q (T, Hq, D) rotated in place; works on strided views of a fused qkv
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_device

# read at import, when @triton.jit decorated the kernel (see lab.kernels.attention)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotary_kernel(
    X,
    COS,
    SIN,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    n_heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    d_mask = offs < half
    # round cos/sin to x's dtype first, as the reference does
    c = tl.load(COS + tok * stride_ct + offs, mask=d_mask, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    s = tl.load(SIN + tok * stride_st + offs, mask=d_mask, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    ptrs = X + tok * stride_xt + heads[:, None].to(tl.int64) * stride_xh + offs[None, :]  # (BLOCK_H, BLOCK_HALF)
    mask = (heads < n_heads)[:, None] & d_mask[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (x1 * c[None, :] - x2 * s[None, :]).to(X.dtype.element_ty), mask=mask)
    tl.store(ptrs + half, (x2 * c[None, :] + x1 * s[None, :]).to(X.dtype.element_ty), mask=mask)


def _check(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-D tensor, got {getattr(t, 'shape', type(t))}")
    check_device(name, t)
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} must be one of {_DTYPES}, got {t.dtype}")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, H, D)`` in place (NeoX halves) by ``cos``/``sin`` ``(T, D/2)``; returns ``x``."""
    _check("x", x, 3)
    _check("cos", cos, 2)
    _check("sin", sin, 2)
    t, h, d = x.shape
    if d % 2:
        raise ValueError(f"rotary needs an even head dim, got {d}")
    if cos.shape != (t, d // 2) or sin.shape != (t, d // 2):
        raise ValueError(f"cos/sin must be (T={t}, D/2={d // 2}), got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x must have unit stride along the head dim (it is rotated in place)")
    if x.numel() == 0:
        return x
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    block_half = triton.next_power_of_2(d // 2)
    block_h = min(triton.next_power_of_2(h), max(1, 2048 // block_half))
    grid = (t, triton.cdiv(h, block_h))
    _rotary_kernel[grid](
        x,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        h,
        d // 2,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
    return x
