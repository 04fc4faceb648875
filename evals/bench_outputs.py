"""Benchmark: ``embed(output=...)`` against the dense call on the same texts (issue 17's target: token vectors
within 10 % of the dense call's tokens/s). all-MiniLM-L6-v2, the ``mixed`` corpus of ``evals.bench_embed`` (400
STSBenchmark sentences and 260 SciFact abstracts, shuffled), interleaved rounds, median.

    python -m evals.bench_outputs              # ~2 min on 2 cores; run it alone

Writes evals/results/bench_outputs/bench_outputs_<machine>.csv (one row per output and round, with the run's
``run_date``, the CPU model, its flags, the load average before the run and ``malloc_tuning``: the engine runs with
``tune_allocator=True``, ``lab.runtime.allocator``) and the command in ``<csv>.meta.json``; the machine is
``lab.ops.probes.machine_slug()`` (``evals.results_index``).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import pandas as pd

from evals.data_io import load_corpus
from evals.results_index import result_path, save_table, stamp

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--outputs", nargs="+", default=["dense", "tokens"])
    ap.add_argument(
        "--out", default=None, help="CSV path (default evals/results/bench_outputs/bench_outputs_<machine>.csv)"
    )
    args = ap.parse_args(argv)
    from lab import Engine
    from lab._extras import minilm_path
    from lab.ops.probes import cpu_info

    load = os.getloadavg()[0]
    texts = load_corpus("mixed", 260)
    eng = Engine(minilm_path(), tune_allocator=True)  # lab.runtime.allocator; the rows' malloc_tuning
    warnings.filterwarnings("ignore", message=".*longer than max_length.*")
    for out in args.outputs:  # warm-up
        eng.embed(texts[:64], output=out)
    rows = []
    for r in range(args.rounds):
        for out in args.outputs:
            t0 = time.perf_counter()
            eng.embed(texts, output=out)
            secs = time.perf_counter() - t0
            rows.append(
                {
                    "output": out,
                    "round": r,
                    "texts": len(texts),
                    "tokens": eng.stats.tokens,
                    "seconds": secs,
                    "tokens_per_s": eng.stats.tokens / secs,
                    "padded_tokens": eng.stats.padded_tokens,
                }
            )
    df = pd.DataFrame(rows)
    info = cpu_info()
    df["cpu_model"], df["cpu_flags"], df["threads"], df["load_before"], df["malloc_tuning"] = (
        info["cpu_model"],
        info["cpu_flags"],
        eng.resolved["cpu_workers"],
        round(load, 2),
        eng.resolved["malloc_tuning"],
    )
    med = df.groupby("output").tokens_per_s.median()
    df["ratio_vs_dense"] = df.output.map(med / med["dense"])
    df = stamp(df)
    save_table(Path(args.out) if args.out else result_path("bench_outputs", root=RESULTS), df)
    print(f"{info['cpu_model']}, load {load:.2f} before; median tokens/s over {args.rounds} rounds:")
    print((med.to_frame("tokens_per_s").assign(ratio_vs_dense=med / med["dense"])).round(3).to_string())
    return df


if __name__ == "__main__":
    main()
