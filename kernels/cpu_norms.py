"""``LayerNorm(x + residual)`` and ``RMSNorm(x + residual)`` on CPU in prefill-lab's own C library
(``cpu_rows.c``, built and loaded by ``lab.kernels.cpu_attention``), one pass per row.

``add_layer_norm`` writes where the caller says: into ``x`` itself when ``x`` is a GEMM output nothing else reads,
so a BERT layer's two post-norms allocate nothing. ``add_rms_norm`` is the pre-norm of Llama-style blocks: the sum
(the next residual) and its norm from one pass, against torch's five (``lab.models.decoder``). Candidates of the
``add_layer_norm`` / ``add_rms_norm`` probes, never defaults chosen by CPU flags.

Arithmetic in float32 for float32 and bfloat16 inputs alike; for bfloat16 the sum is rounded to bfloat16 first and
the output at the end (RMSNorm: also the normalised value before the weight), as torch's ops round them. Matches
``lab.kernels.reference.add_layer_norm`` / ``add_rms_norm`` within float32 rounding (``tests/test_cpu_norms.py``).

    >>> y = add_layer_norm(h, x, weight, bias, 1e-12, out=h)      # h (T, n), x (T, n); returns h
    >>> y, s = add_rms_norm(h, residual, weight, 1e-5)             # s = h + residual, y = RMSNorm(s) * weight
"""

from __future__ import annotations

import ctypes

import torch
from lab.kernels import cpu_attention
from lab.kernels.cpu_attention import DTYPES, WIDTH, available, unavailable_reason

__all__ = ["add_layer_norm", "add_rms_norm", "available", "chosen", "supports", "unavailable_reason"]


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes ``x`` with these parameters: CPU float32 / bfloat16, 2-D with contiguous rows of a
    multiple of ``WIDTH`` elements, ``weight`` (and ``bias``) of ``x``'s dtype, one value per column."""
    n = x.shape[-1] if x.dim() else 0
    params = [weight] if bias is None else [weight, bias]
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and x.dim() == 2
        and n > 0
        and n % WIDTH == 0
        and x.stride(-1) == 1
        and all(p.dtype == x.dtype and p.device.type == "cpu" and p.shape == (n,) for p in params)
    )


def chosen(
    choice: str | None, backend: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> bool:
    """Whether a layer runs its norm here: its probe's ``choice`` is ``lab``, the ``backend`` is not Triton (which
    keeps its own norms), nothing records gradients (these kernels have no backward), and they take ``x``."""
    return cpu_attention.chosen(choice, backend) and supports(x, weight, bias)


def _rows(name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be a {tuple(like.shape)} {like.dtype} CPU tensor with contiguous rows like x; "
            f"got {tuple(t.shape)} {t.dtype} on {t.device} with strides {t.stride()}"
        )
    return t


def _checked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL | None) -> ctypes.CDLL:
    """The library to call (``lib`` or this machine's build), once ``x`` and the parameters are ones it takes."""
    lib = cpu_attention.library(lib, "lab.kernels.cpu_norms")
    if not supports(x, weight, bias):
        raise ValueError(
            f"cpu_norms takes a CPU float32/bfloat16 x (T, n) with contiguous rows, n a multiple of "
            f"{WIDTH}, and weight/bias (n,) of x's dtype; got x {tuple(x.shape)} {x.dtype} on {x.device} "
            f"(strides {x.stride()}), weight {tuple(weight.shape)} {weight.dtype}"
            + ("" if bias is None else f", bias {tuple(bias.shape)} {bias.dtype}")
        )
    return lib


def _returned(rc: int) -> None:
    if rc == 2:
        raise MemoryError("cpu_norms could not allocate its row scratch")
    if rc:
        raise ValueError(f"cpu_norms rejected the shapes (code {rc})")


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """``LayerNorm(x + residual) * weight + bias`` over the last dim of ``x`` ``(T, n)`` (``residual=None``: plain
    LayerNorm), into ``out`` (a ``(T, n)`` tensor like ``x``, which may be ``x`` or ``residual`` themselves: each row
    is read before it is written; default a new tensor), which it returns. Runs on the calling thread. ``lib``: a
    build other than this machine's (``cpu_attention.bind``)."""
    lib = _checked(x, weight, bias, lib)
    if residual is not None:
        _rows("residual", residual, x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else _rows("out", out, x)
    w, b = weight.contiguous(), None if bias is None else bias.contiguous()
    rc = lib.lab_add_layer_norm(
        int(x.dtype == torch.bfloat16),
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        w.data_ptr(),
        None if b is None else b.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        x.shape[0],
        x.shape[1],
        float(eps),
    )
    _returned(rc)
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    lib: ctypes.CDLL | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(s) * weight, s)`` with ``s = x + residual`` (``residual=None``: ``s`` is ``x`` itself) over the
    last dim of ``x`` ``(T, n)``, as ``lab.kernels.reference.add_rms_norm`` returns them; ``s`` is a new tensor,
    the norm goes into ``out`` (a ``(T, n)`` tensor like ``x``, which may be ``x`` itself when ``residual`` is given;
    default a new tensor). Runs on the calling thread. ``lib``: a build other than this machine's."""
    lib = _checked(x, weight, None, lib)
    if residual is not None:
        _rows("residual", residual, x)
    if out is not None and residual is None and out.data_ptr() == x.data_ptr():
        raise ValueError("add_rms_norm: out may be x only when a residual is given (x is then the returned sum)")
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else _rows("out", out, x)
    s = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    w = weight.contiguous()  # held until the call returns
    rc = lib.lab_add_rms_norm(
        int(x.dtype == torch.bfloat16),
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        w.data_ptr(),
        None if residual is None else s.data_ptr(),
        s.stride(0),
        out.data_ptr(),
        out.stride(0),
        x.shape[0],
        x.shape[1],
        float(eps),
    )
    _returned(rc)
    return out, s
