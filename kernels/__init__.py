"""Kernels of prefill-lab, installed as ``lab.kernels``: each Triton kernel beside its torch reference.

- ``reference``: torch implementations of every kernel (the test oracle and the CPU path); imports no triton.
- ``attention``: varlen flash attention (causal / bidirectional, GQA, cached prefix).
- ``pooling``: fused segment pooling (cls, mean, lasttoken, weightedmean, max), optionally after an instruction
  prefix (``pool_start``); float32 out, not normalized.
- ``norms``: fused residual add + LayerNorm / RMSNorm.
- ``rotary``: in-place NeoX rotary embedding.
- ``tolerances``: the one (atol, rtol) table for comparing each Triton kernel with its torch reference (torch
  only; read by the kernel tests and ``evals/gpu_check.py``).

The Triton modules import ``triton`` and are loaded lazily (``lab.attention.ops("triton")`` or an explicit
import), so ``import lab.kernels`` and ``lab.kernels.reference`` work where triton is absent.

    >>> from lab.kernels import reference
    >>> from lab.kernels import attention     # needs triton; CUDA tensors, or TRITON_INTERPRET=1 before import
"""

from __future__ import annotations

import importlib

TRITON_MODULES = ("attention", "pooling", "norms", "rotary")
__all__ = ["attention", "norms", "pooling", "reference", "rotary", "tolerances"]


def __getattr__(name: str):
    """``lab.kernels.attention`` and friends as attributes, imported on first use."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
