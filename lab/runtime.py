"""Process-level CPU tuning: keep large freed buffers in the heap instead of returning them to the kernel.

A packed step allocates a few large activations (``tokens x intermediate`` floats, tens of MB). glibc serves
allocations above its mmap threshold (at most 32 MB) with fresh ``mmap`` pages, so every step pays page faults
on its biggest tensors — on a VM that costs as much as the GELU that fills them. Disabling mmap for malloc and
raising the trim threshold lets freed activations be reused by the next step. This is process-wide (every
library in the process benefits, the sentence-transformers baseline included), idempotent, and skipped with
``LAB_MALLOC_TUNING=0`` or off glibc.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_done = False


def tune_cpu_allocator() -> bool:
    """Apply the malloc settings once; returns whether they are in effect."""
    global _done
    if _done:
        return True
    if os.environ.get("LAB_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 40) == 1
    except (OSError, AttributeError):  # musl or another libc without mallopt
        return False
    _done = ok
    return ok
