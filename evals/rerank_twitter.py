"""Study: rerank TwitterURLCorpus with a bi-encoder and with an LLM yes/no reranker, through the same Engine API.

For each news headline (query), rank the tweets linking to the same URL so that paraphrases come first (the
reranking view in ``evals/data/twitterurlcorpus/test.reranking.jsonl.gz``; see its README). Scored by MAP (average
precision over each query's full candidate list) and MRR@10. Candidates are shuffled per query with a fixed seed
before scoring, because the file lists positives first and a model that ties would otherwise be credited. All
pairs go to one ``Engine.score`` call (what ``Engine.rerank`` does per query, batched across queries).

- all-MiniLM-L6-v2 as a bi-encoder (cosine of embeddings), ``Engine.score(pairs, mode="bi-encoder")``;
- SmolLM2-135M-Instruct as a yes/no reranker (chat template, P(yes) vs "no"), ``mode="llm"``;
- random scores (seeded), for scale.

    python -m evals.rerank_twitter --limit 100        # 100 evenly spaced queries; omit --limit for all 567

Writes ``evals/results/rerank_twitter/rerank_twitter_<machine>.csv`` (one row per model x metric, with the run's
``run_date``), ``rerank_twitter_<machine>.md`` and the command in ``<csv>.meta.json``; prints the table. The machine
is ``lab.ops.probes.machine_slug()`` (``evals.results_index``).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd

from evals.data_io import read_jsonl, spread
from evals.results_index import save_run, stamp
from lab import env

ROOT = Path(__file__).resolve().parent
DATA = env.path("LAB_EVAL_DATA", ROOT / "data") / "twitterurlcorpus" / "test.reranking.jsonl.gz"
RESULTS = ROOT / "results" / "rerank_twitter"
INSTRUCTION = "Retrieve tweets that paraphrase the given news headline"  # the custom mteb task's query prompt


def load_queries(limit: int | None, seed: int = 0) -> list[dict]:
    """``[{"query", "documents", "labels"}]``: ``limit`` evenly spaced queries (the rule of ``evals.tasks``'s
    ``limit``), candidates shuffled per query with ``seed``."""
    rows = read_jsonl(DATA)
    rows = [rows[i] for i in spread(len(rows), limit)]
    rng = np.random.default_rng(seed)
    out = []
    for r in rows:
        docs = r["positive"] + r["negative"]
        labels = np.array([1] * len(r["positive"]) + [0] * len(r["negative"]))
        perm = rng.permutation(len(docs))
        out.append({"query": r["query"], "documents": [docs[i] for i in perm], "labels": labels[perm]})
    return out


def average_precision(labels_in_rank_order: np.ndarray) -> float:
    hits = np.cumsum(labels_in_rank_order)
    ranks = np.arange(1, len(labels_in_rank_order) + 1)
    pos = labels_in_rank_order.astype(bool)
    return float((hits[pos] / ranks[pos]).mean()) if pos.any() else 0.0


def reciprocal_rank(labels_in_rank_order: np.ndarray, k: int = 10) -> float:
    first = np.flatnonzero(labels_in_rank_order[:k])
    return 1.0 / (first[0] + 1) if len(first) else 0.0


def evaluate(score_fn, queries: list[dict]) -> dict:
    """``score_fn(pairs) -> scores`` over every (query, candidate) pair in one call (the engine batches them all),
    then each query's candidates ranked best first (stable) -> MAP, MRR@10, seconds."""
    pairs = [(q["query"], d) for q in queries for d in q["documents"]]
    t0 = time.perf_counter()
    scores = np.asarray(score_fn(pairs))
    seconds = time.perf_counter() - t0
    aps, rrs, start = [], [], 0
    for q in queries:
        s = scores[start : start + len(q["documents"])]
        start += len(q["documents"])
        ranked = q["labels"][np.argsort(-s, kind="stable")]
        aps.append(average_precision(ranked))
        rrs.append(reciprocal_rank(ranked))
    return {"map": float(np.mean(aps)), "mrr_at_10": float(np.mean(rrs)), "seconds": seconds}


def markdown_table(df: pd.DataFrame, decimals: dict[str, int]) -> str:
    def cell(col, v) -> str:
        if isinstance(v, float):
            return "-" if np.isnan(v) else f"{v:.{decimals.get(col, 4)}f}"
        return str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += [
        "| " + " | ".join(cell(c, v) for c, v in zip(df.columns, row)) + " |" for row in df.itertuples(index=False)
    ]
    return "\n".join(lines)


def engine_scorer(engine, **kw):
    return lambda pairs: engine.score(pairs, **kw)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="evenly spaced queries to use (default: all 567)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder (default evals/results/rerank_twitter)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from lab import Engine
    from lab._extras import minilm_path
    from lab.models.gguf import smollm2_path

    queries = load_queries(args.limit, args.seed)
    n_pairs = sum(len(q["documents"]) for q in queries)
    print(f"TwitterURLCorpus reranking: {len(queries)} queries, {n_pairs} (query, tweet) pairs")
    rng = np.random.default_rng(args.seed)
    systems = [
        ("random", "-", lambda: lambda pairs: rng.random(len(pairs))),
        ("all-MiniLM-L6-v2", "bi-encoder", lambda: engine_scorer(Engine(minilm_path()), mode="bi-encoder")),
        (
            "SmolLM2-135M-Instruct",
            "llm",
            lambda: engine_scorer(Engine(str(smollm2_path())), mode="llm", instruction=INSTRUCTION),
        ),
    ]
    rows = []
    for name, mode, build in systems:
        res = evaluate(build(), queries)
        if name == "random":
            res["seconds"] = float("nan")  # not a model: no speed to report
        print(f"  {name:24s} {mode:10s} MAP {res['map']:.4f}  MRR@10 {res['mrr_at_10']:.4f}  {res['seconds']:.1f} s")
        for metric in ("map", "mrr_at_10"):
            rows.append(
                {
                    "model": name,
                    "mode": mode,
                    "metric": metric,
                    "value": res[metric],
                    "queries": len(queries),
                    "pairs": n_pairs,
                    "limit": args.limit,
                    "seconds": res["seconds"],
                    "threads": torch.get_num_threads(),
                    "machine": platform.machine(),
                }
            )
    df = stamp(pd.DataFrame(rows))
    table = df.pivot_table(index=["model", "mode"], columns="metric", values="value", sort=False).reset_index()
    table["seconds"] = df.groupby(["model", "mode"], sort=False)["seconds"].first().to_numpy()
    table["pairs/s"] = n_pairs / table["seconds"]
    md = (
        f"# TwitterURLCorpus reranking (local view, not an official MTEB task)\n\n"
        f"{len(queries)} queries ({'--limit ' + str(args.limit) if args.limit else 'all'}; evenly spaced), "
        f"{n_pairs} pairs, candidates shuffled with seed {args.seed}; CPU, {torch.get_num_threads()} threads, "
        "float32. MAP over each query's full candidate list; MRR@10. LLM prompt: Qwen3-Reranker's system text "
        f"through SmolLM2's chat template, instruction {INSTRUCTION!r}, score = P(yes) over {{yes, no}}.\n\n"
        + markdown_table(table, {"seconds": 1, "pairs/s": 1})
        + "\n"
    )
    save_run(df, args.out, "rerank_twitter", extra={".md": md})
    print()
    print(md)
    return df


if __name__ == "__main__":
    main()
