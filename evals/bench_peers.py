"""Benchmark: the Engine against the CPU runtimes a user would pick instead, on the same texts, in one run.

Systems (``--systems``; ``SYSTEMS``), all on the bundled all-MiniLM-L6-v2, batch 32 wherever a batch is set:

- ``st-torch-float32`` (the reference), ``st-torch-bfloat16``: sentence-transformers on torch (the project's venv);
- ``st-onnx-float32``: sentence-transformers ``backend="onnx"`` (optimum + ONNX Runtime's CPU provider);
- ``st-openvino-default``: ``backend="openvino"`` at OpenVINO's default ``INFERENCE_PRECISION_HINT`` (bf16 on a CPU
  with native bfloat16, else f32; the row's ``precision_class`` says which ran), ``st-openvino-float32`` forces f32
  (``model_kwargs={"ov_config": {"INFERENCE_PRECISION_HINT": "f32"}}``);
- ``fastembed-float32``: fastembed's ``TextEmbedding`` on the same ONNX export, registered as a custom model with
  the folder's mean pooling and normalization, truncating where sentence-transformers does;
- ``engine-float32``, ``engine-bfloat16``: ``lab.Engine`` (``tune_allocator=True``, as ``evals/bench_embed.py``;
  ``compile=False``); ``engine-compiled-float32``, ``engine-compiled-bfloat16``: the same with ``compile=True``
  (``lab.runtime.compiled``; its graphs built at load, their first calls in ``compile_seconds``);
- with CUDA: ``st-torch-cuda-float16``, ``st-torch-cuda-bfloat16``, ``engine-cuda-triton`` and ``engine-cuda-torch``
  (float16, ``attention_backend`` triton / torch); without CUDA they are skipped.

Every system runs in a process of its own (``evals/peers/worker.py``, driven over a pipe, one JSON object a line),
so that no allocator tuning, thread pool or resident memory of one reaches another: sentence-transformers on torch
and the Engine under the project's python, the others in the peers' virtual environment (their transformers /
sentence-transformers pins conflict with the project's: ``evals/peers/requirements.txt``), which
``evals/peers/venv.py`` builds on first use in ``~/.cache/prefill-lab/peers-venv`` (``$LAB_PEERS_CACHE`` moves it;
rebuilt when the requirements file's hash changes), along with the ONNX / OpenVINO export of the model
(``peers-models/``, made offline from the local folder). Workers run with ``HF_HUB_OFFLINE=1`` and
``TOKENIZERS_PARALLELISM=true`` (the library default in a fresh process).

Per corpus (``--corpora``; ``evals.data_io.load_corpus``) every system embeds the texts once untimed (the warm-up,
whose vectors give ``min_cosine_vs_st_float32``), then ``--repeats`` rounds time each system once, the order
rotated by one each round so that every system runs first as often as the others, with ``--settle`` seconds of
idle between systems (thread pools spinning down). Each time is taken inside the worker around the embedding call
alone. A row whose min cosine to ``st-torch-float32`` is under ``MATCH_COSINE`` gets ``matches=False``: its seconds
stay in the table, but no tokens/s, ratio or roofline share is reported for it, nor is it a fastest peer.

    python -m evals.bench_peers                         # full run (module doc's end: how long)
    python -m evals.bench_peers --smoke                 # tiny: 24 texts of two corpora, 3 rounds (or LAB_SMOKE=1)
    python -m evals.bench_peers --systems st-torch-float32 fastembed-float32 engine-float32 --corpora mixed

Writes ``evals/results/bench_peers/bench_peers_<machine slug>.csv`` and ``.png`` (``_smoke`` added for a smoke run):
per corpus and system ``texts``, ``tokens`` (real tokens after truncation, from the reference), ``seconds_*``
(median / min / max), ``cpu_seconds_median``, ``tokens_per_s``, ``ratio_vs_st_float32``, ``fastest_peer`` and
``ratio_vs_fastest_peer`` (the fastest matching non-Engine system of the same ``precision_class`` and device),
``roofline_fraction`` (of the Engine's GEMM roofline for that precision, ``lab.eval.bench.gemm_roofline``),
``rss_load_delta_mb`` (resident memory the load added, imports included), ``peak_rss_mb`` (the worker's peak over the
corpus), ``weights_mb`` / ``derived_weights_mb`` (Engine rows: the weights and the packed / widened copies its CPU
plan keeps), ``packages``, ``settings``, ``torch_threads``, the CPU model and flags, load averages before / after the
corpus, ``run_date``, ``machine`` (``lab.ops.probes.machine_slug``), ``commit`` (this checkout's), ``model`` and
``revision`` (what the Engine loaded: the hub id and the snapshot's commit, or ``local/<folder>`` and a content hash).

``--corpora mixed stsbenchmark --repeats 3`` (8 systems, a warm-up and 3 rounds each) took 10 minutes on an idle
2-core AMD EPYC; SciFact (1000 abstracts cut at 256 tokens) is the longest corpus, so a full run takes several
times that. The first run adds about 3 minutes to build the peers' venv (a ~1 GB download) and export the model.
Run it on an otherwise idle machine: the table records the load average, but cannot undo it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from evals.criteria import min_cosine
from evals.data_io import CORPORA, load_corpus, spread
from evals.peers.worker import decode_array
from evals.results_index import save_table
from lab import env as lab_env
from lab.models.hub import local_folder

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "bench_peers"
WORKER = ROOT / "peers" / "worker.py"
MATCH_COSINE = 0.999  # min cosine to st-torch-float32 below which a row's speed is not reported
REFERENCE = "st-torch-float32"
ENGINE = "engine"  # the ``kind`` of the Engine's rows (every other kind is a peer)
SMOKE_TEXTS, SMOKE_CORPORA = 24, ["stsbenchmark", "scifact"]


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
PRECISION_CLASSES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16", "f16": "float16", "fp16": "float16"}


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
    """Time every peer on every corpus (module doc): one record per corpus and system with ``seconds`` and
    ``cpu_seconds`` (one per round), ``tokens`` (``reference``'s count), ``min_cosine`` (to ``reference``'s
    warm-up vectors), ``peak_rss_mb`` and the 1-minute load average before / after the corpus."""
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


def precision_class(precision: str) -> str:
    return PRECISION_CLASSES.get(precision, precision)


def assemble(
    records: list[dict], loads: dict, machine: dict, *, run_date: str | None = None, systems: dict | None = None
) -> pd.DataFrame:
    """The CSV's rows from ``measure``'s records and the workers' ``load`` replies (module doc for the columns)."""
    systems = systems or SYSTEMS
    rows = []
    for rec in records:
        s, load = systems[rec["system"]], loads[rec["system"]]
        info = load["info"]
        med = statistics.median(rec["seconds"])
        matches = bool(rec["min_cosine"] >= MATCH_COSINE)
        rows.append(
            {
                "run_date": run_date or datetime.date.today().isoformat(),
                "corpus": rec["corpus"],
                "system": s.name,
                "runtime": s.runtime,
                "device": s.device,
                "precision": s.precision,
                "precision_class": precision_class(info["precision"]),
                "texts": rec["texts"],
                "tokens": rec["tokens"],
                "repeats": len(rec["seconds"]),
                "seconds_median": med,
                "seconds_min": min(rec["seconds"]),
                "seconds_max": max(rec["seconds"]),
                "cpu_seconds_median": statistics.median(rec["cpu_seconds"]),
                "tokens_per_s": rec["tokens"] / med if matches else np.nan,
                "min_cosine_vs_st_float32": rec["min_cosine"],
                "matches": matches,
                "note": ""
                if matches
                else (f"min cosine {rec['min_cosine']:.6f} < {MATCH_COSINE} to {REFERENCE}: speed not reported"),
                "load_seconds": load["load_seconds"],
                "rss_load_delta_mb": load["rss_load_delta_mb"],
                "peak_rss_mb": rec["peak_rss_mb"],
                "packages": info.get("packages", ""),
                "settings": info.get("settings", ""),
                "torch_threads": info.get("torch_threads"),
                "model": machine.get("model"),
                "revision": machine.get("revision"),
                "machine": machine.get("machine"),
                "commit": machine.get("commit"),
                "cpu_model": machine.get("cpu_model"),
                "cpu_flags": machine.get("cpu_flags"),
                "cpu_count": os.cpu_count(),
                "loadavg_before": rec["loadavg_before"],
                "loadavg_after": rec["loadavg_after"],
                "roofline_tokens_per_s": info.get("roofline_tokens_per_s"),
                "weights_mb": info.get("weights_mb"),
                "derived_weights_mb": info.get("derived_weights_mb"),
                "compile_seconds": info.get("compile_seconds"),
                "isa": machine.get("isa"),
            }
        )
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    # the Engine's GEMM roofline for each CPU precision class, on every matching CPU row of that class
    roof = df[(df.system.map(lambda n: systems[n].kind == ENGINE)) & (df.device == "cpu")]
    roof = roof.dropna(subset=["roofline_tokens_per_s"]).groupby("precision_class").roofline_tokens_per_s.first()
    df["roofline_tokens_per_s"] = [
        roof.get(r.precision_class) if r.device == "cpu" else np.nan for r in df.itertuples()
    ]
    df["roofline_fraction"] = df.tokens_per_s / df.roofline_tokens_per_s.astype(float)
    ref = df[df.system == REFERENCE].set_index("corpus").tokens_per_s
    df["ratio_vs_st_float32"] = [r.tokens_per_s / ref.get(r.corpus, np.nan) for r in df.itertuples()]
    peers = df[df.matches & df.system.map(lambda n: systems[n].kind != ENGINE)]
    fastest = peers.loc[peers.groupby(["corpus", "device", "precision_class"]).tokens_per_s.idxmax()]
    fastest = fastest.set_index(["corpus", "device", "precision_class"])
    names, ratios = [], []
    for r in df.itertuples():
        key = (r.corpus, r.device, r.precision_class)
        best = fastest.loc[key] if key in fastest.index else None
        names.append(None if best is None else best.system)
        ratios.append(np.nan if best is None else r.tokens_per_s / best.tokens_per_s)
    df["fastest_peer"], df["ratio_vs_fastest_peer"] = names, ratios
    first = [
        "run_date",
        "corpus",
        "system",
        "runtime",
        "device",
        "precision",
        "precision_class",
        "texts",
        "tokens",
        "repeats",
        "seconds_median",
        "seconds_min",
        "seconds_max",
        "cpu_seconds_median",
        "tokens_per_s",
        "ratio_vs_st_float32",
        "fastest_peer",
        "ratio_vs_fastest_peer",
        "min_cosine_vs_st_float32",
        "matches",
        "note",
        "roofline_tokens_per_s",
        "roofline_fraction",
    ]
    return df[first + [c for c in df.columns if c not in first]]


