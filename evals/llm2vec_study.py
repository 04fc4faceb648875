"""LLM2Vec on SmolLM2-135M-Instruct: what bidirectional attention buys once the model is trained to use it.

Seven variants of one decoder (``VARIANTS``), scored on STSBenchmark test (Spearman x100 of cosine similarity,
MTEB's STS main score): five with mean pooling (LLM2Vec's choice)

    causal base . bidirectional base . bidirectional + MNTP . bidirectional + MNTP + SimCSE . causal + SimCSE

and the two training-free causal baselines papers put beside LLM2Vec, through the Engine's ``template`` knob: echo
embeddings (the text twice, mean over the second copy; Springer et al. 2024) and PromptEOL (the text in a one-word
prompt, the last token). Each variant's cost is recorded as tokens/s and texts/s of its embedding calls.

The two SimCSE adapters have the same budget (steps, batch, learning rate, text); causal + SimCSE is the control that
asks whether the gain comes from the attention or from the training. Training text (``training_texts``): sentences
of 20 Newsgroups *train* posts and Banking77 *train* utterances (``TEXT_MIX``), so no STS-family set is a source;
every text that also occurs in an evaluation file under ``evals/data`` is removed all the same. A layer sweep
(Spearman vs layer, ``Engine(layer=k)``) follows for the causal base and the best adapted variant. With
``--heldout`` the held-out STS sets (STS12, STS14, STS16, SICK-R) are scored too, for the variants marked
``heldout``. Each distinct sentence is embedded once per variant and layer (``Scorer``); a score whose inputs (model,
adapters, knobs, data, ``lab`` source) are unchanged since the last run is read back from ``results.csv`` /
``layers.csv`` (of ``--out`` and of the default folder) instead.

Writes into ``--out`` (default ``evals/results/llm2vec``): the adapters as PEFT folders ``mntp/``,
``mntp_simcse/``, ``causal_simcse/`` (each with its ``train_log.csv``, ``loss.png``, ``train_config.json``),
``results.csv`` (variant x task), ``layers.csv``, ``variants.png``, ``layers.png``, ``losses.png`` and
``README.md`` with the tables and the command, side by side with the same recipe trained on other text (the
``results_*.csv`` / ``layers_*.csv`` tables named in ``COMPARED``) and with the same text and recipe trained with
other seeds (``seed<N>/``, below: their gains, the mean over seeds and ``seeds.png``). A finished adapter is reused
(when its text, recipe and seed match), an interrupted one resumed, so a second call only does what is missing.

This file is the command line and the run; its parts, in ``evals/``: ``llm2vec_study_text`` (the training
text), ``llm2vec_study_recipe`` (the recipe, the adapters' training, the variants), ``llm2vec_study_scoring``
(the scores and the layer sweep), ``llm2vec_study_plots`` (the plots) and ``llm2vec_study_report`` (the
comparison and seed tables, ``seeds.png`` and ``README.md``).

    python evals/llm2vec_study.py --heldout           # the whole study, then the held-out sets
    python evals/llm2vec_study.py --heldout --variants "causal base"      # one variant (trains only what it needs)
    python evals/llm2vec_study.py --heldout --seed 1 --out evals/results/llm2vec/seed1 --sweep "causal base"
                                                      # another training seed, reported beside seed 0 by the next run
    LAB_SMOKE=1 python evals/llm2vec_study.py --out /tmp/llm2vec-smoke     # a few steps, small subsets
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# after the path set-up: this runs as a script
from evals.llm2vec_study_plots import plots
from evals.llm2vec_study_recipe import ENGINE, HELD_OUT, SETS, SMOKE, VARIANTS, train
from evals.llm2vec_study_report import COMPARED, seed_plot, seed_runs, write_readme
from evals.llm2vec_study_scoring import Scorer, evaluate_variants, layer_sweep
from evals.llm2vec_study_text import training_texts
from evals.results_index import save_file
from lab.models.hub import local_folder

DEFAULT_OUT = ROOT / "evals" / "results" / "llm2vec"


def _read_csv(path: Path):
    import pandas as pd

    return pd.read_csv(path) if path.exists() else None


def _merge(fresh, path: Path, on: list[str]):
    """``fresh`` and the rows of the table at ``path`` (read now) that ``fresh`` has no row for, on columns ``on``;
    rows of variants no longer in ``VARIANTS`` are dropped."""
    import pandas as pd

    now = _read_csv(path)
    if now is None or "key" not in now:
        return fresh
    done = set(map(tuple, fresh[on].to_numpy().tolist()))
    keep = [tuple(r) not in done and r[0] in VARIANTS for r in now[on].to_numpy().tolist()]
    return pd.concat([fresh, now[keep]], ignore_index=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default=None,
        help="base model folder or hub id (org/name[@revision]; default: the cached SmolLM2-135M-Instruct)",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=60 if SMOKE else None, help="evaluation pairs per task")
    ap.add_argument(
        "--heldout",
        action="store_true",
        help=f"also score {', '.join(HELD_OUT)} for the variants marked heldout in VARIANTS",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=None,
        choices=list(VARIANTS),
        metavar="NAME",
        help="score only these variants (and train only the adapters they need), keeping the other "
        "rows of results.csv and layers.csv; default: all, and the tables hold only them",
    )
    ap.add_argument(
        "--sweep",
        nargs="*",
        default=None,
        choices=list(VARIANTS),
        metavar="NAME",
        help="variants of the layer sweep (default: the causal base and the best adapted variant on "
        "STSBenchmark, those of them scored now); --sweep alone skips the sweep",
    )
    args = ap.parse_args(argv)

    import pandas as pd
    import torch

    from lab import Engine
    from lab.adapt.run_files import machine_info

    t0 = time.perf_counter()
    if args.model is None:
        from lab.models.gguf import smollm2_path

        args.model = str(smollm2_path())
    base = Path(local_folder(args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.variants or list(VARIANTS)
    text = training_texts()  # the adapters' text, and its counts for the README
    seconds = train(base, args.out, args.seed, {a for n in names for a in VARIANTS[n]["adapters"]}, text)
    print(f"training done after {time.perf_counter() - t0:.0f} s", flush=True)

    eng = Engine(str(base), **ENGINE)
    # scores are keyed by everything they depend on, so the study folder's also serve another folder (another seed)
    tables = [f / n for f in dict.fromkeys([args.out.resolve(), DEFAULT_OUT]) for n in ("results.csv", "layers.csv")]
    keyed = [d for d in map(_read_csv, tables) if d is not None and "key" in d]
    scorer = Scorer(eng, base, args.limit, pd.concat(keyed) if keyed else None)
    results = evaluate_variants(scorer, args.out, names, args.heldout)
    if args.variants:  # keep the other rows of the file as it is now (another call may have written it meanwhile)
        results = _merge(results, args.out / "results.csv", ["variant", "task"])
    order = {n: i for i, n in enumerate(VARIANTS)}
    tasks = {t: i for i, t in enumerate(SETS)}
    results = results.sort_values(["variant", "task"], key=lambda s: s.map(order if s.name == "variant" else tasks))
    save_file(args.out / "results.csv", results)

    sweep = args.sweep
    if sweep is None:
        sts = results[results.task == "STSBenchmark"].set_index("variant")["spearman_x100"]
        adapted = sts.drop([n for n in sts.index if not VARIANTS[n]["adapters"]])
        sweep = [n for n in ("causal base", *([adapted.idxmax()] if len(adapted) else [])) if n in names]
    n = eng.model.num_layers
    step = 10 if SMOKE else 3
    layers = layer_sweep(scorer, args.out, sweep, sorted(set(range(0, n + 1, step)) | {n}))
    if args.variants:
        layers = _merge(layers, args.out / "layers.csv", ["variant", "layer"])
        layers = layers.sort_values(["variant", "layer"], key=lambda s: s.map(order) if s.name == "variant" else s)
    save_file(args.out / "layers.csv", layers)

    compared = {}
    for label, (res, lay, _) in COMPARED.items():
        if (df := _read_csv(args.out / res)) is not None:
            if lay and (args.out / lay).exists():
                df.attrs["layers"] = pd.read_csv(args.out / lay)
            compared[label] = df
    plots(results, layers, args.out, compared)
    runs = seed_runs(args.out, args.seed, results)
    if len(runs) > 1:
        seed_plot(runs, args.out)
    counts = text[1]
    m = machine_info()
    machine = f"{m['cpu']}, {m['cores']} cores, torch {torch.__version__}"
    out = args.out.resolve()
    command = (
        "python evals/llm2vec_study.py"
        + (" --heldout" if args.heldout else "")
        + (f" --seed {args.seed}" if args.seed else "")
        + ("" if out == DEFAULT_OUT else f" --out {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
        + ("" if args.sweep is None else " --sweep" + "".join(f' "{n}"' for n in args.sweep))
    )
    write_readme(results, layers, args.out, counts, seconds, command, machine, compared, args.seed, runs)
    print((args.out / "README.md").read_text())
    print(f"study done in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
