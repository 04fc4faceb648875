"""Benchmark: the CPU attention kernels alone, one thread (one CPU worker's share), at the shapes of two models.

Kernels (``lab.ops.attention.KERNELS``): torch's fused kernel (``sdpa``), the three-op path (``matmul``: scores,
softmax, weighted sum in groups of ``MATMUL_SCORES`` scores) and prefill-lab's own
(``lab``: ``lab.kernels.cpu_attention``), all through ``lab.kernels`` as a layer calls them. Per shape, dtype and
sequence length, ``--tokens`` tokens of equal-length random sequences run bidirectionally; the kernels take turns,
``--rounds`` rounds after one untimed call each, and the median counts. Shapes: all-MiniLM-L6-v2 (12 heads of 32) and
SmolLM2-135M (9 query heads over 3 key/value heads of 64; ``matmul`` left out, it is not offered to decoders).

    python -m evals.bench_attention                      # ~2 min on 2 cores
    python -m evals.bench_attention --lengths 16 128 --rounds 3

Writes evals/results/bench_attention/bench_attention_<machine>.csv (tidy rows with the run's ``run_date``, the CPU
model and flags, GFLOP/s from the 4 L^2 H D FLOPs of each sequence, the time against ``sdpa``), the plot
``bench_attention_<machine>.png`` and the command in ``<csv>.meta.json``; the machine is
``lab.ops.probes.machine_slug()`` (``evals.results_index``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
from pathlib import Path

import pandas as pd
import torch

from evals.results_index import save_run, stamp

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"all-MiniLM-L6-v2": (12, 12, 32), "SmolLM2-135M": (9, 3, 64)}  # query heads, key/value heads, head size


def kernels_for(model: str) -> tuple[str, ...]:
    from lab.kernels import cpu_attention

    names = ("sdpa", "matmul") if model == "all-MiniLM-L6-v2" else ("sdpa",)
    return names + (("lab",) if cpu_attention.available() else ())


def run(lengths: list[int], dtypes: list[str], tokens: int, rounds: int) -> pd.DataFrame:
    from lab.eval.bench import interleaved
    from lab.ops.attention import attention
    from lab.ops.batch import AttnMeta
    from lab.ops.probes import cpu_info

    info = cpu_info()
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for model, (hq, hkv, d) in SHAPES.items():
                for dtype in dtypes:
                    dt = getattr(torch, dtype)
                    for length in lengths:
                        n = max(1, tokens // length)
                        meta = AttnMeta.from_lengths([length] * n, causal=False)
                        qkv = torch.randn(n * length, hq + 2 * hkv, d, dtype=dt)  # one fused projection's output
                        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
                        calls = {
                            name: functools.partial(attention, q, k, v, meta, 0, kernel=name)
                            for name in kernels_for(model)
                        }
                        times = {name: wall for name, (wall, _, _) in interleaved(calls, rounds, 1).items()}
                        flops = 4 * n * length * length * hq * d
                        base = statistics.median(times["sdpa"])
                        for name, ts in times.items():
                            s = statistics.median(ts)
                            rows.append(
                                {
                                    "model": model,
                                    "dtype": dtype,
                                    "length": length,
                                    "sequences": n,
                                    "kernel": name,
                                    "seconds_median": s,
                                    "seconds_min": min(ts),
                                    "rounds": rounds,
                                    "gflops": flops / s / 1e9,
                                    "time_vs_sdpa": s / base,
                                    **info,
                                    "threads": 1,
                                }
                            )
    finally:
        torch.set_num_threads(threads)
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(df.groupby(["model", "dtype"], sort=False))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4), sharey=True, squeeze=False)
    colors = {"sdpa": "#999999", "matmul": "#2ca02c", "lab": "#1f77b4"}
    for ax, ((model, dtype), g) in zip(axes[0], panels):
        for name, k in g.groupby("kernel", sort=False):
            ax.plot(k.length, k.gflops, "o-", color=colors.get(name), label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}\n{dtype}", fontsize=9)
        ax.set_xlabel("sequence length (tokens)")
    axes[0][0].set_ylabel("GFLOP/s, one thread (median)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"CPU attention kernels on {df.cpu_model.iloc[0]} ({df.cpu_flags.iloc[0]})", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[8, 24, 64, 128, 256, 512])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per timed call")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--out", default=str(RESULTS / "bench_attention"), help="folder (default evals/results/bench_attention)"
    )
    args = parser.parse_args(argv)
    df = stamp(run(args.lengths, args.dtypes, args.tokens, args.rounds))
    save_run(df, Path(args.out), "bench_attention", plot(df))
    cols = ["model", "dtype", "length", "kernel", "seconds_median", "gflops", "time_vs_sdpa"]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:,.4f}"))


if __name__ == "__main__":
    main()
