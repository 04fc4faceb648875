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

This file is the command line and the run; its parts, in ``evals/``: ``bench_peers_workers`` (the systems, their
worker processes and the timed rounds) and ``bench_peers_report`` (the table's rows and the plot).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from evals.bench_peers_report import assemble, plot
from evals.bench_peers_workers import SYSTEMS, System, close_all, measure, select_systems, start_peers
from evals.data_io import CORPORA, load_corpus, spread
from evals.results_index import save_table
from lab import env as lab_env
from lab.models.hub import local_folder

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "bench_peers"
SMOKE_TEXTS, SMOKE_CORPORA = 24, ["stsbenchmark", "scifact"]


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
