"""Plots over the tidy tables of ``lab.eval.bench`` and ``lab.evaluate``: a DataFrame (or a matrix) in, a Figure out.

Figures are built on ``matplotlib.figure.Figure`` directly, never through pyplot: nothing is shown or kept in a
global figure registry, any backend works (Agg included), a notebook displays the returned figure and a script calls
``fig.savefig``. Plots only read the tables; benchmarks write them (see ``lab.eval.bench``).

    >>> df = lab.eval.bench.throughput({"engine": eng, "sentence-transformers": base}, texts,
    ...                           sweep={"max_batch_tokens": [1024, 16384]})
    >>> tokens_per_s_vs_budget(df).savefig("evals/results/throughput/throughput_budget_<machine>.png", dpi=150)
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure


class LabFigure(Figure):
    """A Figure that renders itself in notebooks (``_repr_png_``), whether or not pyplot's inline backend is on."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        return buf.getvalue()


def _figure(width: float = 6.4, height: float = 4.0) -> tuple[Figure, object]:
    fig = LabFigure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


def _require(df: pd.DataFrame, columns: Sequence[str], what: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(
            f"{what} needs column(s) {', '.join(missing)}; the table has {', '.join(map(str, df.columns))}"
        )
    if df.empty:
        raise ValueError(f"{what}: the table is empty")


def _varying(df: pd.DataFrame, exclude: Sequence[str] = ()) -> list[str]:
    """Engine knob columns (``lab.engine.knob_registry.KNOBS``) whose value differs between rows: they name the
    series. Other columns (derived ratios, bucket names, ...) never split a line."""
    from lab.engine.knob_registry import KNOBS

    knobs = [name for name in KNOBS if name in df.columns and name not in exclude]
    return [c for c in knobs if df[c].map(str).nunique() > 1]


def _series_label(system, knobs: dict) -> str:
    shown = {k: v for k, v in knobs.items() if v is not None and not (isinstance(v, float) and np.isnan(v))}
    inner = ", ".join(f"{k}={v}" for k, v in shown.items())
    return f"{system} ({inner})" if inner else str(system)


def _groups(df: pd.DataFrame, keys: list[str]):
    """(label, rows) per distinct value of ``keys`` (``system`` first), None / NaN kept as their own group."""
    if not keys:
        yield "", df
        return
    as_text = pd.Series(["\x1f".join(map(str, row)) for row in df[keys].itertuples(index=False)], index=df.index)
    for key in dict.fromkeys(as_text):  # first-seen order
        rows = df[as_text == key]
        first = rows.iloc[0]
        system = first["system"] if "system" in keys else ""
        yield _series_label(system, {k: first[k] for k in keys if k != "system"}).strip(), rows


def _log2_x(ax, values) -> None:
    """A log2 x axis ticked at the measured values, written as plain numbers."""
    ticks = sorted({float(v) for v in values if v is not None and not pd.isna(v) and float(v) > 0})
    if not ticks:
        return
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    if len(ticks) <= 12:
        ax.set_xticks(ticks, [f"{t:,.0f}" for t in ticks])


def _tokens_per_s_lines(ax, df: pd.DataFrame, x: str, keys: list[str]) -> None:
    """One tokens/s line per ``keys`` group against column ``x``, shaded between the slowest and fastest repeat
    when the table has ``tokens`` / ``seconds_min`` / ``seconds_max``."""
    band = {"tokens", "seconds_min", "seconds_max"} <= set(df.columns)
    for label, rows in _groups(df, keys):
        xs = rows[x].astype(float).to_numpy()
        (line,) = ax.plot(xs, rows["tokens_per_s"].to_numpy(dtype=float), marker="o", label=label)
        if band:
            tokens = rows["tokens"].astype(float).to_numpy()
            slowest, fastest = (tokens / rows[c].astype(float).to_numpy() for c in ("seconds_max", "seconds_min"))
            ax.fill_between(xs, slowest, fastest, color=line.get_color(), alpha=0.15, linewidth=0)


def _tokens_per_s_axes(ax, x_values, xlabel: str, title: str) -> None:
    """Log2 x axis at the measured values, tokens/s from zero, grid and legend."""
    _log2_x(ax, x_values)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def tokens_per_s_vs_budget(
    df: pd.DataFrame, *, budget: str = "max_batch_tokens", roofline: float | None = None, title: str | None = None
) -> Figure:
    """Tokens/s against the token budget per packed step, one line per system x other varying knobs.

    Rows without a budget (the sentence-transformers baseline, plain callables) are drawn as dashed horizontal
    lines; the shaded band spans the fastest and slowest repeat. ``roofline``: tokens/s ceiling to draw (e.g.
    ``lab.eval.bench.gemm_roofline(...)["roofline_tokens_per_s"]``).
    """
    _require(df, ["system", budget, "tokens_per_s"], "tokens_per_s_vs_budget")
    fig, ax = _figure()
    swept = df[df[budget].notna()].sort_values(budget)
    fixed = df[df[budget].isna()]
    _tokens_per_s_lines(ax, swept, budget, ["system", *_varying(swept, exclude=[budget, "system"])])
    for label, rows in _groups(fixed, ["system"]):
        ax.axhline(rows["tokens_per_s"].astype(float).median(), linestyle="--", color="gray", label=label)
    if roofline:
        ax.axhline(roofline, linestyle=":", color="black", label="GEMM roofline")
    _tokens_per_s_axes(ax, swept[budget], f"{budget} (tokens per packed step)", title or "Throughput vs token budget")
    return fig


def tokens_per_s_vs_length(df: pd.DataFrame, *, length: str = "length", title: str | None = None) -> Figure:
    """Tokens/s against input length (tokens per text), one line per system x varying knobs.

    ``df`` is ``lab.eval.bench.throughput_by_length``'s table (a ``length`` column: mean tokens per text).
    """
    _require(df, ["system", length, "tokens_per_s"], "tokens_per_s_vs_length")
    fig, ax = _figure()
    keys = ["system", *_varying(df, exclude=[length, "system"])]
    _tokens_per_s_lines(ax, df.sort_values(length), length, keys)
    _tokens_per_s_axes(ax, df[length], "tokens per input", title or "Throughput vs input length")
    return fig


def padding_waste(df: pd.DataFrame, *, length: str = "length", title: str | None = None) -> Figure:
    """Real tokens vs padding each system ran: stacked bars (padding hatched), grouped by input length if present.

    The packed engine pads nothing; sentence-transformers pads each batch to its longest input.
    """
    _require(df, ["system", "tokens", "padded_tokens"], "padding_waste")
    df = df.copy()
    df["padded_tokens"] = df["padded_tokens"].fillna(0).astype(float)
    groups = sorted(df[length].unique()) if length in df.columns else [None]
    systems = list(dict.fromkeys(df["system"]))
    fig, ax = _figure(max(6.4, 1.2 * len(groups) * len(systems)), 4.0)
    width = 0.8 / len(systems)
    colors = [f"C{i}" for i in range(len(systems))]
    pad_labelled = False
    for j, system in enumerate(systems):
        for i, g in enumerate(groups):
            rows = df[df["system"] == system] if g is None else df[(df["system"] == system) & (df[length] == g)]
            if rows.empty:
                continue
            real, pad = float(rows["tokens"].iloc[0]), float(rows["padded_tokens"].iloc[0])
            x = i + (j - (len(systems) - 1) / 2) * width
            ax.bar(x, real, width, color=colors[j], label=system if i == 0 else None)
            ax.bar(
                x,
                pad,
                width,
                bottom=real,
                color="white",
                edgecolor=colors[j],
                hatch="//",
                label=None if pad_labelled or not pad else "padding",
            )
            pad_labelled = pad_labelled or bool(pad)
            ax.annotate(
                f"{100 * pad / real:.0f}% pad" if real else "",
                (x, real + pad),
                ha="center",
                va="bottom",
                fontsize="x-small",
            )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(["all inputs"] if groups == [None] else [f"~{g:.0f} tokens" for g in groups])
    ax.set_ylabel("tokens run through the model")
    ax.set_title(title or "Padding: real tokens + padded tokens")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return fig


def grouped_bars(
    df: pd.DataFrame,
    *,
    x: str,
    hue: str,
    value: str,
    title: str | None = None,
    ylabel: str | None = None,
    fmt: str = "{:.3f}",
    ylim: tuple[float, float] | None = None,
) -> Figure:
    """Bars of ``value`` per ``x`` group, one bar per ``hue`` value (the mean where rows repeat), values on top."""
    _require(df, [x, hue, value], "grouped_bars")
    # dropna=False keeps a variant whose score is undefined (NaN): drawn as an empty slot labelled n/a
    table = df.pivot_table(index=x, columns=hue, values=value, aggfunc="mean", sort=False, dropna=False)
    n_x, n_hue = table.shape
    fig, ax = _figure(max(6.4, 0.5 * n_x * n_hue + 2) + (2.5 if n_hue > 3 else 0), 4.0)
    width = 0.8 / n_hue
    for j, h in enumerate(table.columns):
        xs = np.arange(n_x) + (j - (n_hue - 1) / 2) * width
        vals = table[h].to_numpy(dtype=float)
        bars = ax.bar(xs, np.nan_to_num(vals), width, label=str(h))
        ax.bar_label(
            bars,
            labels=["n/a" if np.isnan(v) else fmt.format(v) for v in vals],
            fontsize="x-small",
            rotation=90 if n_hue * n_x > 12 else 0,
            padding=2,
        )
    ax.set_xticks(range(n_x))
    ax.set_xticklabels(
        [str(i) for i in table.index], rotation=20 if n_x > 4 else 0, ha="right" if n_x > 4 else "center"
    )
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel or value)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title or f"{value} by {x} and {hue}")
    if n_hue > 3:  # many variants: the legend goes beside the axes, not over the bars
        ax.legend(title=hue, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(title=hue, fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return fig


def scores(
    df: pd.DataFrame, *, metric: str | None = None, split: str | None = None, title: str | None = None
) -> Figure:
    """MTEB results from ``lab.evaluate``: bars of each task's main score (or ``metric``) per variant."""
    _require(df, ["task", "variant", "metric", "score"], "scores")
    rows = df[df["metric"] == metric] if metric is not None else df[df["main"].astype(bool)]
    if split is not None:
        rows = rows[rows["split"] == split]
    if rows.empty:
        raise ValueError(f"scores: no rows for metric={metric!r} split={split!r}")
    what = metric or "main score"
    top = float(rows["score"].max())
    ylim = (0.0, min(1.0, top * 1.15)) if 0 < top <= 1 else None  # mteb's 0-1 scale, room for the labels
    return grouped_bars(
        rows, x="task", hue="variant", value="score", title=title or f"MTEB {what} per variant", ylabel=what, ylim=ylim
    )


def similarity_heatmap(
    matrix, labels: Sequence[str] | None = None, *, title: str = "Cosine similarity", max_label: int = 40
) -> Figure:
    """A similarity matrix as a heatmap, values written in the cells when the matrix is small enough to read.

    ``labels`` name the rows as ``[i] text`` (cut at ``max_label`` characters); columns are numbered ``[j]``.
    """
    m = np.asarray(matrix, dtype=float)
    if m.ndim != 2:
        raise ValueError(f"similarity_heatmap needs a 2-D matrix, got shape {m.shape}")
    n_rows, n_cols = m.shape
    cell = 0.5 if max(n_rows, n_cols) <= 16 else 0.25
    fig, ax = _figure(min(3.5 + cell * n_cols + (2.5 if labels else 0), 18), min(1.2 + cell * n_rows, 16))
    lo = min(0.0, float(np.nanmin(m))) if m.size else 0.0
    im = ax.imshow(m, cmap="viridis", vmin=lo, vmax=1.0)
    fig.colorbar(im, ax=ax, shrink=0.8)
    ax.set_xticks(range(n_cols), [f"[{j}]" for j in range(n_cols)], fontsize="small")
    if labels is not None and len(labels) == n_rows:
        short = [s if len(s) <= max_label else s[: max_label - 1] + "…" for s in map(str, labels)]
        ax.set_yticks(range(n_rows), [f"[{i}] {s}" for i, s in enumerate(short)], fontsize="small")
    else:
        ax.set_yticks(range(n_rows), [f"[{i}]" for i in range(n_rows)], fontsize="small")
    if n_rows * n_cols <= 400:
        for i in range(n_rows):
            for j in range(n_cols):
                ax.text(
                    j,
                    i,
                    f"{m[i, j]:.2f}",
                    ha="center",
                    va="center",
                    fontsize="x-small",
                    color="black" if m[i, j] > (lo + 1) / 2 else "white",
                )
    ax.set_title(title)
    return fig


def _per_chunk(df: pd.DataFrame, value: str, ylabel: str, title: str) -> Figure:
    _require(df, ["input_tokens", "chunked_prefill", value], title)
    fig, ax = _figure()
    chunk = df["chunked_prefill"].map(lambda c: "unchunked" if c is None or pd.isna(c) else int(c))
    order = sorted(set(chunk), key=lambda c: (c == "unchunked", c if c != "unchunked" else 0))
    for c in order:
        rows = df[chunk == c].groupby("input_tokens", as_index=False)[value].median().sort_values("input_tokens")
        ax.plot(
            rows["input_tokens"],
            rows[value],
            marker="o",
            linestyle="--" if c == "unchunked" else "-",
            color="black" if c == "unchunked" else None,
            label="unchunked" if c == "unchunked" else f"chunk {c}",
        )
    _log2_x(ax, df["input_tokens"])
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(title="chunked_prefill", fontsize="small")
    return fig


def chunked_memory(df: pd.DataFrame, *, value: str = "peak_mb", title: str | None = None) -> Figure:
    """Peak memory of one long input against its length, one line per chunk size
    (``lab.eval.bench.chunked_prefill``)."""
    return _per_chunk(df, value, "peak tensor memory (MB)", title or "Chunked prefill: peak memory vs length")


def chunked_time(df: pd.DataFrame, *, value: str = "seconds", title: str | None = None) -> Figure:
    """Seconds per long input against its length, one line per chunk size (``lab.eval.bench.chunked_prefill``)."""
    return _per_chunk(df, value, "seconds", title or "Chunked prefill: time vs length")