def plot(df: pd.DataFrame):
    """tokens/s per system, bars grouped by corpus (min..max as error bars; a row that does not match: no bar,
    "n/m" at its place); the title names the CPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = list(dict.fromkeys(df.corpus))
    systems = list(dict.fromkeys(df.system))
    width = 0.85 / len(systems)
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(corpora) * len(systems) / 4), 4.6))
    top, labelled = 0.0, set()
    for j, name in enumerate(systems):
        for i, corpus in enumerate(corpora):
            sel = df[(df.corpus == corpus) & (df.system == name)]
            if sel.empty:
                continue
            r = sel.iloc[0]
            x = i + (j - (len(systems) - 1) / 2) * width
            if not r.matches:
                ax.text(x, 0, "n/m", ha="center", va="bottom", fontsize=7, rotation=90)
                continue
            hatch = "//" if name.startswith("engine") else None
            ax.bar(
                x,
                r.tokens_per_s,
                width,
                color=cmap(j % 20),
                hatch=hatch,
                edgecolor="k",
                linewidth=0.4,
                label=None if name in labelled else f"{name} ({r.precision_class})",
            )
            labelled.add(name)
            hi = r.tokens / r.seconds_min
            ax.errorbar(
                x,
                r.tokens_per_s,
                yerr=[[r.tokens_per_s - r.tokens / r.seconds_max], [hi - r.tokens_per_s]],
                color="k",
                capsize=2,
                linewidth=0.8,
            )
            top = max(top, hi)
    ax.set_xticks(range(len(corpora)), corpora)
    ax.set_ylabel("tokens / s (median of rounds)")
    r0 = df.iloc[0]
    slug = f" [{r0.machine}]" if isinstance(r0.get("machine"), str) else ""
    ax.set_title(f"all-MiniLM-L6-v2 on {r0.cpu_model}{slug}, {r0.cpu_count} CPUs, {r0.run_date}", fontsize=9)
    ax.set_ylim(0, 1.12 * top if top else 1)
    ax.legend(loc="upper center", fontsize=7, ncol=4, bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    return fig


def output_paths(out: Path, slug: str, smoke: bool) -> tuple[Path, Path]:
    stem = f"bench_peers_{slug}" + ("_smoke" if smoke else "")
    return out / f"{stem}.csv", out / f"{stem}.png"


def load_texts(corpora: list[str], scifact_docs: int, max_texts: int | None) -> dict[str, list[str]]:
    """Each corpus's texts (``evals.data_io.load_corpus``), ``max_texts`` evenly spaced ones where given."""
    out = {}
    for name in corpora:
        texts = load_corpus(name, scifact_docs)
        out[name] = [texts[i] for i in spread(len(texts), max_texts)]
    return out


