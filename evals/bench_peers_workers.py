"""The systems ``evals/bench_peers.py`` times and the worker processes that run them: ``System`` and ``SYSTEMS`` (the
reference first, ``select_systems``), ``Peer`` (one ``evals/peers/worker.py`` process driven over a pipe, one JSON
object a line; ``PeerError``), ``start_peers`` / ``close_all``, and ``measure`` (the warm-up, then the timed rounds
in ``round_order``)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from evals.criteria import min_cosine
from evals.peers.worker import decode_array

ROOT = Path(__file__).resolve().parent
WORKER = ROOT / "peers" / "worker.py"
REFERENCE = "st-torch-float32"
ENGINE = "engine"  # the ``kind`` of the Engine's rows (every other kind is a peer)


@dataclass(frozen=True)
class System:
    """One row kind: ``kind`` and ``options`` for ``evals/peers/worker.py``, ``venv`` (``project`` / ``peers``) the
    python it runs under, ``precision`` as requested (the class it ran in comes from the worker)."""

    name: str
    runtime: str
    kind: str
    venv: str
    precision: str
    options: tuple = ()
    device: str = "cpu"
    model: str = "source"  # which folder it loads: the model folder (``source``) or the peers' ``export``


SYSTEMS = {
    s.name: s
    for s in [
        System(
            "st-torch-float32",
            "sentence-transformers/torch",
            "st-torch",
            "project",
            "float32",
            (("dtype", "float32"),),
        ),
        System(
            "st-torch-bfloat16",
            "sentence-transformers/torch",
            "st-torch",
            "project",
            "bfloat16",
            (("dtype", "bfloat16"),),
        ),
        System("st-onnx-float32", "sentence-transformers/onnxruntime", "st-onnx", "peers", "float32", model="export"),
        System(
            "st-openvino-default",
            "sentence-transformers/openvino",
            "st-openvino",
            "peers",
            "default",
            (("precision", "default"),),
            model="export",
        ),
        System(
            "st-openvino-float32",
            "sentence-transformers/openvino",
            "st-openvino",
            "peers",
            "float32",
            (("precision", "f32"),),
            model="export",
        ),
        System("fastembed-float32", "fastembed/onnxruntime", "fastembed", "peers", "float32", model="export"),
        System("engine-float32", "prefill-lab Engine", ENGINE, "project", "float32", (("dtype", "float32"),)),
        System("engine-bfloat16", "prefill-lab Engine", ENGINE, "project", "bfloat16", (("dtype", "bfloat16"),)),
        System(
            "engine-compiled-float32",
            "prefill-lab Engine, torch.compile",
            ENGINE,
            "project",
            "float32",
            (("dtype", "float32"), ("compile", True)),
        ),
        System(
            "engine-compiled-bfloat16",
            "prefill-lab Engine, torch.compile",
            ENGINE,
            "project",
            "bfloat16",
            (("dtype", "bfloat16"), ("compile", True)),
        ),
        System(
            "st-torch-cuda-float16",
            "sentence-transformers/torch",
            "st-torch",
            "project",
            "float16",
            (("dtype", "float16"), ("device", "cuda")),
            device="cuda",
        ),
        System(
            "st-torch-cuda-bfloat16",
            "sentence-transformers/torch",
            "st-torch",
            "project",
            "bfloat16",
            (("dtype", "bfloat16"), ("device", "cuda")),
            device="cuda",
        ),
        System(
            "engine-cuda-triton",
            "prefill-lab Engine",
            ENGINE,
            "project",
            "float16",
            (("dtype", "float16"), ("device", "cuda"), ("attention_backend", "triton")),
            device="cuda",
        ),
        System(
            "engine-cuda-torch",
            "prefill-lab Engine",
            ENGINE,
            "project",
            "float16",
            (("dtype", "float16"), ("device", "cuda"), ("attention_backend", "torch")),
            device="cuda",
        ),
    ]
}


def select_systems(names: list[str] | None, cuda: bool) -> tuple[list[System], list[str]]:
    """The systems to run (``names``, default all; the reference always, first) and the names skipped: the CUDA
    systems when ``cuda`` is False."""
    names = list(names) if names else [n for n, s in SYSTEMS.items() if cuda or s.device == "cpu"]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; valid: {', '.join(SYSTEMS)}")
    names = [REFERENCE] + [n for n in dict.fromkeys(names) if n != REFERENCE]
    skipped = [n for n in names if SYSTEMS[n].device == "cuda" and not cuda]
    return [SYSTEMS[n] for n in names if n not in skipped], skipped


def round_order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``names`` rotated left by ``r``, so every system leads one round in ``len(names)``."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


class PeerError(RuntimeError):
    pass


class Peer:
    """A worker process: ``call(op, **args)`` sends one request line and returns the reply (``PeerError`` on
    ``ok: false`` or a dead worker, with its message or the tail of its log)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict | None = None,
        log_path: Path | None = None,
        cwd: str | Path | None = None,
    ):
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "w", encoding="utf-8") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            encoding="utf-8",
            env=env,
            cwd=cwd,
        )

    def _log_tail(self, n: int = 3000) -> str:
        if not self.log_path:
            return ""
        self.log.flush()
        text = Path(self.log_path).read_text(encoding="utf-8", errors="replace")
        return f"\n--- the end of its log {self.log_path} ---\n{text[-n:]}"

    def call(self, op: str, **args) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.proc.wait(timeout=30)
            raise PeerError(
                f"{self.name}: the worker exited (code {self.proc.returncode}) during {op!r}" + self._log_tail()
            )
        reply = json.loads(line)
        if not reply.pop("ok", False):
            raise PeerError(f"{self.name}: {op!r} failed: {reply.get('error')}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
                self.proc.wait(timeout=30)
            except (PeerError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()


def worker_env(venv: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true"}
    if venv == "peers":  # nothing of the project's environment on the peers' path
        for k in ("PYTHONPATH", "VIRTUAL_ENV"):
            env.pop(k, None)
    return env


def start_peers(
    systems: list[System],
    model: str,
    *,
    log_dir: Path,
    peers_python: str | None = None,
    export_dir: str | None = None,
    log=sys.stderr,
) -> tuple[dict, dict]:
    """Start and load every system's worker, one after the other (loads do not overlap): ``(peers, load replies)``
    by name. On a failure the workers started so far are closed."""
    peers, loads = {}, {}
    try:
        for s in systems:
            python = sys.executable if s.venv == "project" else peers_python
            folder = model if s.model == "source" else export_dir
            peer = peers[s.name] = Peer(
                s.name,
                [str(python), str(WORKER), "serve"],
                env=worker_env(s.venv),
                log_path=log_dir / f"{s.name}.log",
                cwd=ROOT.parent,
            )
            loads[s.name] = peer.call("load", kind=s.kind, model=str(folder), options=dict(s.options))
            print(
                f"loaded {s.name:22s} in {loads[s.name]['load_seconds']:5.1f} s  "
                f"({loads[s.name]['info']['precision']})",
                file=log,
                flush=True,
            )
    except BaseException:
        close_all(peers)
        raise
    return peers, loads


def close_all(peers: dict) -> None:
    for p in peers.values():
        p.close()


def measure(
    peers: dict,
    corpora: dict[str, list[str]],
    repeats: int,
    *,
    reference: str = REFERENCE,
    settle: float = 0.2,
    log=sys.stderr,
) -> list[dict]:
    """Time every peer on every corpus (``evals/bench_peers.py``'s module doc): one record per corpus and system
    with ``seconds`` and ``cpu_seconds`` (one per round), ``tokens`` (``reference``'s count), ``min_cosine`` (to
    ``reference``'s warm-up vectors), ``peak_rss_mb`` and the 1-minute load average before / after the corpus."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(peers)
    if reference not in names:
        raise ValueError(f"the reference {reference!r} is not among the systems {names}")
    out = []
    for corpus, texts in corpora.items():
        load_before = os.getloadavg()[0]
        vectors = {}
        for name in names:
            peers[name].call("texts", key=corpus, texts=texts)
            peers[name].call("reset_peak")
        for name in names:  # the warm-up, whose vectors are compared
            vectors[name] = decode_array(peers[name].call("embed", key=corpus)["vectors"])
        tokens = peers[reference].call("tokens", key=corpus)["tokens"]
        times = {n: [] for n in names}
        cpu = {n: [] for n in names}
        for r in range(repeats):
            for name in round_order(names, r):
                time.sleep(settle)
                reply = peers[name].call("time", key=corpus)
                times[name].append(reply["seconds"])
                cpu[name].append(reply["cpu_seconds"])
        load_after = os.getloadavg()[0]
        for name in names:
            out.append(
                {
                    "corpus": corpus,
                    "system": name,
                    "texts": len(texts),
                    "tokens": tokens,
                    "seconds": times[name],
                    "cpu_seconds": cpu[name],
                    "min_cosine": min_cosine(vectors[name], vectors[reference]),
                    "peak_rss_mb": peers[name].call("memory")["peak_rss_mb"],
                    "loadavg_before": load_before,
                    "loadavg_after": load_after,
                }
            )
            rec = out[-1]
            print(
                f"{corpus:13s} {name:22s} {tokens / statistics.median(rec['seconds']):9,.0f} tok/s  "
                f"min cos {rec['min_cosine']:.6f}",
                file=log,
                flush=True,
            )
    return out
