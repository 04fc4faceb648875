"""The LLM2Vec study's report (``evals/llm2vec_study.py``): the earlier training texts it is set beside
(``COMPARED``), its targets (``TARGETS``), the Markdown tables of scores and gains per training text
(``comparison_lines``) and per training seed (``seed_runs``, ``seed_lines``, drawn by ``seed_plot``), and the study
folder's ``README.md`` (``write_readme``)."""

from __future__ import annotations

import re
from pathlib import Path

from evals.llm2vec_study_recipe import ADAPTERS, RECIPE, VARIANTS
from evals.llm2vec_study_text import SENTENCE_CHARS, SENTENCE_WORDS, TEXT_MIX, TEXT_SEED, TRAIN_SOURCES, mix_label
from evals.results_index import save_file

# the same recipe and seed trained on other text, kept for comparison: label -> (results table, layer-sweep table or
# None, what the text was), in the output folder: the ``results.csv`` / ``layers.csv`` this script wrote when that
# text was ``TEXT_MIX`` (for 20NG 4,000 + Banking77 2,500, the scores its run printed). Every text but
# ``STSB_TEXT`` is a clean mix of ``TRAIN_SOURCES``.
STSB_TEXT = "STSB-train text"
COMPARED = {
    STSB_TEXT: (
        "results_stsb_train_text.csv",
        "layers_stsb_train_text.csv",
        (
            "the 4,783 distinct sentences of STSBenchmark *train* that occur in no STS evaluation file (scores "
            "unused). STSBenchmark is built from STS 2012-2016 sentences, so that text shares sources (and "
            "near-duplicates) with STS12/14/16 in a way no exact-match filter removes; the 20NG and Banking77 text "
            "shares none by construction"
        ),
    ),
    mix_label({"twentynewsgroups": 5000}): (
        "results_20ng_5000.csv",
        None,
        "drawn as above, 20NG sentences only (no Banking77); its layer sweep was not run",
    ),
    mix_label({"twentynewsgroups": 4000, "banking77": 2500}): (
        "results_20ng_4000_banking77_2500.csv",
        None,
        (
            "drawn as above; the scores as that run printed them (two decimals): it stopped before the PromptEOL rows "
            "and the layer sweep"
        ),
    ),
}


def _fmt(v) -> str:
    import pandas as pd

    return "" if v is None or pd.isna(v) else f"{v:.2f}"


# what the study aims for: bidirectional + MNTP + SimCSE over the causal base, in Spearman points
TARGETS = {"STSBenchmark": 20.0, "STS12": 10.0, "STS14": 10.0, "STS16": 10.0, "SICK-R": 10.0}
TARGET_VARIANT = "bidirectional + MNTP + SimCSE"
CONTROL = "causal + SimCSE"  # the same SimCSE budget with causal attention


def _pivot(results):
    """Variant x task table of Spearman x100, in the order the rows come."""
    return results.pivot_table(index="variant", columns="task", values="spearman_x100", sort=False)


def _verdict(task: str, gain: float) -> str:
    """``STS12 +10.34 (target +10: met)``: a gain of ``TARGET_VARIANT`` against the task's target."""
    return f"{task} {gain:+.2f} (target +{TARGETS[task]:.0f}: {'met' if gain >= TARGETS[task] else 'short'})"


