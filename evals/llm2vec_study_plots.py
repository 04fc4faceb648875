"""The LLM2Vec study's plots of one run (``evals/llm2vec_study.py``), by ``plots``: ``variants.png`` (STSBenchmark
per variant and training text), ``layers.png`` (the layer sweep) and ``losses.png`` (the adapters' training loss)."""

from __future__ import annotations

from pathlib import Path

from evals.llm2vec_study_recipe import ADAPTERS, VARIANTS
from evals.llm2vec_study_text import TEXT_MIX, mix_label
from evals.results_index import save_file

# the colours of the earlier training texts in the plots (the current text is blue)
_EARLIER_COLOURS = ("#bbbbbb", "#e0b07a", "#a8cfa0", "#c9a9d6")


def plots(results, layers, out: Path, compared: dict | None = None) -> None:
    """``variants.png`` (STSBenchmark per variant; a trained variant also with each earlier text of ``compared``,
    label -> its results table with the layer sweep in ``attrs["layers"]``), ``layers.png`` and ``losses.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt
    import pandas as pd

    compared = compared or {}
    current = mix_label(TEXT_MIX)
    sts = results[results.task == "STSBenchmark"].set_index("variant")["spearman_x100"]
    names = list(sts.index)[::-1]
    trained = {n: bool(VARIANTS.get(n, {}).get("adapters")) for n in names}
    series = [
        (
            label,
            _EARLIER_COLOURS[i % len(_EARLIER_COLOURS)],
            df[df.task == "STSBenchmark"].set_index("variant")["spearman_x100"],
        )
        for i, (label, df) in enumerate(compared.items())
    ]
    series.append((f"{current} (untrained variants: the base)", "#3b75af", sts))
    height = 0.84 / len(series)
    fig, ax = plt.subplots(figsize=(10.5, 1.8 + 0.2 * sum(1 + (len(series) - 1) * trained[n] for n in names)))
    for y, n in enumerate(names):  # the bars a variant has (every text for a trained one), centred on its row
        bars = [
            (score[n], colour)
            for i, (_, colour, score) in enumerate(series)
            if n in score.index and (i == len(series) - 1 or trained[n])
        ]
        for j, (v, colour) in enumerate(bars):
            b = ax.barh(y + (len(bars) - 1 - 2 * j) * height / 2, v, height=height, color=colour)
            ax.bar_label(b, fmt="%.1f", padding=3, fontsize=7)
    ax.set_yticks(range(len(names)), names)
    ax.set(xlabel="STSBenchmark test, Spearman x100 (PromptEOL: last token; else mean)")
    ax.set_title("SmolLM2-135M-Instruct: LLM2Vec variants by training text; causal baselines", fontsize=10)
    ax.set_xlim(0, max(60, sts.max() + 10))
    ax.legend(
        handles=[matplotlib.patches.Patch(color=c, label=label) for label, c, _ in series],
        frameon=False,
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize=7,
        title="training text",
        title_fontsize=7,
    )
    fig.tight_layout()
    save_file(out / "variants.png", fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (name, g) in enumerate(layers.groupby("variant", sort=False)):
        adapted = bool(VARIANTS.get(name, {}).get("adapters"))
        ax.plot(
            g["layer"],
            g["spearman_x100"],
            marker="o",
            color=("#333333", "#3b75af", "#c0392b", "#7d3c98")[i % 4],
            label=f"{name} ({current})" if adapted else name,
        )
    for i, (label, df) in enumerate(compared.items()):
        for name, g in df.attrs.get("layers", pd.DataFrame(columns=["variant"])).groupby("variant", sort=False):
            if VARIANTS.get(name, {}).get("adapters"):  # the base model does not depend on the training text
                ax.plot(
                    g["layer"],
                    g["spearman_x100"],
                    marker=".",
                    ls="--",
                    color=_EARLIER_COLOURS[i % len(_EARLIER_COLOURS)],
                    label=f"{name} ({label})",
                )
    ax.set(xlabel="layer (0 = embeddings)", ylabel="Spearman x100", title="STSBenchmark test vs layer (mean pooling)")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=7)
    fig.tight_layout()
    save_file(out / "layers.png", fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for name in ADAPTERS:
        f = out / name / "train_log.csv"
        if f.exists():
            log = pd.read_csv(f)
            ax.plot(log["step"], log["loss"].rolling(10, min_periods=1).mean(), label=name)
    ax.set(xlabel="step", ylabel="loss (mean of 10 steps)", title="training loss", yscale="log")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(frameon=False)
    fig.tight_layout()
    save_file(out / "losses.png", fig)
    plt.close(fig)
