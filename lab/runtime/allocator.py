"""Process-level CPU tuning, opt-in: keep large freed buffers in the heap instead of returning them to the kernel.

Off unless asked for: ``Engine(..., tune_allocator=True)``, or ``LAB_MALLOC_TUNING=1`` in the environment as the
default of engines created without the argument (``0`` or unset: off; ``malloc_tuning_requested`` reads it). The demo
and the benchmarks turn it on and record it (``Engine.resolved["malloc_tuning"]``, a ``malloc_tuning`` column).

What it does. A packed step allocates a few large activations (``tokens x intermediate`` floats, tens of MB). By
default glibc serves allocations above its mmap threshold (at most 32 MB) with fresh ``mmap`` pages, trims freed
memory at the top of the heap back to the kernel, and gives each thread its own arena, whose heaps are at most 64 MB
and which serves larger requests with ``mmap`` whatever ``M_MMAP_MAX`` says (glibc 2.36: 63 and 80 MB buffers
allocated and freed in a worker thread faulted in every page on every round). So every step pays page faults on its
biggest tensors, in the CPU workers above all. ``tune_cpu_allocator`` turns that off: no ``mmap`` for malloc, a trim
threshold of ``INT_MAX`` (mallopt takes a C ``int``), a top pad of 64 MB, and one arena for every thread, so freed
activations are reused by the next step and packed calls stop page-faulting on fresh memory; what that saves in
time depends on the model and dtype (SmolLM2-135M in float32: a wash). Measured: evals/README.md, "Measurements
behind the code's choices".

The top pad matters because the one-arena setting usually comes too late: glibc fixes its arena limit when a second
thread first allocates, which torch's import has already done, so each CPU worker still gets its own arena of 64 MB
heaps, and glibc unmaps a worker's extra heap as soon as it is wholly free unless the top pad covers it. Without the
pad the workers fault their activations in again and spend kernel time on it in every call, and the calls run slower
(measured as above; ``tests/test_runtime.py`` compares the workers' faults with these settings and with glibc's
defaults).

What it costs. The settings are process-wide and cannot be undone: every library in the process is affected (a
sentence-transformers baseline included), and the process keeps its peak heap until it exits (memory freed after
a large call is not returned to the system; RSS stays at its high-water mark). Idempotent; a no-op off glibc.
"""

from __future__ import annotations

import ctypes
import sys

from lab import env

ENV = "LAB_MALLOC_TUNING"
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8
_INT_MAX = 2**31 - 1
SETTINGS = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX), (_M_TOP_PAD, 64 << 20), (_M_ARENA_MAX, 1))
_done = False


def malloc_tuning_requested(tune_allocator: bool | None = None) -> bool:
    """Whether an engine asks for the tuning: ``tune_allocator`` when given, else ``$LAB_MALLOC_TUNING`` (a switch read
    by ``lab.env.flag``: ``1`` / ``true`` / ``yes`` / ``on`` or ``0`` / ``false`` / ``no`` / ``off``; empty or unset:
    off). Raises ``TypeError`` for a non-bool argument and ``ValueError`` for another value of the variable."""
    if tune_allocator is not None:
        if not isinstance(tune_allocator, bool):
            raise TypeError(
                f"tune_allocator must be True, False or None (None: ${ENV} decides), got {tune_allocator!r}"
            )
        return tune_allocator
    return env.flag(ENV, False)


def in_effect() -> bool:
    """Whether ``tune_cpu_allocator`` has applied the settings in this process."""
    return _done


def tune_cpu_allocator() -> bool:
    """Apply the malloc settings to this process once; returns whether they are in effect (``False`` off glibc)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl or another libc without mallopt
        return False
    # every value must fit a C int: ctypes passes a larger Python int cut to its low 32 bits (1 << 40 as the trim
    # threshold would arrive as 0: trim on every free, the opposite of the intent)
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    return _done
