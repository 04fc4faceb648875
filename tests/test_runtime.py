"""lab.runtime.allocator: with the malloc settings, large buffers come from the heap and stay there once freed, in the CPU
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
from lab.runtime.allocator import tune_cpu_allocator

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

    from lab.runtime.allocator import SETTINGS

    for param, value in SETTINGS:
        assert ctypes.c_int(param).value == param and ctypes.c_int(value).value == value, (param, value)


WORKER_FAULTS = r"""
import json, sys, threading
from lab import Engine
from evals.data_io import stsbenchmark_sentences

def worker_faults():  # minor page faults taken so far by each of the engine's CPU worker threads
    out = {}
    for t in threading.enumerate():
        if t.name.startswith("lab-cpu-worker") and t.native_id:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                stat = f.read()
            out[t.native_id] = int(stat[stat.rindex(")") + 2:].split()[7])
    return out

eng = Engine(sys.argv[1], cpu_workers=2)
texts = stsbenchmark_sentences()[:1000]
calls = []
for _ in range(4):
    before = worker_faults()
    eng.embed(texts)
    after = worker_faults()
    calls.append(sum(n - before.get(tid, 0) for tid, n in after.items()))
print(json.dumps(calls))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt and /proc only")
def test_cpu_workers_stop_page_faulting_once_warm(minilm_path):
    """The engine's two CPU workers reuse their freed activations: from the third call on, next to no minor page faults
    in their threads. Without the 64 MB top pad glibc unmapped each worker's extra heap whenever it came free, and
    the fourth call of this test took 22-23k faults (untuned: 29k); with it, 0-3k (session 20, AMD EPYC)."""
    env = {**os.environ, "LAB_MALLOC_TUNING": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", WORKER_FAULTS, minilm_path], capture_output=True, text=True, env=env,
                         timeout=600, check=False, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-2000:]
    calls = json.loads(res.stdout.strip().splitlines()[-1])
    assert calls[0] > 0, calls  # the counter sees the workers' first touches
    assert min(calls[2:]) < 8000, calls
