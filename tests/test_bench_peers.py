"""evals/bench_peers.py and evals/peers/ without the peers' venv: the worker protocol driven end to end with fake
systems in real subprocesses, the row assembly and its matching rule, the CSV columns, the round order, the system
selection, and the requirements hash that keys the peers' venv (its build steps checked with ``subprocess.run``
replaced: nothing is installed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

from lab._repo import ROOT, import_evals

bench = import_evals("bench_peers")
workers = import_evals("bench_peers_workers")
report = import_evals("bench_peers_report")
worker = import_evals("peers.worker")
venv = import_evals("peers.venv")

FAKE = textwrap.dedent("""
    import time, zlib
    import numpy as np

    class Fake:
        '''Vectors from each text's CRC (plus ``noise`` times another fixed draw), tokens = words.'''

        def __init__(self, model, noise=0.0, delay=0.0, precision="float32", roofline=None):
            self.noise, self.delay = noise, delay
            self.info = {"precision": precision, "packages": "fake=1.0", "settings": f"noise={noise}"}
            if roofline:
                self.info["roofline_tokens_per_s"] = roofline

        def encode(self, texts):
            print("a library's chatter on stdout")  # must not reach the protocol
            time.sleep(self.delay)
            rows = [np.random.default_rng(zlib.crc32(t.encode())).standard_normal(16)
                    + self.noise * np.random.default_rng(len(t) + 7).standard_normal(16) for t in texts]
            return np.array(rows, dtype=np.float32)

        def tokens(self, texts):
            return sum(len(t.split()) for t in texts)
