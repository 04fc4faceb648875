"""The table and the plot of ``evals/bench_peers.py``: ``assemble`` (the CSV's rows from ``measure``'s records and
the workers' load replies: the matching rule, ``MATCH_COSINE``, the precision classes, the ratios to
sentence-transformers and to the fastest peer, the roofline share) and ``plot`` (tokens/s per system and corpus)."""

from __future__ import annotations

import datetime
import os
import statistics

import numpy as np
import pandas as pd

from evals.bench_peers_workers import ENGINE, REFERENCE, SYSTEMS

MATCH_COSINE = 0.999  # min cosine to st-torch-float32 below which a row's speed is not reported
PRECISION_CLASSES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16", "f16": "float16", "fp16": "float16"}


def precision_class(precision: str) -> str:
    return PRECISION_CLASSES.get(precision, precision)


def assemble(
    records: list[dict], loads: dict, machine: dict, *, run_date: str | None = None, systems: dict | None = None
) -> pd.DataFrame:
    """The CSV's rows from ``measure``'s records and the workers' ``load`` replies (``evals/bench_peers.py``'s
    module doc for the columns)."""
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
