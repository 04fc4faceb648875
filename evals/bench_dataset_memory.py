"""Benchmark: the driver's resident memory while ``lab.distributed.embed_dataset`` embeds a corpus file, shard by
shard.

The corpus is a ``.jsonl.gz`` written to a temporary folder: ``--rows`` rows, each ``--sentences`` STSBenchmark
sentences (the corpus cycled; about 60 bytes each) followed by its row number, so every text is distinct; ids are
``"doc-<row>"``. The job runs all-MiniLM-L6-v2 with ``max_length=--max-length`` (long texts, few tokens: the texts'
bytes are what the driver would hold, the tokens only cost time) on ``--actors`` actors x 1 thread in shards of
``--shard-texts``. After every shard is recorded the
driver's ``VmRSS`` is read (``lab.runtime.memory.status_bytes``), and a thread samples it every 0.2 s for the peak.

What it shows: ``embed_dataset`` reads a file source in batches (``lab.distributed.shards.Source``), so the driver
holds 16 bytes per row for the duplicate-id check and the texts of the shards in flight, not the corpus. The table
puts the driver's growth from the first shard to the last beside the corpus' size as Python strings (what a driver
holding every text would add).

    python -m evals.bench_dataset_memory                 # 50,000 rows of ~2 KB (~8 min on 2 cores)
    python -m evals.bench_dataset_memory --quick         # 2,000 rows: checks the script, writes *_quick*

Writes ``evals/results/bench_dataset_memory/bench_dataset_memory_<machine>.csv`` (one row per shard: rows done,
driver RSS; the run's columns), its ``.meta.json`` and ``.png`` (``evals.results_index.save_run``).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pandas as pd

from evals.data_io import stsbenchmark_sentences
from evals.results_index import save_run, stamp

OUT = Path(__file__).parent / "results" / "bench_dataset_memory"
MB = 2**20


def write_corpus(path: Path, rows: int, sentences: int) -> int:
    """``rows`` JSONL rows ``{"id": "doc-<i>", "text": <sentences> (<i>)}``; returns the texts' size as Python
    strings (``sys.getsizeof``), what a driver holding them would keep."""
    held, pool = 0, itertools.cycle(stsbenchmark_sentences())
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i in range(rows):
            text = " ".join(itertools.islice(pool, sentences)) + f" ({i})"
            held += sys.getsizeof(text)
            f.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")
    return held


def run(rows: int, sentences: int, max_length: int, shard_texts: int, actors: int) -> pd.DataFrame:
    from lab._extras import minilm_path
    from lab.distributed import embed_dataset
    from lab.runtime import memory

    peak = {"rss": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak["rss"] = max(peak["rss"], memory.status_bytes("VmRSS") or 0)

    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl.gz"
        held = write_corpus(corpus, rows, sentences)
        t0, start_rss = time.perf_counter(), memory.status_bytes("VmRSS")
        rows_done = {"n": 0}

        def on_shard(row: dict) -> None:
            rows_done["n"] += row["rows"]
            records.append(
                {
                    "shard": row["shard"],
                    "rows_done": rows_done["n"],
                    "driver_rss_mb": (memory.status_bytes("VmRSS") or 0) / MB,
                    "seconds": time.perf_counter() - t0,
                }
            )

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            embed_dataset(
                minilm_path(),
                corpus,
                Path(tmp) / "out",
                num_actors=actors,
                shard_texts=shard_texts,
                knobs={"max_length": max_length},
                show_progress=False,
                on_shard=on_shard,
            )
        finally:
            done.set()
            sampler.join()
        corpus_mb = corpus.stat().st_size / MB
    from lab.ops.probes import cpu_info

    df = pd.DataFrame(records).assign(**cpu_info())
    df["rows"], df["sentences"], df["max_length"] = rows, sentences, max_length
    df["shard_texts"], df["actors"] = shard_texts, actors
    df["corpus_gz_mb"], df["texts_as_str_mb"] = corpus_mb, held / MB
    df["driver_rss_start_mb"], df["driver_rss_peak_mb"] = (start_rss or 0) / MB, peak["rss"] / MB
    return df


def summary(df: pd.DataFrame) -> str:
    first, last = df.iloc[0], df.iloc[-1]
    half = df[df.rows_done >= last.rows_done / 2].iloc[0]  # the second half of the job
    return (
        f"{int(last.rows_done):,} rows in {len(df)} shards: driver RSS {first.driver_rss_mb:,.0f} MB after the "
        f"first shard, {half.driver_rss_mb:,.0f} MB at {int(half.rows_done):,} rows, {last.driver_rss_mb:,.0f} MB "
        f"after the last (peak {last.driver_rss_peak_mb:,.0f} MB); the texts as Python strings: "
        f"{last.texts_as_str_mb:,.0f} MB"
    )


def plot(df: pd.DataFrame):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(df.rows_done, df.driver_rss_mb, marker=".", label="driver RSS after each shard")
    base = df.driver_rss_mb.iloc[0]
    ax.plot(
        df.rows_done,
        base + df.texts_as_str_mb.iloc[0] * df.rows_done / df.rows.iloc[0],
        ls="--",
        label="the same, holding every text read",
    )
    ax.set_xlabel("rows embedded")
    ax.set_ylabel("MB")
    r = df.iloc[0]
    ax.set_title(
        f"embed_dataset, all-MiniLM-L6-v2: {r.rows:,} texts of ~{r.sentences} sentences cut at "
        f"{r.max_length} tokens\n{r.actors} actors, shards of {r.shard_texts}, on {r.cpu_model} ({r.isa})",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--sentences", type=int, default=30, help="STSBenchmark sentences per text")
    ap.add_argument("--max-length", type=int, default=32, help="the engine's max_length (tokens embedded per text)")
    ap.add_argument("--shard-texts", type=int, default=1024)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2,000 rows; results named *_quick")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if args.quick:
        args.rows = 2_000
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    load = os.getloadavg()[0]
    with warnings.catch_warnings():  # every text is cut at max_length: the point of the corpus
        warnings.filterwarnings("ignore", message=".*truncated")
        df = run(args.rows, args.sentences, args.max_length, args.shard_texts, args.actors)
    df = stamp(df)
    df["load_average_before"] = load
    name = "bench_dataset_memory_quick" if args.quick else "bench_dataset_memory"
    path = save_run(df, Path(args.out), name, plot(df))
    print(summary(df))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
