"""Command line: evaluate an Engine on mteb tasks or a whole benchmark (optionally sweeping knobs), write the table
(CSV + markdown) and a plot, and print the scores and a per-task table.

    python -m evals.run --model sentence-transformers/all-MiniLM-L6-v2 --benchmark "MTEB(eng, v2)"
    python -m evals.run --model PATH --tasks STSBenchmark SciFact --sweep pooling=mean,cls \\
        [--sweep bidirectional=false,true] [--set dtype=float32] [--limit 100] [--out evals/results/mteb]

``--model`` is a hub id (``org/name``, with ``--revision`` for a branch, tag or commit) or a local model folder (or
``.gguf`` file). ``--benchmark`` takes any name ``mteb.get_benchmark`` knows and runs its tasks as the benchmark
defines them; ``--tasks`` takes task names (the checkout's local copies first, ``evals.tasks``; ``--limit`` cuts
those to N items for smoke runs). One of the two is required.

Where the results land: mteb's ResultCache (``--cache``, default ``evals/results/cache`` or ``$LAB_MTEB_CACHE``), in
mteb's standard layout. The plain run (no ``--sweep``, no ``--set`` of a result-changing knob away from its default)
writes ``<cache>/results/<org__name>/<revision>/<Task>.json`` and ``model_meta.json`` (name, revision, parameters,
memory, embedding size, token limit, license / languages from the model card): the folder the MTEB leaderboard reads,
and ``mteb.ResultCache(<cache>).load_results(models=["org/name"])`` reads it back. Variants go to
``<cache>/results/<org__name>/<revision>/experiments/<knob values>/`` and never overwrite it. The run is resumable:
started again (after it was killed, say) it evaluates only the tasks the cache does not hold. Every result file is
written whole (``lab.eval.sweeps.result_cache_class``): a full disk or a killed run leaves the results written before
readable, a write that fails names the folder, and a result file found damaged is named and computed again. A file
in place of the ``--cache`` or ``--out`` folder is named before any work. Tasks whose data cannot be loaded
(offline, not in the datasets cache) are skipped with the reason; the others run.

Submitting to the leaderboard: the leaderboard is built from the results repository
https://github.com/embeddings-benchmark/results. Open a pull request there that adds the run's
``results/<org__name>/<revision>/`` folder (its task JSONs and ``model_meta.json``) under the repository's
``results/`` folder, or let mteb prepare it: ``mteb.ResultCache("<cache>").submit_results("org/name")``
(``create_pr=True`` opens the pull request; it needs PyGithub and a GitHub token). Only full tasks belong there:
``--limit`` runs are named ``<Task>.n<N>`` and are smoke runs, not leaderboard results; experiment folders are not
submitted.

Also writes ``<out>/<model>_<machine>.csv`` (every metric, with the run's ``run_date``), ``<out>/<model>_<machine>.md``
(main scores x100, variant x task, then the per-task table), the command in ``<csv>.meta.json`` and, when
``lab.eval.plots.scores`` exists, ``<out>/<model>_<machine>.png``, each written whole (a temporary file, then
renamed: ``evals.results_index.save_table``); ``<out>`` defaults to ``evals/results/mteb``, the
machine is the engine's device's (``evals.results_index.device_slug``: the CPU's ``lab.ops.probes.machine_slug()``
or the GPU's name). The per-task table (``lab.eval.sweeps.task_table``) has each task's main score, whether it was
computed, read from the cache or skipped (and why), and the engine's tokens/s over the task's encode calls.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "mteb"


def parse_value(text: str) -> Any:
    """``true``/``false`` -> bool, ``none`` -> None, integers and floats -> numbers, anything else a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def parse_assignment(text: str, *, many: bool) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KNOB=VALUE{'[,VALUE...]' if many else ''}, got {text!r}")
    key, values = text.split("=", 1)
    parsed = [parse_value(v) for v in values.split(",")] if many else parse_value(values)
    return key.strip(), parsed


def main_table(df) -> Any:
    """Main scores x100, one row per variant, one column per task (and split/subset when there are several)."""
    main = df[df["main"]].copy()
    main["score"] = 100 * main["score"]
    main["column"] = main["task"]
    extra = main.groupby("task")[["split", "subset"]].nunique().max(axis=1) > 1
    for task in extra[extra].index:
        rows = main["task"] == task
        main.loc[rows, "column"] = (
            main.loc[rows, "task"] + "/" + main.loc[rows, "split"] + "/" + main.loc[rows, "subset"]
        )
    table = main.pivot_table(index="variant", columns="column", values="score", sort=False)
    table.columns.name = None
    return table.round(2)


