"""Memory ceilings (``lab.runtime.memory``): the limits read from ``/proc`` and ``/sys`` laid out as Linux lays them
out (cgroup v2, v1, hybrid), the step budget a wave runs under, and the engine under a real ``RLIMIT_AS`` in a child
process: a call whose steps would not fit runs in smaller steps with the same embeddings, a call whose longest
input would not fit is refused before it allocates, with an error naming the knobs, and the engine keeps working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.ops.probes import CANDIDATES
from lab.runtime import memory

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _machine(root: Path, avail_kb: int = 8 << 20, swap_kb: int = 0) -> None:
    _write(root, "proc/meminfo", f"MemTotal: {16 << 20} kB\nMemAvailable: {avail_kb} kB\nSwapFree: {swap_kb} kB\n")


def test_the_least_of_the_cgroup_levels_and_the_machine_is_the_ceiling(tmp_path):
    """cgroup v2: the process's group has no limit, its parent 3 GiB with 1.5 GiB in use of which 0.5 GiB is
    inactive file cache; the grandparent 8 GiB; the machine 8 GiB available: the parent's 2 GiB is what is left."""
    _machine(tmp_path)
    _write(tmp_path, "proc/self/cgroup", "0::/user/job/step\n")
    _write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpu memory\n")
    for rel, limit, current in (
        ("user/job/step", "max", GIB),
        ("user/job", str(3 * GIB), 3 * GIB // 2),
        ("user", str(8 * GIB), 2 * GIB),
    ):
        _write(tmp_path, f"sys/fs/cgroup/{rel}/memory.max", limit + "\n")
        _write(tmp_path, f"sys/fs/cgroup/{rel}/memory.current", f"{current}\n")
        _write(tmp_path, f"sys/fs/cgroup/{rel}/memory.stat", f"anon 1\ninactive_file {GIB // 2}\n")
    c = memory.ceiling(tmp_path)
    assert c.bytes == 2 * GIB and "user/job/memory.max" in c.source and "3.00 GiB limit" in c.source
    _machine(tmp_path, avail_kb=1 << 20, swap_kb=1 << 19)  # 1 GiB available + 0.5 GiB of swap
    c = memory.ceiling(tmp_path)
    assert c.bytes == 3 * GIB // 2 and "MemAvailable" in c.source


def test_cgroup_v1_hybrid_layouts_and_a_namespaced_group(tmp_path):
    _machine(tmp_path)
    # v1's memory controller; the group path is not visible inside a container: its root is the group
    _write(tmp_path, "proc/self/cgroup", "4:memory:/docker/abc\n1:cpu:/docker/abc\n")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{2 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.usage_in_bytes", f"{GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.stat", f"cache 5\ntotal_inactive_file {GIB // 4}\n")
    c = memory.ceiling(tmp_path)
    assert c.bytes == GIB + GIB // 4 and "memory.limit_in_bytes" in c.source
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    assert "MemAvailable" in memory.ceiling(tmp_path).source
    # hybrid: the unified hierarchy under unified/
    _write(tmp_path, "proc/self/cgroup", "4:memory:/\n0::/\n")
    _write(tmp_path, "sys/fs/cgroup/unified/memory.max", f"{GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/unified/memory.current", f"{GIB // 4}\n")
    c = memory.ceiling(tmp_path)
    assert c.bytes == 3 * GIB // 4 and "unified/memory.max" in c.source


def test_nothing_readable_is_no_ceiling(tmp_path):
    assert memory.ceiling(tmp_path) is None


def _need(per_token: int, kept: int = 0) -> memory.Need:
    return memory.Need(step=lambda tokens: per_token * tokens, kept=kept)


def test_fit_budget_keeps_cuts_or_refuses():
    room = 100 << 20
    limit = memory.Ceiling(memory.RESERVE + room, "RLIMIT_AS (test)")
    fits = int(room / memory.MARGIN) // 1000  # tokens of 1,000 bytes whose step fits, exactly
    kw = {"limit": limit}
    assert memory.fit_budget(_need(1000), budget=fits, tokens=10 * fits, longest=10, **kw) == fits
    assert memory.fit_budget(_need(1000), budget=10 * fits, tokens=fits, longest=10, **kw) == 10 * fits  # the call
    cut = memory.fit_budget(_need(1000), budget=10 * fits, tokens=10 * fits, longest=10, **kw)
    assert cut in (fits, fits - 1)  # the largest budget whose step fits (MARGIN's rounding)
    with pytest.raises(
        memory.MemoryLimitError,
        match=r"longest input \(\d+ tokens\).*RLIMIT_AS \(test\): lower "
        r"max_length.*long_inputs='chunk'.*chunked_prefill",
    ):
        memory.fit_budget(_need(1000), budget=10 * fits, tokens=10 * fits, longest=fits + 10, **kw)
    with pytest.raises(memory.MemoryLimitError, match=r"outputs of this call.*embed_dataset.*output='dense'"):
        memory.fit_budget(_need(1, kept=room), budget=16, tokens=16, longest=8, **kw)
    assert issubclass(memory.MemoryLimitError, MemoryError)


def test_the_check_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LAB_MEMORY_CHECK", "0")
    assert memory.fit_budget(_need(1 << 40), budget=512, tokens=512, longest=512) == 512
    monkeypatch.setenv("LAB_MEMORY_CHECK", "perhaps")
    with pytest.raises(ValueError, match="LAB_MEMORY_CHECK"):
        memory.enabled()


def test_step_bytes_counts_the_blocked_mlp_and_padding():
    sh = memory.Shapes(hidden=64, intermediate=1000, q_dim=64, kv_dim=32, layers=2, heads=4)
    whole = memory.step_bytes(sh, 4096, dtype_bytes=4)
    blocked = memory.step_bytes(memory.Shapes(**{**sh.__dict__, "ffn_rows": 1024}), 4096, dtype_bytes=4)
    assert whole - blocked == 3 * 4 * 1000 * (4096 - 1024)
    padded = memory.Shapes(**{**sh.__dict__, "padded": True})
    assert (
        memory.step_bytes(padded, 100, dtype_bytes=4, sequences=4, longest=50)
        == memory.step_bytes(sh, 200, dtype_bytes=4) + 2 * 4 * 4 * 4 * 50 * 50
    )


CHILD = """
import json, resource, sys, warnings
sys.path.insert(0, {tests!r})
import numpy as np
from tiny_models import tiny_llama
from lab import Engine
from lab.runtime import memory

folder = tiny_llama(sys.argv[1], intermediate_size=4096, max_position_embeddings=8192)
eng = Engine(str(folder), pooling="mean", max_length=8192, max_batch_tokens=1 << 16, cpu_workers=1,
             cpu_paths={{"f32_gemm": sys.argv[2]}})
texts = [("word %d " % i) * (3 + i % 40) for i in range(120)]
long_text = "word " * 3000
ref, ref_long = eng.embed(texts), eng.embed([long_text])
# from here on the process may map 160 MiB more than it has: a step of every text does not fit, a few texts do
resource.setrlimit(resource.RLIMIT_AS, (memory.status_bytes("VmSize") + (160 << 20), resource.RLIM_INFINITY))
out = {{"ceiling": memory.ceiling().source}}
if sys.argv[3] == "split":
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = eng.embed(texts)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, memory.MemoryNotice)]
    out["budget"], out["batches"], out["tokens"] = eng.stats.memory_budget, eng.stats.batches, eng.stats.tokens
    out["max_diff"] = float(np.abs(got - ref).max())
before = eng.stats
try:
    eng.embed([long_text])
    out["long"] = "ran"
except memory.MemoryLimitError as e:
    out["long"] = str(e)
out["stats_kept"] = eng.stats is before
out["after"] = float(np.abs(eng.embed(texts[:5]) - ref[:5]).max())
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
out["long_after"] = float(np.abs(eng.embed([long_text]) - ref_long).max())
print(json.dumps(out))
"""


@pytest.mark.parametrize("gemm", CANDIDATES["f32_gemm"])
def test_under_a_real_address_space_limit_a_call_is_split_or_refused_not_killed(tmp_path, gemm):
    """``RLIMIT_AS`` in a child (the tiny Llama's MLP widened to 4,096 so a step of every text needs ~400 MB), each
    float32 GEMM forced in turn: a 3,000-token input is refused naming ``max_length``, before it allocates; the
    engine's stats stay the last call's and it embeds again, and the long input runs once the limit is lifted. With
    the BLAS GEMM the texts run in steps that fit, equal to the unlimited run's embeddings. oneDNN's GEMM keeps a
    primitive per GEMM shape in its cache, address space a step's estimate does not see (``lab.runtime.memory``),
    so its cut steps are not asserted to fit."""
    split = "split" if gemm == "blas" else "refuse"
    res = subprocess.run(
        [sys.executable, "-c", CHILD.format(tests=str(Path(__file__).parent)), str(tmp_path), gemm, split],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "LAB_MEMORY_CHECK": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ceiling"].startswith("RLIMIT_AS")
    if split == "split":
        assert 0 < out["budget"] < out["tokens"] and out["batches"] > 1
        assert len(out["warnings"]) == 1 and "max_batch_tokens=65536" in out["warnings"][0]
        assert out["max_diff"] <= 1e-5
    assert "longest input" in out["long"] and "lower max_length" in out["long"] and "RLIMIT_AS" in out["long"]
    assert out["stats_kept"] and out["after"] <= 1e-5 and out["long_after"] == 0.0
