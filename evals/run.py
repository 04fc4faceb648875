"""Command line: sweep an Engine's knobs over mteb tasks, write the table (CSV + markdown) and a plot.

    python -m evals.run --model PATH --tasks STSBenchmark SciFact --sweep pooling=mean,cls \\
        [--sweep bidirectional=false,true] [--set dtype=float32] [--limit 100] [--out evals/results/mteb]

Writes ``<out>/<model>_<machine>.csv`` (every metric, with the run's ``run_date``), ``<out>/<model>_<machine>.md``
(main scores x100, variant x task), the command in ``<csv>.meta.json`` and, when ``lab.eval.plots.scores`` exists,
``<out>/<model>_<machine>.png``; ``<out>`` defaults to ``evals/results/mteb``, the machine is the engine's device's
(``evals.results_index.device_slug``: the CPU's ``lab.ops.probes.machine_slug()`` or the GPU's name). Results are cached by mteb (``--cache``, default
``evals/results/cache`` or ``$LAB_MTEB_CACHE``), so a rerun only evaluates what is missing.
"""

from __future__ import annotations

import argparse
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


def save_plot(df, path: Path) -> Path | None:
    """``lab.eval.plots.scores(df)`` saved as PNG when the plotting module exists; otherwise nothing."""
    try:
        from lab.eval.plots import scores
    except ImportError:
        return None
    import matplotlib

    matplotlib.use("Agg")
    out = scores(df)
    fig = getattr(out, "figure", out) if not hasattr(out, "savefig") else out
    if fig is None or not hasattr(fig, "savefig"):
        import matplotlib.pyplot as plt

        fig = plt.gcf()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evals.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local model folder (or .gguf file)")
    p.add_argument("--tasks", nargs="+", required=True, help="task names (local data first, then mteb's)")
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
    p.add_argument("--limit", type=int, default=None, help="evaluate only N items per local task (smoke runs)")
    p.add_argument("--overwrite", action="store_true", help="re-run even when cached results exist")
    p.add_argument(
        "--task-instructions",
        action="store_true",
        help="use each task's own instruction for queries (instruction-tuned embedders)",
    )
    return p


def main(argv: list[str] | None = None, *, engine=None):
    """Run the CLI; ``engine`` lets notebooks and tests pass an already-loaded Engine. Returns the DataFrame."""
    args = build_parser().parse_args(argv)
    from evals.tasks import get_tasks
    from lab.eval.mteb_adapter import model_name
    from lab.eval.sweeps import DEFAULT_CACHE, evaluate

    if engine is None:
        from lab.engine import Engine

        engine = Engine(str(args.model), **dict(args.fixed))
    elif args.fixed:
        engine.configure(**dict(args.fixed))
    tasks = get_tasks(args.tasks, limit=args.limit)
    cache = None if args.no_cache else (args.cache or DEFAULT_CACHE)
    df = evaluate(
        engine,
        tasks,
        sweep=dict(args.sweep) or None,
        cache=cache,
        overwrite=args.overwrite,
        use_task_instructions=args.task_instructions,
    )
    from evals.results_index import device_slug, stamp, write_meta

    args.out.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^\w.-]+", "_", model_name(engine).replace("/", "__"))
    stem += "_" + device_slug(str((getattr(engine, "resolved", None) or {}).get("device", "cpu")))
    csv_path, md_path = args.out / f"{stem}.csv", args.out / f"{stem}.md"
    stamp(df).to_csv(csv_path, index=False)
    write_meta(csv_path)
    table = main_table(df)
    header = f"# {model_name(engine)}: main scores (x100)\n\ntasks: {', '.join(args.tasks)}"
    if args.limit:
        header += f" (first {args.limit} items each, smoke run)"
    md_path.write_text(header + "\n\n" + to_markdown(table), encoding="utf-8")
    written = [csv_path, md_path]
    png = save_plot(df, args.out / f"{stem}.png")
    if png:
        written.append(png)
    print(table.to_string())
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return df


if __name__ == "__main__":
    main()
