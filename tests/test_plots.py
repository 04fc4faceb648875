"""lab.eval.plots: every function returns a matplotlib Figure from a small tidy table, without pyplot state."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import io

import numpy as np
import pandas as pd
import pytest
from matplotlib import pyplot as plt
from matplotlib.figure import Figure

from lab.eval import plots


def _throughput_table(with_length: bool = False) -> pd.DataFrame:
    """The shape of lab.eval.bench.throughput's table: an engine swept over budgets and dtypes, plus a baseline."""
    rows = []
    for length in [16, 128] if with_length else [None]:
        for dtype in ("float32", "bfloat16"):
            for budget in (512, 2048, 16384):
                secs = 0.1 * (1 + 1000 / budget) * (1.5 if dtype == "bfloat16" else 1)
                rows.append(
                    {
                        "system": "engine",
                        "max_batch_tokens": budget,
                        "dtype": dtype,
                        "texts": 64,
                        "tokens": 2000,
                        "padded_tokens": 0,
                        "seconds_median": secs,
                        "seconds_min": secs * 0.9,
                        "seconds_max": secs * 1.1,
                        "tokens_per_s": 2000 / secs,
                        "length": length,
                    }
                )
        rows.append(
            {
                "system": "sentence-transformers",
                "max_batch_tokens": None,
                "dtype": None,
                "texts": 64,
                "tokens": 2000,
                "padded_tokens": 700,
                "seconds_median": 0.3,
                "seconds_min": 0.28,
                "seconds_max": 0.33,
                "tokens_per_s": 2000 / 0.3,
                "length": length,
            }
        )
    df = pd.DataFrame(rows)
    return df if with_length else df.drop(columns="length")


def _check(fig) -> None:
    assert isinstance(fig, Figure)
    assert fig.axes, "the figure has no axes"
    buf = io.BytesIO()
    fig.savefig(buf, format="png")  # renders under Agg
    assert buf.getvalue()[:4] == b"\x89PNG"


@pytest.fixture(autouse=True)
def _no_pyplot_figures():
    before = plt.get_fignums()
    yield
    assert plt.get_fignums() == before, "a plot function left a pyplot figure open"


def test_tokens_per_s_vs_budget():
    df = _throughput_table()
    fig = plots.tokens_per_s_vs_budget(df, roofline=30000)
    _check(fig)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "engine (dtype=float32)" in labels and "sentence-transformers" in labels and "GEMM roofline" in labels


def test_tokens_per_s_vs_length():
    _check(plots.tokens_per_s_vs_length(_throughput_table(with_length=True)))


@pytest.mark.parametrize("with_length", [False, True])
def test_padding_waste(with_length):
    df = _throughput_table(with_length).query("dtype != 'bfloat16'")
    fig = plots.padding_waste(df)
    _check(fig)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "35% pad" in texts and "0% pad" in texts


def test_scores_from_an_evaluate_table():
    rows = []
    for variant, s in (("pooling=mean", 0.82), ("pooling=cls", 0.77)):
        for task in ("STSBenchmark", "SICK-R"):
            rows.append(
                {
                    "model": "m",
                    "variant": variant,
                    "pooling": variant.split("=")[1],
                    "task": task,
                    "split": "test",
                    "subset": "default",
                    "metric": "cosine_spearman",
                    "score": s,
                    "main": True,
                }
            )
            rows.append({**rows[-1], "metric": "cosine_pearson", "score": s - 0.01, "main": False})
    df = pd.DataFrame(rows)
    fig = plots.scores(df)
    _check(fig)
    assert len(fig.axes[0].patches) == 4  # 2 tasks x 2 variants, main rows only
    _check(plots.scores(df, metric="cosine_pearson", split="test"))
    with pytest.raises(ValueError, match="no rows"):
        plots.scores(df, metric="nope")
    # an undefined score (mteb gives NaN when every embedding is equal, e.g. CLS under causal attention)
    df.loc[(df.variant == "pooling=cls") & (df.task == "SICK-R") & df.main, "score"] = np.nan
    fig = plots.scores(df)
    _check(fig)
    assert "n/a" in [t.get_text() for t in fig.axes[0].texts]


def test_similarity_heatmap():
    rng = np.random.default_rng(0)
    e = rng.normal(size=(5, 8))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    labels = ["short", "a much longer sentence that goes well past the label limit", "c", "d", "e"]
    fig = plots.similarity_heatmap(e @ e.T, labels)
    _check(fig)
    assert len(fig.axes[0].texts) == 25
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks[0] == "[0] short" and ticks[1].startswith("[1] a much") and ticks[1].endswith("…")
    _check(plots.similarity_heatmap(e[:2] @ e.T))  # rectangular, no labels
    with pytest.raises(ValueError, match="2-D"):
        plots.similarity_heatmap(np.ones(3))


def test_chunked_memory_and_time():
    rows = [
        {
            "text": i,
            "input_tokens": n,
            "chunked_prefill": c,
            "seconds": n / 1000,
            "peak_mb": n / (c or n) + 1,
            "max_abs_diff": 0.0,
            "cosine": 1.0,
        }
        for i, n in enumerate([256, 512, 1024])
        for c in (None, 64, 256)
    ]
    df = pd.DataFrame(rows)
    fig = plots.chunked_memory(df)
    _check(fig)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["chunk 64", "chunk 256", "unchunked"]
    _check(plots.chunked_time(df))


def test_grouped_bars():
    df = pd.DataFrame(
        {
            "pooling": ["mean", "mean", "cls", "cls"],
            "attention": ["causal", "bidirectional"] * 2,
            "spearman": [0.5, 0.6, 0.3, 0.4],
        }
    )
    fig = plots.grouped_bars(df, x="pooling", hue="attention", value="spearman")
    _check(fig)
    assert len(fig.axes[0].patches) == 4


def test_missing_columns_are_named():
    with pytest.raises(ValueError, match="tokens_per_s"):
        plots.tokens_per_s_vs_budget(pd.DataFrame({"system": ["a"], "max_batch_tokens": [1]}))
    with pytest.raises(ValueError, match="empty"):
        plots.padding_waste(pd.DataFrame(columns=["system", "tokens", "padded_tokens"]))