def run(
    systems: list[System],
    texts: dict[str, list[str]],
    repeats: int,
    *,
    model: str,
    settle: float = 0.2,
    log=sys.stderr,
) -> pd.DataFrame:
    """Build / reuse the peers' venv and export where a peer runs, start every worker, measure, assemble."""
    from lab.ops.probes import cpu_info, machine_slug

    peers_python = export_dir = None
    if any(s.venv == "peers" for s in systems):
        from evals.peers.venv import ensure_export, ensure_venv

        peers_python = ensure_venv(log=log)
        export_dir = ensure_export(peers_python, model, log=log)
    with tempfile.TemporaryDirectory(prefix="bench_peers_logs_") as tmp:
        peers, loads = start_peers(
            systems, model, log_dir=Path(tmp), peers_python=peers_python, export_dir=export_dir, log=log
        )
        try:
            records = measure(peers, texts, repeats, settle=settle, log=log)
        finally:
            close_all(peers)
    return assemble(
        records, loads, {**cpu_info(), "machine": machine_slug(), "commit": git_commit(), **model_identity(model)}
    )


def model_identity(model: str) -> dict:
    """The rows' ``model`` (hub id, or ``local/<folder>``) and ``revision`` (the snapshot's commit, or a local
    folder's content hash), as an Engine on ``model`` names them (``lab.models.hub``)."""
    from lab.models.hub import content_revision, resolve

    src = resolve(model)
    return {"model": src.name, "revision": src.revision or content_revision(src.folder)}


