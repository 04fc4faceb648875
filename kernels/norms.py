"""Fused residual-add + norm in Triton: must match ``lab.kernels.reference.add_layer_norm`` / ``add_rms_norm``.

One program per row (``BLOCK_N`` = next power of two of the hidden size). The residual add happens in the input
dtype, exactly as the reference's ``x + residual`` rounds it; the statistics are float32. ``add_rms_norm`` follows
transformers' ``LlamaRMSNorm``: normalize in float32, cast back to the input dtype, then multiply by the weight
(output dtype = ``promote(weight, x)``), and also returns the sum for the next residual.

    >>> y = add_layer_norm(x, residual, weight, bias, 1e-12)          # BERT post-norm, (T, H)
    >>> normed, summed = add_rms_norm(x, residual, weight, 1e-6)      # Llama pre-norm
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_device

# read at import, when @triton.jit decorated the kernels (see lab.kernels.attention)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _add_layer_norm_kernel(
    X,
    R,
    W,
    B,
    Y,
    stride_x,
    stride_r,
    stride_y,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)  # in the input dtype, as torch rounds it
    s = x.to(tl.float32)
    mean = tl.sum(s, 0) / n_cols
    diff = tl.where(mask, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, 0) / n_cols + eps)  # biased variance, as F.layer_norm
    y = diff * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    X,
    R,
    W,
    Y,
    S,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(S + row * stride_s + cols, x, mask=mask)
    h = x.to(tl.float32)
    h = h / tl.sqrt(tl.sum(h * h, 0) / n_cols + eps)
    h = h.to(X.dtype.element_ty).to(tl.float32)  # LlamaRMSNorm casts back before the weight multiply
    y = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) * h
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def _rows(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """Validate and view ``t`` as ``(rows, N)`` with unit stride along N."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_device(name, t)
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} must be one of {_DTYPES}, got {t.dtype}")
    if like is not None and (t.shape != like.shape or t.dtype != like.dtype):
        raise ValueError(f"{name} must match x: {tuple(like.shape)} {like.dtype}, got {tuple(t.shape)} {t.dtype}")
    if t.dim() < 1:
        raise ValueError(f"{name} must have a hidden dimension, got a scalar")
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _param(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    if t.shape != (n,):
        raise ValueError(f"{name} must be ({n},), got {tuple(t.shape)}")
    check_device(name, t)
    return t.contiguous()


def _launch_opts(n: int) -> dict:
    block = triton.next_power_of_2(n)
    return {"BLOCK_N": block, "num_warps": 4 if block <= 2048 else 8 if block <= 8192 else 16}


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """``LayerNorm(x + residual)`` over the last dim, in ``x.dtype``; see ``reference.add_layer_norm``."""
    x2 = _rows("x", x)
    n = x.shape[-1]
    r2 = _rows("residual", residual, like=x) if residual is not None else x2
    w = _param("weight", weight, n)
    b = _param("bias", bias, n) if bias is not None else w
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if y.numel():
        _add_layer_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            w,
            b,
            y,
            x2.stride(0),
            r2.stride(0),
            y.stride(0),
            n,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            HAS_BIAS=bias is not None,
            **_launch_opts(n),
        )
    return y.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual``; returns ``(RMSNorm(s) * weight, s)``; see ``reference.add_rms_norm``.

    With ``residual=None`` the second result is ``x`` itself, as in the reference.
    """
    x2 = _rows("x", x)
    n = x.shape[-1]
    r2 = _rows("residual", residual, like=x) if residual is not None else x2
    w = _param("weight", weight, n)
    y = torch.empty((x2.shape[0], n), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    s = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device) if residual is not None else x2
    if y.numel():
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            w,
            y,
            s,
            x2.stride(0),
            r2.stride(0),
            y.stride(0),
            s.stride(0),
            n,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            **_launch_opts(n),
        )
    return y.view(x.shape), (s.view(x.shape) if residual is not None else x)
