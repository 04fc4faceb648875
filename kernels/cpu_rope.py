"""Rotary position embeddings in the ``pairs`` layout on CPU, in place, in prefill-lab's own C library
(``cpu_rows.c``, built and loaded by ``lab.kernels.cpu_attention``): one pass over the query and key heads.

``lab.models.rope.rotate_pairs_`` rotates float32 heads as a complex view of themselves, but bfloat16 heads through a
float32 copy, rounded back at the end: three passes. ``rotate_pairs_`` here reads each pair, multiplies it by the
row's ``(cos, sin)`` in float32 and stores it (bfloat16 rounded once, to nearest even, as torch's copy rounds). A
candidate of the decoders' ``rope_kernel`` probe, never a default chosen by CPU flags. Equal to the torch path within
float32 rounding (bfloat16: the same values but where a float32 rounding difference crosses a bfloat16 rounding
boundary, one step; ``tests/test_cpu_rope.py``).

    >>> rotate_pairs_(both, rope.cis)      # both (T, Hq + Hkv, D), a view of a fused projection's q/k columns
"""

from __future__ import annotations

import ctypes

import torch
from lab.kernels import cpu_attention
from lab.kernels.cpu_attention import DTYPES, available, unavailable_reason

__all__ = ["available", "chosen", "rotate_pairs_", "supports", "unavailable_reason"]


def supports(x: torch.Tensor, cis: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` ``(T, H, D)`` (CPU float32 / bfloat16, D even and contiguous) with ``cis``
    ``(T, D/2)`` complex64 on the CPU."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and x.dim() == 3
        and x.shape[2] > 0
        and x.shape[2] % 2 == 0
        and x.stride(2) == 1
        and cis.dtype == torch.complex64
        and cis.device.type == "cpu"
        and cis.shape == (x.shape[0], x.shape[2] // 2)
    )


def chosen(choice: str | None, backend: str, x: torch.Tensor) -> bool:
    """Whether a decoder layer rotates ``x``'s heads here: the ``rope_kernel`` probe's ``choice`` is ``lab``, the
    torch backend runs and nothing records gradients (``cpu_attention.chosen``), and ``x`` is a CPU float32 /
    bfloat16 tensor (the layout's tables are complex64 whatever the dtype)."""
    return cpu_attention.chosen(choice, backend) and x.device.type == "cpu" and x.dtype in DTYPES


def rotate_pairs_(x: torch.Tensor, cis: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rotate ``x`` ``(T, H, D)`` in place by ``cis`` ``(T, D/2)`` (any token and head strides, D contiguous);
    returns ``x``. ``lib``: a build other than this machine's (``cpu_attention.bind``)."""
    lib = cpu_attention.library(lib, "lab.kernels.cpu_rope")
    if not supports(x, cis):
        raise ValueError(
            f"cpu_rope takes a CPU float32/bfloat16 x (T, H, D) with D even and contiguous and a "
            f"complex64 cis (T, D/2); got x {tuple(x.shape)} {x.dtype} strides {x.stride()} on "
            f"{x.device}, cis {tuple(cis.shape)} {cis.dtype}"
        )
    pairs = torch.view_as_real(cis.resolve_conj())  # (T, D/2, 2) float32: (cos, sin)
    if pairs.stride(2) != 1 or pairs.stride(1) != 2:
        pairs = pairs.contiguous()
    rc = lib.lab_rope_pairs(
        int(x.dtype == torch.bfloat16),
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        pairs.data_ptr(),
        pairs.stride(0),
        x.shape[0],
        x.shape[1],
        x.shape[2],
    )
    if rc:
        raise ValueError(f"cpu_rope rejected the shapes (code {rc})")
    return x