def git_commit() -> str | None:
    """The checkout's commit (short hash, ``+`` when the tree has changes), None outside git."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+" if dirty else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="model folder or hub id (org/name[@revision]; default: bundled all-MiniLM-L6-v2)"
    )
    parser.add_argument("--corpora", nargs="+", default=None, choices=CORPORA, help=f"default: {' '.join(CORPORA)}")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=None,
        metavar="SYSTEM",
        help=f"default: every CPU system (and the CUDA ones with a GPU); valid: {', '.join(SYSTEMS)}",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds, >= 3 (default 5; smoke 3)")
    parser.add_argument("--scifact-docs", type=int, default=1000)
    parser.add_argument("--max-texts", type=int, default=None, help="evenly spaced texts per corpus (default all)")
    parser.add_argument("--settle", type=float, default=0.2, help="idle seconds before each timed call")
    parser.add_argument(
        "--smoke",
        action="store_true",
        default=lab_env.flag("LAB_SMOKE", False),
        help=f"{SMOKE_TEXTS} texts of {' and '.join(SMOKE_CORPORA)}, 3 rounds (also LAB_SMOKE=1)",
    )
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.smoke else 5)
    if repeats < 3:
        parser.error(f"--repeats must be at least 3 (the median of >= 3 rounds), got {repeats}")
    corpora = args.corpora or (SMOKE_CORPORA if args.smoke else list(CORPORA))
    max_texts = args.max_texts or (SMOKE_TEXTS if args.smoke else None)
    if args.model is None:
        from lab._extras import minilm_path

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        args.model = minilm_path()
    args.model = local_folder(args.model)
    import torch

    from lab.ops.probes import machine_slug

    systems, skipped = select_systems(args.systems, torch.cuda.is_available())
    if skipped:
        print(f"skipped (no CUDA device): {', '.join(skipped)}", file=sys.stderr)
    df = run(systems, load_texts(corpora, args.scifact_docs, max_texts), repeats, model=args.model, settle=args.settle)
    csv, png = output_paths(Path(args.out), machine_slug(), args.smoke)
    save_table(csv, df, {png: plot(df)})
    cols = [
        "corpus",
        "system",
        "precision_class",
        "tokens_per_s",
        "ratio_vs_st_float32",
        "ratio_vs_fastest_peer",
        "min_cosine_vs_st_float32",
        "matches",
        "rss_load_delta_mb",
        "peak_rss_mb",
    ]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
    print(f"wrote {csv} and {png}")


if __name__ == "__main__":
    main()
