"""LLM2Vec on SmolLM2-135M-Instruct: what bidirectional attention buys once the model is trained to use it.

Five variants of one decoder, all with mean pooling (LLM2Vec's choice), evaluated on STSBenchmark test through
``lab.evaluate`` (Spearman x100 of cosine similarity, MTEB's main score):

    causal base . bidirectional base . bidirectional + MNTP . bidirectional + MNTP + SimCSE . causal + SimCSE

The two SimCSE runs have the same budget (steps, batch, learning rate, data); causal + SimCSE is the control that
asks whether the gain comes from the attention or from the training. Training text: the sentences of the
STSBenchmark *train* split, scores unused, minus every sentence that also occurs in an evaluation set (STSBenchmark
test and dev, STS12/14/16, SICK-R). A layer sweep (Spearman vs layer, ``Engine(layer=k)``) follows for the causal
base and the best adapted variant. With ``--heldout`` the held-out STS sets (STS12, STS14, STS16, SICK-R; never
trained on) are scored for the causal base and the two SimCSE variants, each distinct sentence embedded once.

Writes into ``--out`` (default ``evals/results/llm2vec``): the adapters as PEFT folders ``mntp/``,
``mntp_simcse/``, ``causal_simcse/`` (each with its ``train_log.csv``, ``loss.png``, ``train_config.json``),
``results.csv`` (variant x task), ``layers.csv``, ``variants.png``, ``layers.png``, ``losses.png`` and
``README.md`` with the tables and the command. A finished adapter is reused, an interrupted one resumed, so a
re-run only does what is missing.

    python evals/llm2vec_study.py --heldout           # the whole study, then the held-out sets
    LAB_SMOKE=1 python evals/llm2vec_study.py --out /tmp/llm2vec-smoke     # a few steps, small subsets
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from evals.data_io import read_jsonl  # after the path set-up: this runs as a script

DATA = ROOT / "evals" / "data"
DEFAULT_OUT = ROOT / "evals" / "results" / "llm2vec"
SMOKE = os.environ.get("LAB_SMOKE") == "1"
# every file whose sentences are evaluated somewhere: none of them is trained on
EVAL_FILES = ("stsbenchmark/test.jsonl.gz", "stsbenchmark/validation.jsonl.gz", "sts12/test.jsonl.gz",
              "sts14/test.jsonl.gz", "sts16/test.jsonl.gz", "sickr/train.jsonl.gz", "sickr/trial.jsonl.gz",
              "sickr/test.jsonl.gz")
HELD_OUT = ("STS12", "STS14", "STS16", "SICK-R")


def _key(s: str) -> str:
    return " ".join(s.lower().split())


def training_texts() -> tuple[list[str], dict]:
    """Distinct STSBenchmark train sentences that occur in no evaluation file (compared case- and space-folded)."""
    seen = set()
    for f in EVAL_FILES:
        for r in read_jsonl(DATA / f):
            seen.update((_key(r["sentence1"]), _key(r["sentence2"])))
    rows = read_jsonl(DATA / "stsbenchmark" / "train.jsonl.gz")
    distinct = list(dict.fromkeys(s for r in rows for s in (r["sentence1"], r["sentence2"])))
    keep = [s for s in distinct if _key(s) not in seen and s.strip()]
    return keep, {"train_sentences": len(distinct), "dropped_in_eval_sets": len(distinct) - len(keep),
                  "kept": len(keep)}


# the recipe: the same SimCSE budget for both SimCSE variants
RECIPE = {
    "mntp": {"steps": 200, "batch_size": 32, "lr": 5e-4, "mask_rate": 0.2, "max_length": 64},
    "simcse": {"steps": 250, "batch_size": 32, "lr": 3e-4, "temperature": 0.05, "attention_dropout": 0.3,
               "max_length": 64},
    "lora": {"r": 8, "alpha": 16.0, "dropout": 0.05, "save_dtype": "float16"},
}
if SMOKE:
    RECIPE["mntp"]["steps"] = RECIPE["simcse"]["steps"] = 3


def variants(out: Path) -> dict[str, dict]:
    """Variant name -> knobs (mean pooling everywhere)."""
    m, ms, cs = str(out / "mntp"), str(out / "mntp_simcse"), str(out / "causal_simcse")
    return {
        "causal base": {"bidirectional": False, "adapters": ()},
        "bidirectional base": {"bidirectional": True, "adapters": ()},
        "bidirectional + MNTP": {"bidirectional": True, "adapters": (m,)},
        "bidirectional + MNTP + SimCSE": {"bidirectional": True, "adapters": (m, ms)},
        "causal + SimCSE": {"bidirectional": False, "adapters": (cs,)},
    }


def train(base: Path, out: Path, seed: int) -> dict[str, float]:
    """The three adapters (skipped when finished, resumed when interrupted); returns seconds per run."""
    from lab.adapt import LoraSpec, mntp, simcse

    texts, counts = training_texts()
    print(f"training text: {counts}", flush=True)
    lora = LoraSpec(**RECIPE["lora"])
    runs = [
        ("mntp", lambda d, r: mntp(base, texts, d, lora=lora, seed=seed, resume=r, **RECIPE["mntp"])),
        ("mntp_simcse", lambda d, r: simcse(base, texts, d, adapters=[out / "mntp"], bidirectional=True,
                                            lora=lora, seed=seed, resume=r, **RECIPE["simcse"])),
        ("causal_simcse", lambda d, r: simcse(base, texts, d, bidirectional=False, lora=lora, seed=seed,
                                              resume=r, **RECIPE["simcse"])),
    ]
    seconds = {}
    for name, run in runs:
        d = out / name
        if (d / "adapter_config.json").exists():
            print(f"{name}: finished earlier, reused", flush=True)
            continue
        t0 = time.perf_counter()
        res = run(d, (d / "checkpoint").exists())
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: {res.steps} steps ({res.dtype}) in {seconds[name]:.0f} s, final loss {res.final_loss:.3f}",
              flush=True)
    return seconds


def evaluate_variants(eng, out: Path, tasks: list[str], names: list[str], limit: int | None):
    """One row per (variant, task): Spearman x100 via ``lab.evaluate`` (no result cache: fresh numbers)."""
    import pandas as pd

    from evals.tasks import get_tasks
    from lab import evaluate

    rows = []
    for name in names:
        knobs = variants(out)[name]
        t0 = time.perf_counter()
        df = evaluate(eng, get_tasks(tasks, limit=limit), sweep={k: [v] for k, v in knobs.items()}, cache=None,
                      show_progress=False)
        for _, r in df[df.main].iterrows():
            task = re.sub(r"\.n\d+$", "", r["task"])  # a --limit run names the task "<name>.n<limit>"
            rows.append({"variant": name, "task": task, "spearman_x100": 100 * r["score"],
                         "bidirectional": knobs["bidirectional"],
                         "adapters": "+".join(Path(a).name for a in knobs["adapters"]) or "none",
                         "seconds": time.perf_counter() - t0})
            print(f"  {name:32s} {task:13s} {100 * r['score']:6.2f}", flush=True)
    return pd.DataFrame(rows)


def held_out(eng, out: Path, names: list[str], limit: int | None):
    """Spearman x100 on the held-out STS sets, each distinct sentence embedded once per variant (the same cosine
    Spearman as MTEB's STS main score, without embedding repeated sentences again)."""
    import numpy as np
    import pandas as pd

    from evals.causal_vs_bidirectional import spearman
    from evals.data_io import spread

    files = {"STS12": ["sts12/test"], "STS14": ["sts14/test"], "STS16": ["sts16/test"],
             "SICK-R": ["sickr/train", "sickr/trial", "sickr/test"]}
    sets = {}
    for task, parts in files.items():
        rows = [r for f in parts for r in read_jsonl(DATA / f"{f}.jsonl.gz")]
        sets[task] = [rows[i] for i in spread(len(rows), limit)]
    sentences = sorted({r[k] for rows in sets.values() for r in rows for k in ("sentence1", "sentence2")})
    where = {s: i for i, s in enumerate(sentences)}
    out_rows = []
    for name in names:
        knobs = variants(out)[name]
        eng.configure(**knobs)
        t0 = time.perf_counter()
        e = eng.embed(sentences, show_progress=False)
        e = e / np.linalg.norm(e, axis=1, keepdims=True).clip(1e-12)
        for task, rows in sets.items():
            a = np.array([where[r["sentence1"]] for r in rows])
            b = np.array([where[r["sentence2"]] for r in rows])
            score = 100 * spearman((e[a] * e[b]).sum(1), np.array([float(r["score"]) for r in rows]))
            out_rows.append({"variant": name, "task": task, "spearman_x100": score,
                             "bidirectional": knobs["bidirectional"],
                             "adapters": "+".join(Path(a).name for a in knobs["adapters"]) or "none",
                             "seconds": time.perf_counter() - t0})
            print(f"  {name:32s} {task:13s} {score:6.2f}", flush=True)
    return pd.DataFrame(out_rows)


def layer_sweep(eng, out: Path, names: list[str], layers: list[int], limit: int | None):
    """Spearman x100 on STSBenchmark test after each of ``layers`` (``Engine(layer=k)``: only k layers run)."""
    import numpy as np
    import pandas as pd

    from evals.causal_vs_bidirectional import load_pairs, spearman

    pairs = load_pairs(limit)
    sentences = sorted({p["sentence1"] for p in pairs} | {p["sentence2"] for p in pairs})
    where = {s: i for i, s in enumerate(sentences)}
    a = np.array([where[p["sentence1"]] for p in pairs])
    b = np.array([where[p["sentence2"]] for p in pairs])
    gold = np.array([float(p["score"]) for p in pairs])
    rows = []
    for name in names:
        for k in layers:
            eng.configure(**variants(out)[name], layer=k)
            e = eng.embed(sentences)
            e = e / np.linalg.norm(e, axis=1, keepdims=True).clip(1e-12)
            rows.append({"variant": name, "layer": k, "spearman_x100": 100 * spearman((e[a] * e[b]).sum(1), gold),
                         "seconds": eng.stats.seconds})
            print(f"  {name:32s} layer {k:2d}: {rows[-1]['spearman_x100']:6.2f}", flush=True)
    eng.configure(layer=None)
    return pd.DataFrame(rows)


def plots(results, layers, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    sts = results[results.task == "STSBenchmark"].set_index("variant")["spearman_x100"]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    colors = ["#888888" if "causal" in v else "#3b75af" for v in sts.index]
    bars = ax.barh(sts.index[::-1], sts.values[::-1], color=colors[::-1])
    ax.bar_label(bars, fmt="%.1f", padding=3)
    ax.set(xlabel="STSBenchmark test, Spearman x100 (mean pooling)", title="SmolLM2-135M-Instruct, LLM2Vec variants")
    ax.set_xlim(0, max(60, sts.max() + 8))
    fig.tight_layout()
    fig.savefig(out / "variants.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, g in layers.groupby("variant", sort=False):
        ax.plot(g["layer"], g["spearman_x100"], marker="o", label=name)
    ax.set(xlabel="layer (0 = embeddings)", ylabel="Spearman x100", title="STSBenchmark test vs layer (mean pooling)")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(out / "layers.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for name in ("mntp", "mntp_simcse", "causal_simcse"):
        f = out / name / "train_log.csv"
        if f.exists():
            log = pd.read_csv(f)
            ax.plot(log["step"], log["loss"].rolling(10, min_periods=1).mean(), label=name)
    ax.set(xlabel="step", ylabel="loss (mean of 10 steps)", title="training loss", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(out / "losses.png", dpi=120)
    plt.close(fig)


def write_readme(results, layers, out: Path, counts: dict, seconds: dict, command: str, machine: str) -> None:
    import pandas as pd

    table = results.pivot_table(index="variant", columns="task", values="spearman_x100", sort=False)
    lines = ["# LLM2Vec study: SmolLM2-135M-Instruct, mean pooling", "",
             f"Reproduce: `{command}`", "", f"Machine: {machine}", "",
             f"Training text: {counts}", "", f"Recipe: `{RECIPE}`", "",
             ("Spearman x100 (cosine vs gold): STSBenchmark through `lab.evaluate`; the held-out sets (`--heldout`) "
             "with each distinct sentence embedded once (the same cosine Spearman):"), "",
             "| variant | " + " | ".join(table.columns) + " |", "|---|" + "---:|" * len(table.columns)]
    for name, vals in table.iterrows():
        lines.append(f"| {name} | " + " | ".join("" if pd.isna(v) else f"{v:.2f}" for v in vals) + " |")
    lines += ["", "Layer sweep (STSBenchmark test):", "", "| variant | layer | Spearman x100 |", "|---|---:|---:|"]
    lines += [f"| {r.variant} | {r.layer} | {r.spearman_x100:.2f} |" for r in layers.itertuples()]
    lines += ["", ("Training time per adapter (from each `train_log.csv`: the sum of its step times, and the median "
              "step x steps, which discounts steps slowed by other work on the machine):"), "",
              "| adapter | steps | seconds (sum) | seconds (median step x steps) |", "|---|---:|---:|---:|"]
    for name in ("mntp", "mntp_simcse", "causal_simcse"):
        log = pd.read_csv(out / name / "train_log.csv")
        lines.append(f"| {name} | {len(log)} | {log.seconds.sum():.0f} | {log.seconds.median() * len(log):.0f} |")
    if seconds:
        lines += ["", "This run trained: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="base model folder (default: the cached SmolLM2-135M-Instruct)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=60 if SMOKE else None, help="evaluation pairs per task")
    ap.add_argument("--heldout", action="store_true",
                    help=f"also score {', '.join(HELD_OUT)} (causal base and the two SimCSE variants; ~20 min)")
    args = ap.parse_args(argv)

    import pandas as pd
    import torch

    from lab import Engine
    from lab.adapt.train import machine_info

    t0 = time.perf_counter()
    if args.model is None:
        from lab.models.gguf import smollm2_path

        args.model = str(smollm2_path())
    base = Path(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    seconds = train(base, args.out, args.seed)
    print(f"training done after {time.perf_counter() - t0:.0f} s", flush=True)

    eng = Engine(str(base), pooling="mean", normalize=True, dtype="float32")
    names = list(variants(args.out))
    results = evaluate_variants(eng, args.out, ["STSBenchmark"], names, args.limit)
    if args.heldout:
        held = ["causal base", "bidirectional + MNTP + SimCSE", "causal + SimCSE"]
        results = pd.concat([results, held_out(eng, args.out, held, args.limit)])
    elif (args.out / "results.csv").exists():  # keep the held-out rows of an earlier --heldout run
        earlier = pd.read_csv(args.out / "results.csv")
        results = pd.concat([results, earlier[earlier.task != "STSBenchmark"]])
    results.to_csv(args.out / "results.csv", index=False)
    sts = results[results.task == "STSBenchmark"].set_index("variant")["spearman_x100"]
    best = sts.drop(["causal base", "bidirectional base"]).idxmax()
    n = eng.model.num_layers
    step = 10 if SMOKE else 3
    layers = layer_sweep(eng, args.out, ["causal base", best], sorted(set(range(0, n + 1, step)) | {n}),
                         args.limit)
    layers.to_csv(args.out / "layers.csv", index=False)
    plots(results, layers, args.out)
    counts = training_texts()[1]
    m = machine_info()
    machine = f"{m['cpu']}, {m['cores']} cores, torch {torch.__version__}"
    command = ("python evals/llm2vec_study.py" + (" --heldout" if args.heldout else "")
               + ("" if args.out == DEFAULT_OUT else f" --out {args.out}"))
    write_readme(results, layers, args.out, counts, seconds, command, machine)
    print((args.out / "README.md").read_text())
    print(f"study done in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
