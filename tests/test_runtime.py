"""lab.runtime.allocator: with the malloc settings, large buffers come from the heap and stay there once freed, in the
CPU workers' threads too. Checked in fresh subprocesses (the settings are process-wide) through glibc's ``mallinfo2``
counters and the threads' page faults, not by time. The tuning is opt-in: ``Engine(tune_allocator=...)``, else
``LAB_MALLOC_TUNING``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, json, sys
from concurrent.futures import ThreadPoolExecutor
import torch
from lab.runtime.allocator import tune_cpu_allocator

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]

info = ctypes.CDLL("libc.so.6").mallinfo2
info.restype = Info
tuned = tune_cpu_allocator() if sys.argv[1] == "1" else False
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
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, tuning], capture_output=True, text=True, timeout=120, check=False
    )
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
        # (This does not see a trim threshold of 0: the freed block was not at the heap's top here. The next test
        # does.)
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
import torch
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

torch.set_num_threads(2)  # two workers of one thread each, on any machine: each worker touches its own pages
eng = Engine(sys.argv[1], cpu_workers=2, tune_allocator=sys.argv[2] == "1")
assert eng.resolved["malloc_tuning"] == (sys.argv[2] == "1"), eng.resolved
texts = stsbenchmark_sentences()  # 2,758 sentences, 11 packed steps of varied sizes
calls = []
for _ in range(4):
    before = worker_faults()
    eng.embed(texts)
    after = worker_faults()
    calls.append(sum(n - before.get(tid, 0) for tid, n in after.items()))
print(json.dumps(calls))
"""


def _worker_faults(minilm_path: str, tuning: str) -> list[int]:
    res = subprocess.run(
        [sys.executable, "-c", WORKER_FAULTS, minilm_path, tuning],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
        check=False,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt and /proc only")
def test_cpu_workers_stop_page_faulting_once_warm(minilm_path):
    """The engine's two CPU workers reuse their freed activations: from the third call on they take under a quarter
    of the minor page faults the same calls take with glibc's defaults, both measured here. On one 2-vCPU AMD EPYC
    (fewest of the third and fourth calls): 0 tuned against 64k untuned. Without the 64 MB top pad glibc unmaps each
    worker's extra heap whenever it comes free, and the tuned calls took 48k: the steps' varied sizes are what
    expose it (on one step of one size per call the pad made no difference)."""
    tuned, untuned = _worker_faults(minilm_path, "1"), _worker_faults(minilm_path, "0")
    assert tuned[0] > 0 and untuned[0] > 0, (tuned, untuned)  # the counter sees the workers' first touches
    assert 4 * min(tuned[2:]) < min(untuned[2:]), (tuned, untuned)


ENGINES = r"""
import json, sys
from lab import Engine
from lab.runtime import allocator

out = []
for arg in json.loads(sys.argv[2]):
    eng = Engine(sys.argv[1], tune_allocator=arg)
    out.append([eng.resolved["malloc_tuning"], allocator.in_effect()])
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt only")
@pytest.mark.parametrize(
    ("env", "args", "want"),
    [
        (None, [None, False, True, None], [False, False, True, True]),  # off by default; once on, on for the process
        ("0", [None], [False]),
        ("1", [False, None], [False, True]),  # the argument wins over the variable, which is the default
    ],
)
def test_engines_tune_the_allocator_only_when_asked(minilm_path, env, args, want):
    environ = {k: v for k, v in os.environ.items() if k != "LAB_MALLOC_TUNING"}
    if env is not None:
        environ["LAB_MALLOC_TUNING"] = env
    res = subprocess.run(
        [sys.executable, "-c", ENGINES, minilm_path, json.dumps(args)],
        capture_output=True,
        text=True,
        env={**environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
        check=False,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert [resolved for resolved, _ in got] == want and [state for _, state in got] == want, got


def test_malloc_tuning_variable_is_checked(monkeypatch):
    from lab.runtime.allocator import malloc_tuning_requested

    for value, want in (("1", True), ("0", False), ("", False), ("yes", True), ("Off", False), ("TRUE", True)):
        monkeypatch.setenv("LAB_MALLOC_TUNING", value)
        assert malloc_tuning_requested() is want and malloc_tuning_requested(not want) is (not want)
    monkeypatch.delenv("LAB_MALLOC_TUNING")
    assert malloc_tuning_requested() is False
    for value in ("2", " 1", "of", "enable"):
        monkeypatch.setenv("LAB_MALLOC_TUNING", value)
        with pytest.raises(ValueError, match=r"LAB_MALLOC_TUNING=.*LAB_MALLOC_TUNING=1.*LAB_MALLOC_TUNING=0"):
            malloc_tuning_requested()
        assert malloc_tuning_requested(True) is True  # an explicit argument does not read the variable


def test_engine_rejects_a_bad_setting_before_loading(monkeypatch, tmp_path):
    """A bad ``LAB_MALLOC_TUNING`` or ``tune_allocator`` fails first, naming itself (the folder here does not exist;
    its error would come next)."""
    from lab import Engine

    monkeypatch.setenv("LAB_MALLOC_TUNING", "onn")
    with pytest.raises(ValueError, match="LAB_MALLOC_TUNING='onn'"):
        Engine(str(tmp_path / "missing"))
    monkeypatch.delenv("LAB_MALLOC_TUNING")
    with pytest.raises(TypeError, match="tune_allocator must be True, False or None"):
        Engine(str(tmp_path / "missing"), tune_allocator="yes")
    with pytest.raises(FileNotFoundError):
        Engine(str(tmp_path / "missing"), tune_allocator=False)
