"""Kernel dispatch: Triton on CUDA, the torch references elsewhere, with an override (``attention_backend``).

Model code calls ``attention(q, k, v, meta, layer)`` and ``ops(meta)`` for fused norms / rotary; which
implementation runs is decided here from ``meta.backend`` (resolved once by the engine from its knob).

    >>> out = attention(q, k, v, meta, layer=0)     # q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D)
    >>> h = ops(meta).add_layer_norm(x, residual, w, b, eps)
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from lab.batch import AttnMeta
from lab.kernels import reference

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` on CUDA (when triton imports), else ``torch``; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention_backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the `triton` package; pip install triton")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' on CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1 "
                "before importing torch/triton (slow, for debugging), or use attention_backend='torch'"
            )
    return backend


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_TORCH_OPS = SimpleNamespace(
    varlen_attention=reference.varlen_attention,
    add_layer_norm=reference.add_layer_norm,
    add_rms_norm=reference.add_rms_norm,
    apply_rotary=reference.apply_rotary,
    segment_pool=reference.segment_pool,
)
_TRITON_OPS: SimpleNamespace | None = None


def ops(meta_or_backend: AttnMeta | str) -> SimpleNamespace:
    """The kernel set for a backend name (or the backend an ``AttnMeta`` carries)."""
    global _TRITON_OPS
    backend = meta_or_backend if isinstance(meta_or_backend, str) else meta_or_backend.backend
    if backend != "triton":
        return _TORCH_OPS
    if _TRITON_OPS is None:
        from lab.kernels import attention as ka
        from lab.kernels import norms as kn
        from lab.kernels import pooling as kp
        from lab.kernels import rotary as kr

        _TRITON_OPS = SimpleNamespace(
            varlen_attention=ka.varlen_attention,
            add_layer_norm=kn.add_layer_norm,
            add_rms_norm=kn.add_rms_norm,
            apply_rotary=kr.apply_rotary,
            segment_pool=kp.segment_pool,
        )
    return _TRITON_OPS


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta, layer: int) -> torch.Tensor:
    """Varlen attention for one layer of one packed step, reading and capturing cached K/V through ``meta.kv``.

    q ``(T, Hq, D)``, k/v ``(T, Hkv, D)`` -> ``(T, Hq, D)``.
    """
    kw = {}
    kv = meta.kv
    if kv is not None:
        if kv.capture is not None:
            kv.capture(layer, k, v)
        if kv.has_prefix:
            kw = {
                "k_prefix": kv.prefix_k[layer], "v_prefix": kv.prefix_v[layer], "cu_prefix": kv.cu_prefix,
                "prefix_lens": kv.prefix_lens,
            }
    return ops(meta).varlen_attention(
        q, k, v, meta.cu_seqlens, meta.max_seqlen, causal=meta.causal, seqlens=meta.seqlens, **kw
    )
