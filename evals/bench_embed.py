"""Benchmark: Engine.embed vs SentenceTransformer.encode on the same real texts, same process, same weights.

Two engines per dtype: the eager forward (``compile=False``, system ``engine``) and the compiled one
(``compile=True``, system ``engine-compiled``, ``lab.runtime.compiled``; the first calls of its graphs, built with
inductor's on-disk cache as the machine has it, in ``compile_seconds``).

Corpora: STSBenchmark test sentences (short), SciFact abstracts (long; cut at all-MiniLM-L6-v2's 256 tokens), and
``mixed``: 400 other STSBenchmark sentences and 260 other SciFact abstracts, shuffled.
For each dtype the two systems run interleaved (engine, baseline, engine, ...) so drift hits both alike; the table
keeps the median of ``--repeats`` runs, the tokens/s ratio, the minimum per-text cosine between the two systems'
embeddings, and the share of the GEMM roofline (tokens/s implied by measured matmul FLOP/s at the model's shapes
and its FLOPs per token) each reaches.

    python -m evals.bench_embed                     # full run: ~10 min on 2 cores
    python -m evals.bench_embed --repeats 2 --scifact-docs 300     # quicker

Writes evals/results/bench_embed/bench_embed_<machine>.csv (tidy rows, with the run's ``run_date``, the CPU model,
its flags, the engine's probed CPU fast paths ``cpu_paths`` and ``malloc_tuning``: the engine is created with
``tune_allocator=True``, which tunes glibc's allocator for the whole process, the baseline's runs included;
``lab.runtime.allocator``), the plot ``bench_embed_<machine>.png`` and the command in ``<csv>.meta.json``; the machine
is ``lab.ops.probes.machine_slug()`` (``evals.results_index``). ``baseline_slowdown``: the baseline's interleaved
median over its median timed alone before the engine ran on those texts (near 1: the engine did not slow the baseline
down). The targets are columns of the engine's rows (``targets``): ``ratio_target`` / ``meets_ratio_target`` on the
mixed corpus (the ratio, at a minimum cosine of 0.9999), ``roofline_target`` / ``meets_roofline_target`` for float32
on STSBenchmark and SciFact.

Where the engine's time goes, per corpus and dtype (``kernel_seconds``): ``gemm_seconds_at_roofline`` plus
``attention_seconds``, every layer's attention timed in the engine's own CPU kernel at the corpus's token lengths
(``lab.eval.bench.attention_seconds``). ``kernel_share`` is their sum over the engine's median (near 1: nothing but
GEMMs and attention left to remove), ``roofline_cap`` the highest roofline share reachable without a faster attention
kernel, ``ratio_at_kernel_seconds`` the ratio an engine spending only ``kernel_seconds`` would reach.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from evals.criteria import meets_speed_target, min_cosine
from evals.data_io import load_corpus
from evals.results_index import save_run, stamp
from lab.models.hub import local_folder

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
# issue 15: engine / sentence-transformers on the mixed corpus (at ``evals.criteria.COSINE_TARGET``); float32
# share of the GEMM roofline
RATIO_TARGETS = {("mixed", "float32"): 1.45, ("mixed", "bfloat16"): 1.6}
ROOFLINE_TARGETS = {("stsbenchmark", "float32"): 0.85, ("scifact", "float32"): 0.85}


def run(model: str, corpora: list[str], dtypes: list[str], repeats: int, scifact_docs: int) -> pd.DataFrame:
    from lab import Engine
    from lab.eval.bench import SentenceTransformerBaseline, gemm_roofline
    from lab.ops.probes import cpu_info

    machine = cpu_info()
    rows = []
    for dtype in dtypes:
        base = SentenceTransformerBaseline(model, dtype=dtype)
        # probes its CPU fast paths at load (eng.cpu_paths); tunes glibc's allocator for this process, the
        # baseline's runs included (lab.runtime.allocator; the rows' malloc_tuning)
        eng = Engine(model, dtype=dtype, tune_allocator=True, compile=False)
        comp = Engine(model, dtype=dtype, tune_allocator=True, compile=True)  # the compiled forward (own rows)
        paths = ";".join(f"{k}={v}" for k, v in eng.cpu_paths.items())
        cfg = eng.spec.config
        roof = gemm_roofline(
            cfg["hidden_size"],
            cfg["intermediate_size"],
            cfg["num_hidden_layers"],
            dtype=getattr(torch, dtype),
            plan=eng.runner.plan,
        )
        for corpus in corpora:
            texts = load_corpus(corpus, scifact_docs)
            b = base(texts)  # warm-up; then the baseline alone, before the engine runs on these texts
            alone = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                base(texts)
                alone.append(time.perf_counter() - t0)
            a = eng.embed(texts)  # warm-up, and the parity check
            cos = {"engine": min_cosine(a, b), "engine-compiled": min_cosine(comp.embed(texts), b)}
            # the warm-up built the graphs (one per thread layout): each one's first call, trace + compile + run
            compile_seconds = sum(comp.runner.compiled.compile_seconds.values())
            times = {"engine": [], "engine-compiled": [], "sentence-transformers": []}
            systems = (
                ("engine", lambda t=texts, e=eng: e.embed(t)),
                ("engine-compiled", lambda t=texts, e=comp: e.embed(t)),
                ("sentence-transformers", lambda t=texts, b=base: b(t)),
            )
            for _ in range(repeats):
                for name, fn in systems:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            real, padded = base.token_counts(texts)
            assert real == eng.stats.tokens, (real, eng.stats.tokens)  # identical tokens on both sides
            kernels = kernel_seconds(eng, texts, roof)
            for name, secs in times.items():
                med, engine = statistics.median(secs), name != "sentence-transformers"
                rows.append(
                    {
                        "corpus": corpus,
                        "dtype": dtype,
                        "system": name,
                        "model": eng.model_name,
                        "revision": eng.revision,
                        "texts": len(texts),
                        "tokens": real,
                        "padded_tokens": eng.stats.padded_tokens if engine else padded,
                        "seconds_median": med,
                        "seconds_min": min(secs),
                        "seconds_max": max(secs),
                        "repeats": repeats,
                        "tokens_per_s": real / med,
                        "min_cosine": cos.get(name, 1.0),
                        "gemm_gflops": roof["gemm_gflops"],
                        "roofline_tokens_per_s": roof["roofline_tokens_per_s"],
                        "roofline_fraction": real / med / roof["roofline_tokens_per_s"],
                        "threads": torch.get_num_threads(),
                        **kernels,
                        "kernel_share": kernels["kernel_seconds"] / med if name == "engine" else None,
                        # the baseline timed alone before the engine ran: > 1 here means the engine slowed it down
                        "baseline_slowdown": med / statistics.median(alone) if not engine else None,
                        "cpu_paths": paths if name == "engine" else None,
                        "malloc_tuning": eng.resolved["malloc_tuning"],
                        "compile_seconds": compile_seconds if name == "engine-compiled" else None,
                        **machine,
                    }
                )
            print(
                f"{corpus:13s} {dtype:9s} engine {rows[-3]['tokens_per_s']:8,.0f} tok/s  "
                f"compiled {rows[-2]['tokens_per_s']:8,.0f} tok/s (compile {compile_seconds:.0f} s)  "
                f"sentence-transformers {rows[-1]['tokens_per_s']:8,.0f} tok/s  "
                f"ratio {rows[-3]['tokens_per_s'] / rows[-1]['tokens_per_s']:.3f} / "
                f"{rows[-2]['tokens_per_s'] / rows[-1]['tokens_per_s']:.3f}  min cos {cos['engine']:.6f}  "
                f"roofline {rows[-3]['roofline_fraction']:.0%} / {rows[-1]['roofline_fraction']:.0%}  "
                f"GEMMs + attention {rows[-3]['kernel_share']:.0%} of the engine's time  "
                f"baseline after/alone {rows[-1]['baseline_slowdown']:.3f}  [{paths}]",
                flush=True,
            )
    df = pd.DataFrame(rows)
    st = df[df.system == "sentence-transformers"].set_index(["corpus", "dtype"])["tokens_per_s"]
    df["ratio_vs_sentence_transformers"] = [r.tokens_per_s / st[(r.corpus, r.dtype)] for r in df.itertuples()]
    # the ratio an engine spending only ``kernel_seconds`` would reach against this run's baseline
    df["ratio_at_kernel_seconds"] = [r.tokens / r.kernel_seconds / st[(r.corpus, r.dtype)] for r in df.itertuples()]
    return targets(df)


def kernel_seconds(eng, texts: list[str], roof: dict) -> dict:
    """What the engine's GEMMs and attention alone would take on ``texts``: the GEMMs at the roofline
    (``gemm_seconds_at_roofline``, ``roof`` from ``lab.eval.bench.gemm_roofline``) plus every layer's attention in the
    engine's CPU kernel (the one its ``attention_kernel`` probe chose) at the texts' exact token lengths, one
    worker's thread count, shared evenly among its CPU workers (``attention_seconds``, from
    ``lab.eval.bench.attention_seconds``). ``roofline_cap``: the share of the GEMM roofline an engine doing nothing but
    these two would reach, i.e. the highest ``roofline_fraction`` attainable without a faster attention kernel. An
    estimate from separate timings (a few % either way), not a bound."""
    from lab.eval.bench import attention_seconds

    cfg, workers = eng.spec.config, eng.resolved["cpu_workers"]
    lengths = [r.length for r in eng.tokenize(texts)]
    heads = cfg["num_attention_heads"]
    one_layer = attention_seconds(
        lengths,
        heads,
        cfg["hidden_size"] // heads,
        dtype=eng.runner.dtype,
        threads=max(1, torch.get_num_threads() // workers),
        kernel=eng.cpu_paths.get("attention_kernel", "sdpa"),
    )
    attn = cfg["num_hidden_layers"] * one_layer / workers
    gemm = sum(lengths) / roof["roofline_tokens_per_s"]
    return {
        "gemm_seconds_at_roofline": gemm,
        "attention_seconds": attn,
        "kernel_seconds": gemm + attn,
        "roofline_cap": gemm / (gemm + attn),
    }


def targets(df: pd.DataFrame) -> pd.DataFrame:
    """Issue 15's targets as columns of the engine's rows (module doc); other rows get NaN / None."""
    cols = {"ratio_target": [], "meets_ratio_target": [], "roofline_target": [], "meets_roofline_target": []}
    for r in df.itertuples():
        engine = r.system == "engine"
        ratio_t = RATIO_TARGETS.get((r.corpus, r.dtype)) if engine else None
        roof_t = ROOFLINE_TARGETS.get((r.corpus, r.dtype)) if engine else None
        cols["ratio_target"].append(ratio_t)
        cols["meets_ratio_target"].append(meets_speed_target(r.ratio_vs_sentence_transformers, ratio_t, r.min_cosine))
        cols["roofline_target"].append(roof_t)
        cols["meets_roofline_target"].append(None if roof_t is None else bool(r.roofline_fraction >= roof_t))
    return df.assign(**cols)


def plot(df: pd.DataFrame):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(df.groupby(["corpus", "dtype"], sort=False))
    fig, ax = plt.subplots(figsize=(8, 4))
    systems = [s for s in ("sentence-transformers", "engine", "engine-compiled") if s in set(df.system)]
    width = 0.8 / len(systems)
    for i, ((corpus, dtype), g) in enumerate(groups):
        for j, system in enumerate(systems):
            r = g[g.system == system].iloc[0]
            x = i + (j - (len(systems) - 1) / 2) * width
            ax.bar(
                x, r.tokens_per_s, width, color=["#999999", "#1f77b4", "#2ca02c"][j], label=system if i == 0 else None
            )
            ax.errorbar(
                x,
                r.tokens_per_s,
                yerr=[[r.tokens_per_s - r.tokens / r.seconds_max], [r.tokens / r.seconds_min - r.tokens_per_s]],
                color="k",
                capsize=3,
            )
        eng = g[g.system == "engine"].iloc[0]
        top = eng.tokens / eng.seconds_min  # above the error bar
        ax.text(
            i + (systems.index("engine") - (len(systems) - 1) / 2) * width,
            top,
            f"{eng.ratio_vs_sentence_transformers:.2f}x",
            ha="center",
            va="bottom",
            fontsize=9,
            fontweight="bold",
        )
        ax.hlines(
            eng.roofline_tokens_per_s,
            i - 0.45,
            i + 0.45,
            colors="r",
            linestyles="dotted",
            label="GEMM roofline" if i == 0 else None,
        )
        if "kernel_seconds" in g:
            ax.hlines(
                eng.tokens / eng.kernel_seconds,
                i - 0.45,
                i + 0.45,
                colors="darkorange",
                linestyles="dashed",
                label="GEMMs at roofline + attention kernel" if i == 0 else None,
            )
    ax.set_xticks(range(len(groups)), [f"{c}\n{d}" for (c, d), _ in groups])
    ax.set_ylabel("tokens / s (median)")
    isa = f"{df.isa.iloc[0]}, " if "isa" in df else ""
    ax.set_title(f"all-MiniLM-L6-v2 on {df.cpu_model.iloc[0]} ({isa}{torch.get_num_threads()} threads)", fontsize=9)
    tops = [(df.tokens / df.seconds_min).max(), df.roofline_tokens_per_s.max()]
    if "kernel_seconds" in df:
        tops.append((df.tokens / df.kernel_seconds).max())
    ax.set_ylim(0, 1.1 * max(tops))
    ax.legend(loc="upper center", fontsize=8, ncol=3, bbox_to_anchor=(0.5, -0.18))
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="model folder or hub id (org/name[@revision]; default: bundled all-MiniLM-L6-v2)"
    )
    parser.add_argument("--corpora", nargs="+", default=["stsbenchmark", "scifact", "mixed"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scifact-docs", type=int, default=1000)
    parser.add_argument(
        "--out", default=str(RESULTS / "bench_embed"), help="folder (default evals/results/bench_embed)"
    )
    args = parser.parse_args(argv)
    if args.model is None:
        from lab._extras import minilm_path

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        args.model = minilm_path()
    args.model = local_folder(args.model)
    df = stamp(run(args.model, args.corpora, args.dtypes, args.repeats, args.scifact_docs))
    save_run(df, Path(args.out), "bench_embed", plot(df))
    cols = [
        "corpus",
        "dtype",
        "system",
        "tokens_per_s",
        "ratio_vs_sentence_transformers",
        "roofline_fraction",
        "roofline_cap",
        "kernel_share",
        "ratio_at_kernel_seconds",
        "min_cosine",
        "baseline_slowdown",
        "meets_ratio_target",
        "meets_roofline_target",
    ]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:,.3f}"))


if __name__ == "__main__":
    main()