def to_markdown(table) -> str:
    header = ["variant", *map(str, table.columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for variant, row in table.iterrows():
        lines.append("| " + " | ".join([str(variant), *(f"{v:.2f}" for v in row)]) + " |")
    return "\n".join(lines) + "\n"


def tasks_view(tasks) -> Any:
    """The per-task table as printed: variant, task, status, main score x100, tokens/s, and the reason of a skip."""
    view = tasks[["variant", "task", "status"]].copy()
    view["score"] = (100 * tasks["score"].astype(float)).round(2)
    view["tokens/s"] = tasks["tokens_per_s"].astype(float).round(0)
    view["reason"] = tasks["reason"]
    return view


def tasks_markdown(view) -> str:
    lines = ["| " + " | ".join(view.columns) + " |", "|" + "---|" * len(view.columns)]
    for row in view.itertuples(index=False):
        cells = ["" if (isinstance(v, float) and math.isnan(v)) else str(v).replace("|", "/") for v in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_png(df) -> bytes | None:
    """``lab.eval.plots.scores(df)`` as PNG bytes when the plotting module exists; otherwise ``None``."""
    try:
        from lab.eval.plots import scores
    except ImportError:
        return None
    import io

    import matplotlib

    matplotlib.use("Agg")
    out = scores(df)
    fig = getattr(out, "figure", out) if not hasattr(out, "savefig") else out
    if fig is None or not hasattr(fig, "savefig"):
        import matplotlib.pyplot as plt

        fig = plt.gcf()
    png = io.BytesIO()
    fig.savefig(png, dpi=120, bbox_inches="tight", format="png")
    return png.getvalue()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evals.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="hub id (org/name) or local model folder (or .gguf file)")
    p.add_argument("--revision", default=None, help="the hub id's branch, tag or commit (default: main)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tasks", nargs="+", help="task names (local data first, then mteb's)")
    which.add_argument("--benchmark", help='an mteb benchmark name, e.g. "MTEB(eng, v2)" (mteb.get_benchmarks())')
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KNOB=V1,V2",
        type=lambda s: parse_assignment(s, many=True),
        help="knob values to sweep (repeatable)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        dest="fixed",
        type=lambda s: parse_assignment(s, many=False),
        help="fixed Engine knob (repeatable)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the CSV / markdown / plot")
    p.add_argument("--cache", default=None, help="mteb result cache folder (default evals/results/cache)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write mteb's result cache")
    p.add_argument(
        "--limit", type=int, default=None, help="evaluate only N items per local task (smoke runs; --tasks)"
    )
    p.add_argument("--overwrite", action="store_true", help="re-run even when cached results exist")
    p.add_argument(
        "--task-instructions",
        action="store_true",
        help="use each task's own instruction for queries (instruction-tuned embedders)",
    )
    return p


def main(argv: list[str] | None = None, *, engine=None):
    """Run the CLI; ``engine`` lets notebooks and tests pass an already-loaded Engine. Returns the DataFrame (its
    per-task records in ``attrs["tasks"]``, see ``lab.eval.sweeps.task_table``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.benchmark is not None and args.limit is not None:
        parser.error(
            "--limit cuts local tasks (--tasks); a --benchmark runs its tasks as the benchmark defines them. "
            "Drop --limit, or name the tasks with --tasks"
        )
    benchmark = None
    if args.benchmark is not None:
        import mteb

        try:
            benchmark = mteb.get_benchmark(args.benchmark)
        except KeyError as e:
            parser.error(
                f"--benchmark {args.benchmark!r}: {e.args[0] if e.args else e}; the names are "
                "[b.name for b in mteb.get_benchmarks()]"
            )
    from evals.tasks import get_tasks
    from lab._files import make_folder
    from lab.eval.mteb_adapter import model_name
    from lab.eval.sweeps import DEFAULT_CACHE, evaluate, resolve_cache, task_table

    make_folder(args.out, "the run's table and plot", "pass --out a folder that can be written")  # before any work
    cache = None if args.no_cache else resolve_cache(args.cache or DEFAULT_CACHE)  # its folder too
    if engine is None:
        from lab.engine import Engine

        extra = {"revision": args.revision} if args.revision else {}
        engine = Engine(str(args.model), **extra, **dict(args.fixed))
    elif args.fixed:
        engine.configure(**dict(args.fixed))
    tasks = benchmark if benchmark is not None else get_tasks(args.tasks, limit=args.limit)
    df = evaluate(
        engine,
        tasks,
        sweep=dict(args.sweep) or None,
        cache=cache,
        overwrite=args.overwrite,
        use_task_instructions=args.task_instructions,
    )
    from evals.results_index import device_slug, save_table, stamp

    stem = re.sub(r"[^\w.-]+", "_", model_name(engine).replace("/", "__"))
    stem += "_" + device_slug(str((getattr(engine, "resolved", None) or {}).get("device", "cpu")))
    csv_path, md_path, png_path = (args.out / f"{stem}{suffix}" for suffix in (".csv", ".md", ".png"))
    table = main_table(df) if df["main"].any() else None
    view = tasks_view(task_table(df))
    what = f"benchmark: {benchmark.name}" if benchmark is not None else f"tasks: {', '.join(args.tasks)}"
    header = f"# {model_name(engine)}: main scores (x100)\n\n{what}"
    if args.limit:
        header += f" (first {args.limit} items each, smoke run)"
    body = to_markdown(table) if table is not None else "no task was evaluated (see the tasks below)\n"
    png = plot_png(df) if table is not None else None
    save_table(
        csv_path, stamp(df), {md_path: header + "\n\n" + body + "\n## Tasks\n\n" + tasks_markdown(view), png_path: png}
    )
    written = [csv_path, md_path, *([png_path] if png else [])]
    if table is not None:
        print(table.to_string())
    print(view.to_string(index=False))
    skipped = int((view["status"] == "skipped").sum())
    if skipped:
        print(
            f"{skipped} of {len(view)} task runs skipped (their data could not be loaded; see reason)", file=sys.stderr
        )
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return df


if __name__ == "__main__":
    main()
