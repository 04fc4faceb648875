"""Kernels of prefill-lab, installed as ``lab.kernels``: each Triton kernel beside its torch reference.

- ``reference``: torch implementations of every kernel (the test oracle and the CPU path); imports no triton.
- ``attention``: varlen flash attention (causal / bidirectional, GQA, cached prefix).
- ``pooling``: fused segment pooling (cls, mean, lasttoken, weightedmean, max), optionally after an instruction
  prefix (``pool_start``); float32 out, not normalized.
- ``norms``: fused residual add + LayerNorm / RMSNorm.
- ``rotary``: in-place NeoX rotary embedding.
- ``cpu_attention``: prefill-lab's own CPU attention kernel (C, ``cpu_attention.c``, compiled on the running machine
  and called through ctypes; varlen, causal / bidirectional, GQA; a candidate of the ``attention_kernel`` probe).
- ``cpu_norms``: ``LayerNorm(x + residual)`` (in place) and ``RMSNorm(x + residual)`` (the sum and its norm in one
  pass) in the same C library (``cpu_rows.c``); candidates of the ``add_layer_norm`` / ``add_rms_norm`` probes.
- ``cpu_rope``: rotary embeddings in the ``pairs`` layout, in place, one pass, in the same C library; a candidate
  of the decoders' ``rope_kernel`` probe.
- ``tolerances``: the one (atol, rtol) table for comparing each Triton kernel with its torch reference (torch
  only; read by the kernel tests and ``evals/gpu_check.py``).

The Triton modules import ``triton`` and are loaded lazily (``lab.ops.attention.ops("triton")`` or an explicit
import), so ``import lab.kernels`` and ``lab.kernels.reference`` work where triton is absent.

    >>> from lab.kernels import reference
    >>> from lab.kernels import attention     # needs triton; CUDA tensors, or TRITON_INTERPRET=1 before import
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys


def _yield_to_the_kernels_library() -> bool:
    """Step aside when this folder was imported as a top-level ``kernels`` (the repository root on ``sys.path``).

    Python puts the current directory first on ``sys.path`` (``python -m ...``, ``python -c``, a notebook kernel
    started here), so from the repository root ``import kernels`` finds this folder before Hugging Face's
    ``kernels`` library, which transformers (>= 5.25 depends on it) imports at start-up. Then the library is
    loaded from the rest of ``sys.path`` and put in ``sys.modules`` in our place, so the import returns it.
    Without the library installed this module stays empty (no ``__version__``), which transformers reads as
    "not available". Returns whether this module is shadowing the library's name.
    """
    if __name__ != "kernels":
        return False
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("kernels", rest)
    if spec is not None and spec.loader is not None:
        library = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = library  # the import system returns whatever sits here once we finish
        try:
            spec.loader.exec_module(library)
        except BaseException:
            sys.modules.pop("kernels", None)
            raise
    return True


_SHADOWING = _yield_to_the_kernels_library()
TRITON_MODULES = ("attention", "pooling", "norms", "rotary")
__all__ = ["attention", "norms", "pooling", "reference", "rotary", "tolerances"]


def __getattr__(name: str):
    """``lab.kernels.attention`` and friends as attributes, imported on first use."""
    if name in __all__ and not _SHADOWING:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
