"""The report of ``evals/bench_decoder.py``'s rows: the sections' plots beside the CSV (``plot``) and the printed
summary (``summary``)."""

from __future__ import annotations

from pathlib import Path

from evals.results_index import companion, save_file


# ------------------------------------------------------------------------------------------------------ plots
def plot(df, csv_path: Path, slug: str | None = None) -> list[Path]:
    """The sections' plots beside ``csv_path`` (``evals.results_index.companion``: ``<name>_<kind>_<slug>.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(kind: str) -> None:  # the current figure, then closed
        written.append(save_file(companion(csv_path, kind, "png", slug), plt.gcf()))
        plt.close()

    run = df["run"].iloc[0] if len(df) else ""
    tp = df[(df.section == "throughput") & (df.metric == "time")]
    if len(tp):
        tp = tp.assign(
            label=tp.system
            + " "
            + tp.setting.str.replace("max_batch_tokens=", "tokens ").str.replace("batch_size=", "batch "),
            group=tp.dtype + "\n" + tp.pooling,
        )
        pivot = tp.pivot_table(index="group", columns="label", values="tokens_per_s", sort=False)
        ax = pivot.plot.bar(rot=0, figsize=(8, 4.5))
        ax.set_ylabel("tokens / s (median)")
        ax.set_xlabel("")
        corpus = {"scifact": "SciFact abstracts", "mixed": "mixed texts"}.get(tp.corpus.iloc[0], tp.corpus.iloc[0])
        ax.set_title(f"SmolLM2-135M on {corpus}: Engine vs padded transformers\n({run})", fontsize=10)
        speed = df[(df.section == "throughput") & (df.metric == "speedup_vs_best_baseline")]
        for i, group in enumerate(pivot.index):
            r = speed[(speed.dtype + "\n" + speed.pooling) == group]
            if len(r):
                ax.annotate(
                    f"{float(r.value.iloc[0]):.2f}x",
                    (i, pivot.loc[group].max()),
                    ha="center",
                    va="bottom",
                    fontsize=9,
                    xytext=(0, 3),
                    textcoords="offset points",
                )
        plt.tight_layout()
        save("throughput")
    mem = df[df.section == "memory"]
    if len(mem):
        m = mem.assign(
            length=mem.setting.str.extract(r"length=(\d+)")[0].astype(int),
            chunk=mem.setting.str.extract(r"chunked_prefill=(\w+)")[0],
        )
        peak_metric = next(
            (
                x
                for x in ("run_cuda_delta_mb", "peak_tensor_mb", "run_rss_delta_mb", "peak_rss_mb")
                if (m.metric == x).any()
            ),
            "peak_rss_mb",
        )
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
        for chunk, g in m.groupby("chunk", sort=False):
            label = "off" if chunk == "None" else chunk
            for ax, metric, col in (
                (axes[0], peak_metric, "value"),
                (axes[1], "run_rss_delta_mb", "value"),
                (axes[2], "time", "seconds_median"),
            ):
                s = g[g.metric == metric].sort_values("length")
                ax.plot(s.length, s[col], marker="o", label=f"chunked_prefill={label}")
        title0 = {
            "peak_tensor_mb": "peak tensor memory above the loaded model",
            "run_cuda_delta_mb": "peak CUDA memory above the loaded model",
        }.get(peak_metric, "peak memory")
        for ax, title, ylabel in (
            (axes[0], title0, "MB (" + peak_metric + ")"),
            (axes[1], "RSS high-water mark above idle", "MB"),
            (axes[2], "time", "seconds"),
        ):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(m.length.unique()), [str(x) for x in sorted(m.length.unique())])
            ax.set_xlabel("input length (tokens)")
            ax.set_title(title)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"SmolLM2-135M, one long input, chunked prefill ({run})", fontsize=11)
        plt.tight_layout()
        save("memory")
    pre = df[(df.section == "prefix") & (df.metric == "time")]
    if len(pre):
        pivot = pre.pivot_table(index="pooling", columns="setting", values="seconds_median", sort=False)
        ax = pivot.plot.bar(rot=0, figsize=(6, 4))
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"shared-instruction queries: prefix cache\n({run})", fontsize=10)
        ax.legend(title="setting", loc="upper left", fontsize=8)
        plt.tight_layout()
        save("prefix")
    return written


def summary(df) -> str:
    import pandas as pd

    keep = df[
        df.metric.isin(
            [
                "time",
                "speedup_vs_baseline",
                "speedup_vs_best_baseline",
                "min_cosine_vs_baseline",
                "min_cosine_vs_float32_baseline",
                "min_cosine_vs_itself_other_batch",
                "speedup_vs_baseline_cpu_time",
                "speedup_prefix_cache_cpu_time",
                "identical_tokens",
                "peak_rss_mb",
                "run_rss_delta_mb",
                "peak_cuda_allocated_mb",
                "peak_tensor_mb",
                "state_mb",
                "speedup_prefix_cache",
                "min_cosine_cache_vs_nocache",
                "instruction_fraction_min",
                "gemm_seconds",
                "attention_seconds",
                "other_ops_seconds",
                "profiled_wall_seconds",
                "speedup_ceiling_at_gemm_roofline",
            ]
        )
    ]
    cols = [
        "section",
        "system",
        "dtype",
        "pooling",
        "setting",
        "metric",
        "value",
        "target",
        "meets_target",
        "seconds_median",
        "cpu_seconds_median",
        "tokens_per_s",
        "roofline_fraction",
        "baseline_slowdown",
    ]
    with pd.option_context(
        "display.width",
        200,
        "display.max_columns",
        20,
        "display.max_colwidth",
        40,
        "display.float_format",
        "{:.4g}".format,
    ):
        return keep[cols].to_string(index=False)