def comparison_lines(results, compared: dict | None = None) -> list[str]:
    """Markdown: the scores per training text (each earlier text of ``compared``, label -> its results table, then
    ``TEXT_MIX``; a variant without adapters once: it is not trained), the gains over the causal base, the targets
    per text, and the best variant per task with its margin over the next."""
    import pandas as pd

    compared = compared or {}
    current = mix_label(TEXT_MIX)
    tasks = list(dict.fromkeys(results.task))

    new = _pivot(results)
    tables = {**{label: _pivot(df) for label, df in compared.items()}, current: new}

    def get(table, variant, task):
        ok = table is not None and variant in table.index and task in table.columns
        return None if not ok or pd.isna(table.loc[variant, task]) else float(table.loc[variant, task])

    def rows(value, fmt=_fmt):
        out = []
        for v in new.index:
            trained = bool(VARIANTS.get(v, {}).get("adapters"))
            for label, t in tables.items() if trained else (("none (not trained)", new),):
                vals = [value(t, v, k) for k in tasks]
                if any(x is not None for x in vals):
                    out.append(f"| {v} | {label} | " + " | ".join(fmt(x) for x in vals) + " |")
        return out

    head = ["| variant | training text | " + " | ".join(tasks) + " |", "|---|---|" + "---:|" * len(tasks)]
    lines = [*head, *rows(get)]
    diffs = [
        abs(get(old, v, k) - get(new, v, k))
        for old in tables.values()
        if old is not new
        for v in new.index
        if not VARIANTS.get(v, {}).get("adapters")
        for k in tasks
        if get(old, v, k) is not None and get(new, v, k) is not None
    ]
    if diffs:
        files = ", ".join(f"`{COMPARED[label][0]}`" if label in COMPARED else label for label in compared)
        lines += [
            "",
            (
                f"The untrained variants, scored here and in {files}: largest difference {max(diffs):.4f} "
                f"points over {len(diffs)} scores."
            ),
        ]

    def gain(t, v, k):
        a, b = get(t, v, k), get(t, "causal base", k)
        return None if a is None or b is None else a - b

    lines += [
        "",
        "Gain over the causal base, Spearman points:",
        "",
        *head,
        *[r for r in rows(gain, lambda x: "" if x is None else f"{x:+.2f}") if not r.startswith("| causal base |")],
    ]
    lines += ["", f"Targets ({TARGET_VARIANT} over the causal base):", ""]
    for label, t in tables.items():
        parts = [_verdict(k, g) for k in tasks if k in TARGETS and (g := gain(t, TARGET_VARIANT, k)) is not None]
        if parts:
            lines.append(f"- {label}: " + ", ".join(parts))
    lines += ["", f"Best variant per task ({current}), and its margin over the next best:", ""]
    for task in tasks:
        col = new[task].dropna().sort_values(ascending=False)
        if len(col) > 1:
            lines.append(
                f"- {task}: {col.index[0]} {col.iloc[0]:.2f}, {col.iloc[0] - col.iloc[1]:+.2f} over "
                f"{col.index[1]} ({col.iloc[1]:.2f})"
            )
    return lines


# other training seeds of the same text and recipe: a run with ``--seed N --out <study folder>/seed<N>`` leaves its
# tables in that subfolder (git keeps its tables, logs and README, not its adapter weights: ``.gitignore``)
_SEED_DIR = re.compile(r"seed(\d+)")


def seed_runs(out: Path, seed: int, results) -> dict:
    """Training seed -> results table: ``results`` (this run's, trained with ``seed``) and the ``results.csv`` of each
    ``seed<N>/`` subfolder of ``out`` (another seed), in seed order."""
    import pandas as pd

    runs = {seed: results}
    for d in out.iterdir():
        if (m := _SEED_DIR.fullmatch(d.name)) and (d / "results.csv").exists() and int(m.group(1)) != seed:
            runs[int(m.group(1))] = pd.read_csv(d / "results.csv")
    return dict(sorted(runs.items()))


def _gains(runs: dict):
    """(seed, variant) x task table of the gains over the causal base (Spearman points) of the trained variants,
    from ``runs`` (seed -> results table)."""
    import pandas as pd

    def one(results):
        t = _pivot(results)
        trained = [v for v in t.index if VARIANTS.get(v, {}).get("adapters")]
        return t.loc[trained] - t.loc["causal base"] if "causal base" in t.index else t.loc[[]]

    return pd.concat({s: one(r) for s, r in runs.items()}, names=["seed", "variant"])