""")
TEXTS = {
    "short": ["a cat", "two dogs run", "hello", "the quick brown fox"],
    "long": ["word " * 40, "another long text " * 10, "x y z"],
}


def fake_peer(tmp_path, name: str):
    (tmp_path / "fake_peer.py").write_text(FAKE, encoding="utf-8")
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(tmp_path)!r}]\n"
        "from evals.peers import worker\nfrom fake_peer import Fake\n"
        "worker.KINDS['fake'] = Fake\nworker.serve()\n"
    )
    return workers.Peer(name, [sys.executable, "-c", code], log_path=tmp_path / f"{name}.log")


def start_fakes(tmp_path, options: dict[str, dict]):
    peers, loads = {}, {}
    for name, opts in options.items():
        peers[name] = fake_peer(tmp_path, name)
        loads[name] = peers[name].call("load", kind="fake", model="unused", options=opts)
    return peers, loads


def test_fake_peers_end_to_end_rows_and_csv(tmp_path):
    """Four fake workers under real system names, timed over the pipe: every system's row per corpus, tokens from
    the reference, the diverging one flagged (no tokens/s, no ratio, never the fastest peer), the fastest matching
    peer of the class named, the Engine's roofline on its class's rows, and the CSV keeps every column."""
    options = {
        "st-torch-float32": {},
        "fastembed-float32": {"noise": 0.001, "delay": 0.05},
        "st-onnx-float32": {"noise": 1.0},
        "engine-float32": {"noise": 0.001, "roofline": 1e6},
    }
    peers, loads = start_fakes(tmp_path, options)
    try:
        records = workers.measure(peers, TEXTS, 3, settle=0.0, log=sys.stderr)
    finally:
        workers.close_all(peers)
    assert all(p.proc.returncode == 0 for p in peers.values())
    assert loads["engine-float32"]["rss_load_delta_mb"] is not None
    df = report.assemble(records, loads, {"cpu_model": "Fake CPU", "cpu_flags": "avx2"}, run_date="2030-01-02")
    assert len(df) == 8 and set(df.corpus) == set(TEXTS)
    short = df[df.corpus == "short"].set_index("system")
    assert (short.tokens == 10).all() and (short.repeats == 3).all() and (short.texts == 4).all()
    assert short.loc["st-torch-float32", "ratio_vs_st_float32"] == pytest.approx(1.0)
    onnx = short.loc["st-onnx-float32"]
    assert not onnx.matches and np.isnan(onnx.tokens_per_s) and np.isnan(onnx.ratio_vs_st_float32)
    assert "speed not reported" in onnx.note and onnx.seconds_median > 0
    assert short.loc["fastembed-float32", "matches"] and short.loc["engine-float32", "matches"]
    assert short.loc["fastembed-float32", "min_cosine_vs_st_float32"] > 0.999
    # the fastest matching peer of the float32 class: the reference (fastembed sleeps 50 ms), not the flagged one
    assert set(short.fastest_peer) == {"st-torch-float32"}
    assert short.loc["engine-float32", "ratio_vs_fastest_peer"] == pytest.approx(
        short.loc["engine-float32", "tokens_per_s"] / short.loc["st-torch-float32", "tokens_per_s"]
    )
    assert short.loc["fastembed-float32", "roofline_fraction"] == pytest.approx(
        short.loc["fastembed-float32", "tokens_per_s"] / 1e6
    )
    assert (short.run_date == "2030-01-02").all() and (short.cpu_model == "Fake CPU").all()
    csv = tmp_path / "out.csv"
    df.to_csv(csv, index=False)
    cols = set(pd.read_csv(csv).columns)
    assert {
        "run_date",
        "corpus",
        "system",
        "precision",
        "precision_class",
        "texts",
        "tokens",
        "seconds_median",
        "seconds_min",
        "seconds_max",
        "tokens_per_s",
        "ratio_vs_st_float32",
        "ratio_vs_fastest_peer",
        "fastest_peer",
        "min_cosine_vs_st_float32",
        "matches",
        "rss_load_delta_mb",
        "peak_rss_mb",
        "packages",
        "cpu_model",
        "cpu_flags",
        "torch_threads",
        "loadavg_before",
        "loadavg_after",
        "roofline_fraction",
        "machine",
        "commit",
    } <= cols
    report.plot(df).savefig(tmp_path / "plot.png")  # the flagged row is drawn as "n/m", not as a bar
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_worker_errors_reach_the_driver(tmp_path):
    """A failed request comes back as PeerError naming the system and the cause; the worker goes on serving. A
    worker that dies is reported with the end of its log."""
    peer = fake_peer(tmp_path, "w")
    try:
        with pytest.raises(workers.PeerError, match="w: 'embed' failed: RuntimeError: no system loaded"):
            peer.call("embed", key="x")
        with pytest.raises(workers.PeerError, match="unknown kind 'nope'"):
            peer.call("load", kind="nope", model="m")
        peer.call("load", kind="fake", model="m")
        with pytest.raises(workers.PeerError, match="no texts under key 'x'"):
            peer.call("time", key="x")
        assert peer.call("memory")["rss_mb"] > 0
    finally:
        peer.close()
    dead = workers.Peer(
        "dead",
        [sys.executable, "-c", "import sys; sys.stderr.write('boom at start'); sys.exit(3)"],
        log_path=tmp_path / "dead.log",
    )
    with pytest.raises(workers.PeerError, match=r"(?s)dead: the worker exited \(code 3\).*boom at start"):
        dead.call("load", kind="fake", model="m")
    dead.close()


def rec(corpus, system, cos, seconds, tokens=1000):
    return {
        "corpus": corpus,
        "system": system,
        "texts": 10,
        "tokens": tokens,
        "seconds": seconds,
        "cpu_seconds": seconds,
        "min_cosine": cos,
        "peak_rss_mb": 100.0,
        "loadavg_before": 0.5,
        "loadavg_after": 0.6,
    }


def load(precision, roofline=None):
    info = {"precision": precision, "packages": "p=1", "settings": "", "torch_threads": 2}
    if roofline:
        info["roofline_tokens_per_s"] = roofline
    return {"info": info, "load_seconds": 1.0, "rss_load_delta_mb": 50.0}


def test_matching_rule_and_precision_classes():
    """min cosine exactly MATCH_COSINE matches, just under it does not; the fastest peer is chosen within the
    resolved precision class (OpenVINO's default running bf16 competes with bfloat16 torch, not with float32), and
    the median of the rounds is the speed."""
    loads = {
        "st-torch-float32": load("float32"),
        "st-torch-bfloat16": load("bfloat16"),
        "st-openvino-default": load("bf16"),
        "fastembed-float32": load("float32"),
        "st-onnx-float32": load("float32"),
        "engine-bfloat16": load("bfloat16", roofline=4000.0),
    }
    records = [
        rec("c", "st-torch-float32", 1.0, [1.0, 9.0, 2.0]),
        rec("c", "st-torch-bfloat16", 0.9995, [0.5, 0.5, 0.5]),
        rec("c", "st-openvino-default", report.MATCH_COSINE, [0.25, 0.25, 0.25]),
        rec("c", "fastembed-float32", 0.9989999, [0.1, 0.1, 0.1]),
        rec("c", "st-onnx-float32", 0.9999, [4.0, 4.0, 4.0]),
        rec("c", "engine-bfloat16", 0.9991, [0.2, 0.2, 0.2]),
    ]
    df = report.assemble(records, loads, {}).set_index("system")
    assert df.loc["st-torch-float32", "tokens_per_s"] == 500.0  # median 2 s
    assert df.loc["st-openvino-default", "matches"] and df.loc["st-openvino-default", "precision_class"] == "bfloat16"
    assert not df.loc["fastembed-float32", "matches"]
    assert df.loc["engine-bfloat16", "fastest_peer"] == "st-openvino-default"
    assert df.loc["engine-bfloat16", "ratio_vs_fastest_peer"] == pytest.approx(0.25 / 0.2)
    assert df.loc["st-onnx-float32", "fastest_peer"] == "st-torch-float32"  # the flagged fastembed is left out
    assert df.loc["engine-bfloat16", "roofline_fraction"] == pytest.approx(5000 / 4000)
    assert np.isnan(df.loc["st-onnx-float32", "roofline_fraction"])  # no Engine float32 row: no roofline
    assert df.loc["engine-bfloat16", "ratio_vs_st_float32"] == pytest.approx(10.0)


def test_round_order_rotates_every_system_to_the_front():
    names = ["a", "b", "c", "d"]
    orders = [workers.round_order(names, r) for r in range(len(names))]
    assert all(sorted(o) == names for o in orders)
    assert [o[0] for o in orders] == names
    assert workers.round_order(names, 5) == orders[1]


def test_select_systems_reference_first_and_cuda_skipped():
    systems, skipped = workers.select_systems(["engine-float32", "engine-cuda-triton"], cuda=False)
    assert [s.name for s in systems] == ["st-torch-float32", "engine-float32"]
    assert skipped == ["engine-cuda-triton"]
    all_cpu, none = workers.select_systems(None, cuda=False)
    assert not none and all(s.device == "cpu" for s in all_cpu) and len(all_cpu) == 10  # 2 of them compiled
    with_gpu, _ = workers.select_systems(None, cuda=True)
    assert {"st-torch-cuda-float16", "engine-cuda-torch"} <= {s.name for s in with_gpu}
    with pytest.raises(ValueError, match="unknown system.*'st-tensorflow'.*valid: st-torch-float32"):
        workers.select_systems(["st-tensorflow"], cuda=False)


def test_outputs_and_smoke_texts(tmp_path):
    assert bench.output_paths(tmp_path, "amd-epyc-f25m17", False)[0].name == "bench_peers_amd-epyc-f25m17.csv"
    assert bench.output_paths(tmp_path, "x", True)[1].name == "bench_peers_x_smoke.png"
    texts = bench.load_texts(["stsbenchmark"], 1000, 24)
    assert len(texts["stsbenchmark"]) == 24 and len(set(texts["stsbenchmark"])) > 20


def test_array_encoding_is_exact():
    a = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    b = worker.decode_array(worker.encode_array(a))
    assert b.dtype == np.float32 and np.array_equal(a, b)


def test_requirements_key_and_venv_reuse(tmp_path, monkeypatch):
    """The venv is keyed by the requirements file's bytes: a current stamp is reused without running anything; a
    changed file rebuilds it, torch alone first, then the whole file, and stamps it last."""
    req = tmp_path / "requirements.txt"
    req.write_text("# peers\ntorch==2.13.0\nfastembed==0.9.1\n", encoding="utf-8")
    key = venv.requirements_key(req)
    assert len(key) == 64 and venv.requirements_key(req) == key
    assert venv.torch_requirement(req) == "torch==2.13.0"
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            py = venv.venv_python(tmp_path / "peers-venv")
            py.parent.mkdir(parents=True)
            py.write_text("", encoding="utf-8")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(venv.subprocess, "run", fake_run)
    python = venv.ensure_venv(req, tmp_path, base_python="py3", log=sys.stderr)
    assert python == tmp_path / "peers-venv" / "bin" / "python"
    assert calls[0] == ["py3", "-m", "venv", str(tmp_path / "peers-venv")]
    assert calls[1][-1] == "torch==2.13.0" and calls[2][-2:] == ["-r", str(req)]
    assert venv.is_current(tmp_path / "peers-venv", key)
    calls.clear()
    assert venv.ensure_venv(req, tmp_path, base_python="py3", log=sys.stderr) == python and not calls  # reused
    req.write_text("torch==2.13.0\nfastembed==0.9.2\n", encoding="utf-8")
    assert venv.requirements_key(req) != key and not venv.is_current(tmp_path / "peers-venv", key + "x")
    venv.ensure_venv(req, tmp_path, base_python="py3", log=sys.stderr)
    assert len(calls) == 3 and venv.is_current(tmp_path / "peers-venv", venv.requirements_key(req))


def test_failed_build_is_not_stamped(tmp_path, monkeypatch):
    req = tmp_path / "requirements.txt"
    req.write_text("torch==2.13.0\n", encoding="utf-8")
    monkeypatch.setattr(venv.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(RuntimeError, match="building the peers' venv failed at .*-m venv.*exit 1"):
        venv.ensure_venv(req, tmp_path, base_python="py3", log=sys.stderr)
    assert not (tmp_path / "peers-venv" / venv.STAMP).exists()
    (tmp_path / "bad.txt").write_text("fastembed\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.txt pins no torch version"):
        venv.torch_requirement(tmp_path / "bad.txt")
