"""lab.runtime: with the malloc settings, large buffers come from the heap and stay there once freed, in the CPU
workers' threads too. Checked in fresh subprocesses (the settings are process-wide) through glibc's ``mallinfo2``
counters, not by time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, json
from concurrent.futures import ThreadPoolExecutor
import torch
from lab.runtime import tune_cpu_allocator

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]

info = ctypes.CDLL("libc.so.6").mallinfo2
info.restype = Info
tuned = tune_cpu_allocator()
MB = 1 << 20

def big():  # a 40 MB activation: above glibc's largest dynamic mmap threshold (32 MB)
    x = torch.empty(40 * MB // 4)
    x.fill_(1.0)
    during = info()
    del x
    after = info()
    return {"mmapped_during": during.hblkhd // MB, "heap_after": after.arena // MB}

out = {"tuned": tuned, "main": big()}
with ThreadPoolExecutor(1) as pool:  # like one of the engine's CPU workers
    out["worker"] = pool.submit(big).result()
print(json.dumps(out))
"""


def _run(tuning: str) -> dict:
    env = {**os.environ, "LAB_MALLOC_TUNING": tuning}
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    if "mallinfo2" in res.stderr:
        pytest.skip("glibc without mallinfo2 (< 2.33)")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt only")
def test_tuned_allocator_keeps_large_buffers_in_the_heap_in_main_and_worker_threads():
    tuned = _run("1")
    if not tuned["tuned"]:
        pytest.skip("mallopt unavailable (not glibc)")
    for where in ("main", "worker"):
        # served from the heap (not mapped afresh) and still there after the free: the next step reuses its pages.
        # (This does not see a trim threshold of 0: the freed block was not at the heap's top here. The next test does.)
        assert tuned[where]["mmapped_during"] < 40 and tuned[where]["heap_after"] >= 40, tuned
    plain = _run("0")  # glibc's defaults: mapped afresh, in both threads
    assert not plain["tuned"], plain
    assert plain["main"]["mmapped_during"] >= 40 and plain["worker"]["mmapped_during"] >= 40, plain


def test_malloc_settings_fit_a_c_int():
    """mallopt takes a C int; a larger value would arrive cut to its low 32 bits (1 << 40 arrives as 0: a trim
    threshold of 0 returns memory on every free), silently."""
    import ctypes

    from lab.runtime import SETTINGS

    for param, value in SETTINGS:
        assert ctypes.c_int(param).value == param and ctypes.c_int(value).value == value, (param, value)