def seed_lines(runs: dict) -> list[str]:
    """Markdown: each trained variant's gain over the causal base per training seed (``runs``: seed -> results
    table), their mean and spread (max - min), and the targets on the mean. Empty for a single seed."""
    import pandas as pd

    if len(runs) < 2:
        return []
    stacked = _gains(runs)
    gains = {s: g.droplevel("seed") for s, g in stacked.groupby(level="seed", sort=False)}
    tasks = list(stacked.columns)
    variants_ = list(dict.fromkeys(stacked.index.get_level_values("variant")))
    mean = stacked.groupby(level="variant", sort=False).mean()
    spread = stacked.groupby(level="variant", sort=False).agg(lambda x: x.max() - x.min())
    seeds = ", ".join(map(str, runs))

    def row(v, label, vals):
        return f"| {v} | {label} | " + " | ".join("" if pd.isna(x) else f"{x:+.2f}" for x in vals) + " |"

    lines = [
        "## Across training seeds",
        "",
        (
            f"The same text and recipe trained with seeds {seeds} (LoRA initialisation, masks, dropout and batch "
            f"order; the text is drawn with seed {TEXT_SEED} in every run). Gain over the causal base, Spearman "
            f"points, per seed, their mean and their spread (max - min):"
        ),
        "",
        "| variant | seed | " + " | ".join(tasks) + " |",
        "|---|---|" + "---:|" * len(tasks),
    ]
    for v in variants_:
        lines += [row(v, str(s), g.reindex(columns=tasks).loc[v]) for s, g in gains.items() if v in g.index]
        lines += [
            row(v, f"mean of {len(runs)}", mean.loc[v]),
            f"| {v} | spread | " + " | ".join("" if pd.isna(x) else f"{x:.2f}" for x in spread.loc[v]) + " |",
        ]
    if TARGET_VARIANT in mean.index:
        parts = [_verdict(k, g) for k in tasks if k in TARGETS and not pd.isna(g := mean.loc[TARGET_VARIANT, k])]
        lines += [
            "",
            f"Targets on the mean of {len(runs)} seeds ({TARGET_VARIANT} over the causal base): " + ", ".join(parts),
        ]
        each = []
        for s in runs:  # a seed is judged only on what it scored: a set it did not score is named, not passed
            g = gains.get(s)
            scored = {
                k: g.loc[TARGET_VARIANT, k]
                for k in TARGETS
                if g is not None
                and TARGET_VARIANT in g.index
                and k in g.columns
                and not pd.isna(g.loc[TARGET_VARIANT, k])
            }
            short = [f"{k} {x:+.2f}" for k, x in scored.items() if x < TARGETS[k]]
            missing = [k for k in TARGETS if k not in scored]
            said = [
                f"{what} on {', '.join(tasks_)}"
                for what, tasks_ in (("short", short), ("not scored", missing))
                if tasks_
            ]
            each.append(f"seed {s} " + (" and ".join(said) if said else "meets every target"))
        lines += ["", "Each seed on its own: " + "; ".join(each) + "."]
    if {TARGET_VARIANT, CONTROL} <= set(mean.index):
        over = stacked.xs(TARGET_VARIANT, level="variant") - stacked.xs(CONTROL, level="variant")
        parts = [
            f"{k} " + " / ".join(f"{x:+.2f}" for x in over[k]) + f" (mean {over[k].mean():+.2f})"
            for k in tasks
            if over[k].notna().all()
        ]
        lines += [
            "",
            f"{TARGET_VARIANT} over {CONTROL} (the same SimCSE budget, causal attention), seed "
            + " / ".join(map(str, over.index))
            + ": "
            + ", ".join(parts),
        ]
    return lines


