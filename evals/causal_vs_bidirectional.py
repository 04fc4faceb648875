"""Causal vs bidirectional attention in a decoder LLM used as an embedder, without any training.

SmolLM2-135M-Instruct on the STSBenchmark test pairs (``evals/data/stsbenchmark/test.jsonl.gz``): pooling
{mean, lasttoken} x attention {causal, bidirectional}, all through one ``Engine`` switched with ``configure`` (no
weight reload). Score: Spearman (x100) between the cosine similarity of each pair's embeddings and the gold score,
as MTEB's STS main score; Pearson (x100) is reported too. Every distinct sentence is embedded once per variant.

LLM2Vec turns attention bidirectional and then trains the model to use it (MNTP + contrastive); here the switch
is flipped on the raw instruct model, so the table measures what the switch alone does. It states numbers, not
a winner.

Writes ``<out>.csv`` (one row per variant, with the run's ``run_date``), ``<out>.md`` (pooling x attention table and
the full rows), ``<out>.png`` (bar plot) and the command in ``<out>.csv.meta.json``; ``<out>`` defaults to
``evals/results/causal_vs_bidirectional/causal_vs_bidirectional_<machine>``, the machine the CPU's
``lab.ops.probes.machine_slug()`` or the GPU's name (``evals.results_index.device_slug``).

    python evals/causal_vs_bidirectional.py                 # all 1,379 pairs
    python evals/causal_vs_bidirectional.py --limit 200     # 200 evenly spaced pairs (a quick look)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from evals.data_io import read_jsonl, spread  # after the path set-up: this runs as a script
from evals.results_index import device_slug, run_date, save_table
from lab.models.hub import local_folder

DATA = ROOT / "evals" / "data" / "stsbenchmark" / "test.jsonl.gz"
RESULTS = ROOT / "evals" / "results" / "causal_vs_bidirectional"


def load_pairs(limit: int | None) -> list[dict]:
    rows = read_jsonl(DATA)
    return [rows[i] for i in spread(len(rows), limit)]  # evenly spaced: every genre / year stays represented


def ranks(x):
    """Ranks with ties averaged (as ``scipy.stats.rankdata``)."""
    import pandas as pd

    return pd.Series(x).rank(method="average").to_numpy()


def pearson(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))


def spearman(a, b) -> float:
    return pearson(ranks(a), ranks(b))


def run(args) -> list[dict]:
    import numpy as np
    import torch

    from lab import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from lab.models.gguf import smollm2_path

        args.model = str(smollm2_path())
    args.model = local_folder(args.model)
    pairs = load_pairs(args.limit)
    sentences = sorted({p["sentence1"] for p in pairs} | {p["sentence2"] for p in pairs})
    where = {s: i for i, s in enumerate(sentences)}
    a = np.array([where[p["sentence1"]] for p in pairs])
    b = np.array([where[p["sentence2"]] for p in pairs])
    gold = np.array([float(p["score"]) for p in pairs])
    eng = Engine(args.model, dtype=args.dtype, device=args.device, normalize=True)
    rows = []
    for pooling in args.poolings:
        for bidirectional in (False, True):
            eng.configure(pooling=pooling, bidirectional=bidirectional)
            t0 = time.perf_counter()
            emb = eng.embed(sentences)
            secs = time.perf_counter() - t0
            cos = (emb[a] * emb[b]).sum(1)  # unit vectors: the dot product is the cosine
            r = eng.resolved
            rows.append(
                {
                    "model": eng.model_name,
                    "pooling": pooling,
                    "attention": "bidirectional" if bidirectional else "causal",
                    "spearman_x100": 100 * spearman(cos, gold),
                    "pearson_x100": 100 * pearson(cos, gold),
                    "cosine_mean": float(cos.mean()),
                    "cosine_std": float(cos.std()),
                    "pairs": len(pairs),
                    "sentences": len(sentences),
                    "tokens": eng.stats.tokens,
                    "seconds": secs,
                    "append_eos": r["append_eos"],
                    "dtype": r["dtype"],
                    "device": r["device"],
                    "run": "full" if args.limit is None or args.limit >= 1379 else f"limit={len(pairs)}",
                    "torch": torch.__version__,
                    "machine": platform.machine(),
                    "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "run_date": run_date(),
                }
            )
            print(
                f"  {pooling:9s} {rows[-1]['attention']:13s} Spearman {rows[-1]['spearman_x100']:6.2f}  "
                f"Pearson {rows[-1]['pearson_x100']:6.2f}  ({secs:.1f} s, {eng.stats.tokens} tokens)",
                flush=True,
            )
    return rows


def write(rows: list[dict], out: Path) -> list[Path]:
    import pandas as pd

    df = pd.DataFrame(rows)
    csv, md, png = (out.with_name(out.name + ext) for ext in (".csv", ".md", ".png"))
    table = df.pivot_table(index="pooling", columns="attention", values="spearman_x100", sort=False)
    table = table[[c for c in ("causal", "bidirectional") if c in table.columns]]
    r0 = rows[0]
    lines = [
        "# Causal vs bidirectional attention, no training: STSBenchmark test",
        "",
        (
            f"Model `{r0['model']}`, {r0['pairs']} pairs ({r0['run']}), {r0['sentences']} distinct sentences, "
            f"{r0['dtype']} on {r0['device']}; cosine similarity vs gold, Spearman x100 (MTEB's main score for STS). "
            "One Engine, switched with `configure(pooling=..., bidirectional=...)`. lasttoken pooling appends EOS "
            "(the Engine's default for decoders)."
        ),
        "",
        "| pooling | " + " | ".join(table.columns) + " |",
        "|---|" + "---:|" * len(table.columns),
    ]
    for pooling, vals in table.iterrows():
        lines.append(f"| {pooling} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    cols = [
        "pooling",
        "attention",
        "spearman_x100",
        "pearson_x100",
        "cosine_mean",
        "cosine_std",
        "tokens",
        "seconds",
        "append_eos",
    ]
    lines += ["", "All rows:", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df[cols].iterrows():
        lines.append("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r) + " |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = table.plot.bar(rot=0, figsize=(6, 4))
    for container in ax.containers:
        ax.bar_label(container, fmt="%.1f", fontsize=8)
    ax.set_ylabel("Spearman x100 (cosine vs gold)")
    ax.set_title(f"{r0['model']}: STSBenchmark test, {r0['pairs']} pairs ({r0['run']})", fontsize=10)
    ax.legend(title="attention")
    plt.tight_layout()
    save_table(csv, df, {md: "\n".join(lines) + "\n", png: ax.figure})
    plt.close(ax.figure)
    return [csv, md, png]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default=None,
        help="model folder or hub id (org/name[@revision]; default: the cached SmolLM2-135M-Instruct)",
    )
    ap.add_argument("--limit", type=int, default=None, help="evenly spaced pairs (default: all 1,379)")
    ap.add_argument("--poolings", nargs="+", default=["mean", "lasttoken"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output path without suffix (default evals/results/causal_vs_bidirectional/"
        "causal_vs_bidirectional_<machine>)",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = run(args)
    if args.out is None:
        out = RESULTS / f"causal_vs_bidirectional_{device_slug(rows[0]['device'])}"
    else:
        out = args.out.with_suffix("") if args.out.suffix in (".csv", ".md", ".png") else args.out
    paths = write(rows, out)
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths) + f" in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