def seed_plot(runs: dict, out: Path) -> None:
    """``seeds.png``: per task, the gain over the causal base of ``TARGET_VARIANT`` and ``CONTROL`` (one dot per seed,
    a bar for the mean) and the target (a black dash). Nothing is drawn when ``runs`` holds neither variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stacked = _gains(runs)
    shown = [v for v in (TARGET_VARIANT, CONTROL) if v in stacked.index.get_level_values("variant")]
    if not shown:
        return
    tasks = [t for t in stacked.columns if stacked[t].notna().any()]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    width = 0.8 / len(shown)
    for i, (v, colour) in enumerate(zip(shown, ("#3b75af", "#999999"))):
        x = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(tasks))]
        per_seed = stacked.xs(v, level="variant").reindex(columns=tasks)
        ax.bar(
            x,
            per_seed.mean(),
            width=width * 0.9,
            color=colour,
            alpha=0.55,
            label=f"{v}, mean of {len(per_seed)} seeds",
        )
        for _, g in per_seed.iterrows():
            ax.plot(x, g, "o", color=colour, markersize=4, markeredgecolor="black", markeredgewidth=0.4)
    for j, t in enumerate(t for t in tasks if t in TARGETS):
        ax.hlines(
            TARGETS[t],
            tasks.index(t) - 0.45,
            tasks.index(t) + 0.45,
            colors="black",
            linestyles="--",
            linewidth=1,
            label="target" if j == 0 else None,
        )
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set(
        ylabel="gain over the causal base, Spearman points",
        title=f"Across training seeds {', '.join(map(str, runs))} (dots: one seed each)",
    )
    ax.axhline(0, color="black", linewidth=0.5)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(frameon=False, fontsize=7)
    fig.tight_layout()
    save_file(out / "seeds.png", fig)
    plt.close(fig)


def write_readme(
    results,
    layers,
    out: Path,
    counts: dict,
    seconds: dict,
    command: str,
    machine: str,
    compared: dict | None = None,
    seed: int = 0,
    runs: dict | None = None,
) -> None:
    """``README.md`` in ``out``: the training text, the recipe and ``seed``, the scores and gains beside each earlier
    text of ``compared`` (``comparison_lines``) and each other seed of ``runs`` (``seed_lines``), the cost per
    variant, the layer sweep and the training time per adapter."""
    import pandas as pd

    compared = compared or {}
    current = mix_label(TEXT_MIX)
    source = {
        "twentynewsgroups": (
            f"sentences of 20 Newsgroups *train* posts "
            f"(`evals/data/{TRAIN_SOURCES['twentynewsgroups']}`, split by `post_sentences`: "
            f"quotes, attributions, header-like lines, tables and signatures dropped; "
            f"{SENTENCE_WORDS[0]}-{SENTENCE_WORDS[1]} words, {SENTENCE_CHARS[0]}-"
            f"{SENTENCE_CHARS[1]} characters; no URL or e-mail address)"
        ),
        "banking77": f"Banking77 *train* utterances (`evals/data/{TRAIN_SOURCES['banking77']}`)",
    }
    lines = [
        "# LLM2Vec study: SmolLM2-135M-Instruct, mean pooling",
        "",
        f"Reproduce: `{command}`",
        "",
        f"Machine: {machine}",
        "",
        "## Training text",
        "",
        (
            f"`training_texts()` in `evals/llm2vec_study_text.py` ({current}): "
            + " and ".join(f"{n:,} {source[k]}" for k, n in TEXT_MIX.items() if n)
            + f", drawn with seed {TEXT_SEED}. No STS-family set is a source. Every text that also occurs in an "
            f"evaluation file (all of `evals/data` but the training sources, 20NG train and Banking77 train: every "
            f"STSBenchmark split, STS12/14/16, SICK-R, the test files of Banking77, TwentyNewsgroups and "
            f"TwitterURLCorpus, SciFact's corpus and queries; each field and each sentence of it, compared case- "
            f"and space-folded) is removed before the draw."
        ),
        "",
        "Counts: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()),
        "",
    ]
    if compared:
        lines += ["Compared with the same recipe and seed trained on other text (their tables in this folder):", ""]
        for label in compared:
            res, lay, what = COMPARED[label]
            files = ", ".join(f"`{f}`" for f in (res, lay) if f)
            lines.append(f"- {label} ({files}): {what}.")
        tries = 1 + sum(label != STSB_TEXT for label in compared)
        lines += [
            "",
            (
                f"The {tries} clean mixes were compared on the held-out scores below and this study's text "
                f"({current}) chosen among them, so its held-out numbers are the pick of {tries} tries, not a "
                "fresh test."
            ),
            "",
        ]
    lines += [
        f"Recipe: `{RECIPE}`; training seed {seed}.",
        "",
        "## Scores",
        "",
        (
            "Spearman x100 of cosine similarity vs gold (MTEB's STS main score), each distinct sentence embedded "
            "once; STSBenchmark = its test split, SICK-R = all 9,927 pairs:"
        ),
        "",
    ]
    lines += comparison_lines(results, compared)
    if across := seed_lines(runs or {}):
        lines += ["", *across, "", "`seeds.png` draws these gains."]
    lines += [
        "",
        "## Cost",
        "",
        (
            "Each variant's embedding call over the distinct sentences it scores (STSBenchmark "
            "test, and the held-out sets where scored), on the machine above; echo runs each text twice, PromptEOL "
            "wraps it in its prompt:"
        ),
        "",
        "| variant | sets | texts | tokens | seconds | tokens/s | texts/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, g in results.groupby("variant", sort=False):
        r = g.iloc[0]
        if "tokens" in g and not pd.isna(r.get("tokens")):
            lines.append(
                f"| {name} | {', '.join(g.task)} | {r.texts:,.0f} | {r.tokens:,.0f} | {r.seconds:.1f} | "
                f"{r.tokens / r.seconds:,.0f} | {r.texts / r.seconds:,.0f} |"
            )
    swept = {
        label: {(r.variant, r.layer): r.spearman_x100 for r in df.attrs["layers"].itertuples()}
        for label, df in compared.items()
        if "layers" in df.attrs
    }
    lines += [
        "",
        "## Layer sweep (STSBenchmark test)",
        "",
        "| variant | layer | " + " | ".join([*swept, current]) + " |",
        "|---|---:|" + "---:|" * (len(swept) + 1),
    ]
    lines += [
        f"| {r.variant} | {r.layer} | "
        + "".join(f"{_fmt(old.get((r.variant, r.layer)))} | " for old in swept.values())
        + f"{r.spearman_x100:.2f} |"
        for r in layers.itertuples()
    ]
    lines += [
        "",
        (
            "Training time per adapter (from each `train_log.csv`: the sum of its step times, and the median "
            "step x steps, which discounts steps slowed by other work on the machine; both depend on that load "
            "and on the torch threads, which each `train_config.json` records under `machine`):"
        ),
        "",
        "| adapter | steps | seconds (sum) | seconds (median step x steps) |",
        "|---|---:|---:|---:|",
    ]
    for name in ADAPTERS:
        f = out / name / "train_log.csv"
        if f.exists():
            log = pd.read_csv(f)
            lines.append(f"| {name} | {len(log)} | {log.seconds.sum():.0f} | {log.seconds.median() * len(log):.0f} |")
    if seconds:
        lines += ["", "Trained by this command: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())]
    save_file(out / "README.md", "\n".join(lines) + "\n")
