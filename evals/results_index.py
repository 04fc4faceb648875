"""Where benchmark results live and what is there: the path helpers every script in ``evals/`` writes through, and
the generator of ``evals/results/README.md``.

Layout: one folder per benchmark or study, ``evals/results/<benchmark>/``; every file's name ends with the machine
that made it, ``<name>_<slug>.<ext>`` (``result_path``), and a plot or a table made beside a CSV carries its kind
before the slug, ``<name>_<kind>_<slug>.<ext>`` (``companion``). The slug is ``lab.ops.probes.machine_slug()`` for
a CPU run and the GPU's short name for a CUDA run (``gpu_slug``: ``NVIDIA H200`` -> ``h200``). Only the latest run
per benchmark and machine is kept: a new run overwrites the file, and the older ones are in git's history.

Every run dates itself from its own files, never from git or file times, so the index is the same on every
checkout: a CSV's ``run_date`` column (ISO date; ``stamp``), or a sidecar ``<file>.meta.json`` with ``date`` and
``command`` (``meta_text``; the scripts write both). The scripts write their files through ``save_run`` /
``save_table`` / ``save_file``, each file whole (a temporary file, then renamed), so a run that fails leaves the
files written before whole. A folder with its own ``README.md`` documents itself and is listed as one entry.
Each run's one-line headline comes from ``evals.results_headlines``.

    python -m evals.results_index            # rewrite evals/results/README.md and README.md's speed block
    python -m evals.results_index --check    # exit 1 when either is stale

The speed block: the lines between ``<!-- speed:begin -->`` and ``<!-- speed:end -->`` in the repository's
README.md, one table per machine from ``bench_embed/bench_embed_<slug>.csv`` (Engine tokens/s and its ratio to
sentence-transformers per corpus and dtype) and, where ``bench_peers/bench_peers_<slug>.csv`` exists, the ratio to
the fastest other system there. A README without the markers is left as it is.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from evals.results_headlines import as_number, fastest_peer, headline

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "evals" / "results"
README = ROOT / "README.md"
INDEX_NAME = "README.md"
META_SUFFIX = ".meta.json"
SPEED_BEGIN, SPEED_END = "<!-- speed:begin -->", "<!-- speed:end -->"
# folders under evals/results that hold no results: mteb's result cache (git-ignored)
SKIP_DIRS = {"cache"}


# ------------------------------------------------------------------------------------------------ writing side
def gpu_slug(name: str) -> str:
    """A CUDA device name's short form for file names: vendor and product-line words, memory sizes and form
    factors dropped (``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``,
    ``NVIDIA A100-SXM4-40GB`` -> ``a100``).

        >>> gpu_slug("NVIDIA H100 80GB HBM3")
        'h100'
    """
    drop = re.compile(r"^(nvidia|amd|tesla|geforce|quadro|\d+gb|hbm\d*e?|pcie|sxm\d*|nvl|mig.*)$")
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and not drop.match(w)]
    return "-".join(words) or "gpu"


def device_slug(device: str | None = None) -> str:
    """The slug of the machine a run measures: the GPU's (``gpu_slug``) when ``device`` is a CUDA device, else the
    CPU's (``lab.ops.probes.machine_slug``)."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        return gpu_slug(torch.cuda.get_device_name(torch.device(device)))
    from lab.ops.probes import machine_slug

    return machine_slug()


def result_path(
    benchmark: str, name: str | None = None, *, slug: str | None = None, ext: str = "csv", root: Path = RESULTS
) -> Path:
    """``<root>/<benchmark>/<name>_<slug>.<ext>``; ``name`` defaults to the benchmark's, ``slug`` to this CPU's.

    >>> result_path("bench_embed", slug="h200", root=Path("r")).as_posix()
    'r/bench_embed/bench_embed_h200.csv'
    """
    return Path(root) / benchmark / f"{name or benchmark}_{slug or device_slug()}.{ext}"


def companion(path: Path, kind: str, ext: str, slug: str | None = None) -> Path:
    """The file made beside ``path`` (a plot, an op table): ``<name>_<kind>_<slug>.<ext>`` when ``path``'s stem
    ends with ``_<slug>``, else ``<stem>_<kind>.<ext>`` (a ``--out`` of the caller's choosing).

        >>> companion(Path("bench_decoder_h200.csv"), "throughput", "png", "h200").name
        'bench_decoder_throughput_h200.png'
    """
    path = Path(path)
    stem = path.stem
    if slug and stem.endswith("_" + slug):
        return path.with_name(f"{stem[: -len(slug) - 1]}_{kind}_{slug}.{ext}")
    return path.with_name(f"{stem}_{kind}.{ext}")


def run_date() -> str:
    """Today as an ISO date (``2026-12-05``): the value of a run's ``run_date`` column and sidecar."""
    return date.today().isoformat()


def stamp(rows, when: str | None = None):
    """Adds ``run_date`` to a run's rows: a pandas DataFrame (returned with the column added) or a list of dicts
    (each updated in place and returned)."""
    when = when or run_date()
    if hasattr(rows, "assign"):
        return rows.assign(run_date=when)
    for row in rows:
        row["run_date"] = when
    return rows


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as typed from the repository root (``python evals/bench_embed.py --smoke``)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]) if argv else Path("python")
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", script.as_posix(), *argv[1:]])


def write_meta(path: Path, command: str | None = None, when: str | None = None) -> Path:
    """Writes ``<path>.meta.json`` beside a result file (``save_file``): ``{"date": ISO date, "command": how it was
    made}``."""
    return save_file(Path(str(path) + META_SUFFIX), meta_text(command, when))


def save_file(path: Path, data) -> Path:
    """Writes one result file whole through ``lab._files.atomic_write`` (a temporary file beside it,
    flushed, then renamed over ``path``), its folder made where missing: a run that fails (a full disk, a size
    limit, an interrupt) leaves the file written before as it was. ``data``: bytes as they are, a str as UTF-8, a
    pandas DataFrame as CSV without its index, a matplotlib figure as an image in the format of ``path``'s suffix
    at 120 dpi. Returns ``path``."""
    import io

    from lab._files import atomic_write

    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    elif hasattr(data, "to_csv"):
        data = data.to_csv(index=False).encode("utf-8")
    elif hasattr(data, "savefig"):
        image = io.BytesIO()
        data.savefig(image, dpi=120, format=path.suffix.lstrip(".") or "png")
        data = image.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, bytes(data))
    return path


def save_table(path: Path, table, files: dict | None = None) -> Path:
    """A run's results at a path of the caller's choosing: the table at ``path`` (a DataFrame, or CSV text), each of
    ``files`` (path -> what ``save_file`` takes; a None value is skipped) and last ``<path>.meta.json``, every one
    through ``save_file``. Returns ``path``."""
    path = Path(path)
    save_file(path, table)
    for other, data in (files or {}).items():
        if data is not None:
            save_file(other, data)
    write_meta(path)
    return path


def save_run(df, folder: Path, name: str, fig=None, *, slug: str | None = None, extra: dict | None = None) -> Path:
    """A benchmark's results: ``<folder>/<name>_<machine>.csv`` (``df``), its ``.meta.json`` and, with ``fig``, the
    plot ``<name>_<machine>.png``; ``extra`` maps a suffix to more files of the same stem (``{".md": text}`` ->
    ``<name>_<machine>.md``). The machine is ``slug``, default this CPU's (``device_slug``). Each file is written
    whole (``save_table``), so a run that fails leaves the files written before whole. Returns the CSV's path."""
    csv_path = Path(folder) / f"{name}_{slug or device_slug()}.csv"
    files = {csv_path.with_suffix(".png"): fig}
    files.update({csv_path.with_suffix(suffix): data for suffix, data in (extra or {}).items()})
    return save_table(csv_path, df, files)


def meta_text(command: str | None = None, when: str | None = None) -> str:
    """The body of a ``.meta.json``: ``{"date": ISO date, "command": how it was made}``."""
    body = {"date": when or run_date(), "command": command if command is not None else command_line()}
    return json.dumps(body, indent=1) + "\n"


# ------------------------------------------------------------------------------------------------ reading side
@dataclass
class Entry:
    """One run in the index: its primary file (a CSV where there is one) and the files made with it."""

    benchmark: str
    name: str
    machine: str
    path: Path
    date: str = "-"
    command: str = "-"
    headline: str = "-"
    files: list[Path] = field(default_factory=list)


def split_stem(stem: str) -> tuple[str, str]:
    """``bench_embed_amd-epyc-f25m17`` -> (``bench_embed``, ``amd-epyc-f25m17``): the slug is what follows the last
    underscore (slugs have none); a stem without an underscore has no machine (``panel`` -> (``panel``, ``""``))."""
    name, sep, slug = stem.rpartition("_")
    return (name, slug) if sep else (stem, "")


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def read_meta(path: Path) -> dict:
    meta = Path(str(path) + META_SUFFIX)
    if not meta.exists():
        return {}
    try:
        return json.loads(meta.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f'{meta}: not JSON ({e}); it should hold {{"date": ..., "command": ...}}') from e


def result_files(folder: Path) -> list[Path]:
    """Every file of a benchmark folder (its sub-folders included), sidecars left out, sorted."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(META_SUFFIX))


def folder_entries(folder: Path) -> list[Entry]:
    """The runs of one benchmark folder: each CSV, and each other file that was not made beside a CSV, is a run;
    a plot / table ``<name>_<kind>_<slug>`` belongs to the CSV of the same slug with the longest matching name."""
    files = result_files(folder)
    if (folder / "README.md").exists():  # a study that documents itself: its README lists its files
        return [
            Entry(
                folder.name,
                folder.name,
                "-",
                folder / "README.md",
                headline=f"see {folder.name}/README.md",
                files=[folder / "README.md"],
            )
        ]
    primaries = [p for p in files if p.suffix == ".csv"]
    owner: dict[Path, Path] = {}
    for p in files:
        if p in primaries:
            continue
        name, slug = split_stem(p.stem)
        match = [
            c
            for c in primaries
            if p.parent == c.parent
            and split_stem(c.stem)[1] == slug
            and (name == split_stem(c.stem)[0] or name.startswith(split_stem(c.stem)[0] + "_"))
        ]
        if match:
            owner[p] = max(match, key=lambda c: len(c.stem))
        else:
            primaries.append(p)
    entries = []
    for p in sorted(primaries):
        name, slug = split_stem(p.stem)
        meta = read_meta(p)
        entry = Entry(folder.name, name, slug or "-", p, files=[p] + sorted(f for f, o in owner.items() if o == p))
        rows = read_rows(p) if p.suffix == ".csv" else []
        dates = sorted({r["run_date"] for r in rows if r.get("run_date")})
        entry.date = dates[-1] if dates else meta.get("date", "-")
        entry.command = meta.get("command", "-")
        entry.headline = headline(folder.name, rows) if p.suffix == ".csv" else "-"
        entries.append(entry)
    return entries


def entries(root: Path = RESULTS) -> list[Entry]:
    """Every run under ``root``, benchmark by benchmark (folder names sorted)."""
    out = []
    for folder in sorted(p for p in Path(root).iterdir() if p.is_dir() and p.name not in SKIP_DIRS):
        out.extend(folder_entries(folder))
    return out


def loose_files(root: Path = RESULTS) -> list[Path]:
    """Files directly in ``root`` (the index aside): results outside any benchmark folder."""
    return sorted(p for p in Path(root).iterdir() if p.is_file() and p.name != INDEX_NAME)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_index(root: Path = RESULTS) -> str:
    """The text of ``<root>/README.md``: one row per run (benchmark, machine, date, command, headline, files)."""
    root = Path(root)
    lines = [
        "# Benchmark and study results",
        "",
        (
            "Generated by `python -m evals.results_index` from the files themselves (do not edit by hand; "
            "`tests/test_results_index.py` fails when this index is stale). One folder per benchmark or study; every "
            "file name ends with the machine that made it; only the latest run per machine is kept (older runs are "
            "in git's history). Dates come from each CSV's `run_date` column or the `<file>.meta.json` beside it."
        ),
        "",
        "| benchmark | machine | date | command | headline | files |",
        "|---|---|---|---|---|---|",
    ]
    for e in entries(root):
        files = "<br>".join(f"[{f.relative_to(root).as_posix()}]({f.relative_to(root).as_posix()})" for f in e.files)
        command = f"`{_cell(e.command)}`" if e.command != "-" else "-"
        lines.append(f"| {e.benchmark} | {e.machine} | {e.date} | {command} | {_cell(e.headline)} | {files} |")
    return "\n".join(lines) + "\n"


def render_speed(root: Path = RESULTS, base: Path | None = None) -> str:
    """The README speed block's body: one table per machine with a ``bench_embed`` run (its CPU and flags in the
    heading, a row per corpus, float32 and bfloat16 side by side); the ratio to the fastest peer of the same
    precision where a ``bench_peers`` run of that machine exists. Links relative to ``base`` (the README's folder;
    default the repository root above ``root``)."""
    root = Path(root)
    base = Path(base) if base is not None else root.parent.parent
    out = []
    for csv_path in sorted((root / "bench_embed").glob("bench_embed_*.csv")):
        slug = split_stem(csv_path.stem)[1]
        rows = read_rows(csv_path)
        engine = [r for r in rows if r.get("system") == "engine"]
        if not engine:
            continue
        dates = sorted({r["run_date"] for r in rows if r.get("run_date")})
        when = dates[-1] if dates else read_meta(csv_path).get("date", "-")
        peers_path = root / "bench_peers" / f"bench_peers_{slug}.csv"
        peers = read_rows(peers_path) if peers_path.exists() else None
        rel = Path(os.path.relpath(csv_path, base)).as_posix()
        first = engine[0]
        heading = (
            f"**{slug}**: {_cell(first.get('cpu_model', '-'))} ({_cell(first.get('cpu_flags', '-'))}); "
            f"[{csv_path.name}]({rel}), {when}"
        )
        out += [heading, ""]
        dtypes = list(dict.fromkeys(r["dtype"] for r in engine))
        head, rule = "| corpus |", "|---|"
        for d in dtypes:
            head += f" {d} tokens/s | vs sentence-transformers |" + (" vs fastest peer |" if peers is not None else "")
            rule += "---:|---:|" + ("---|" if peers is not None else "")
        out += [head, rule]
        for corpus in dict.fromkeys(r["corpus"] for r in engine):
            line = f"| {corpus} |"
            for d in dtypes:
                r = next((x for x in engine if x["corpus"] == corpus and x["dtype"] == d), None)
                if r is None:
                    line += " - | - |" + (" - |" if peers is not None else "")
                    continue
                ratio = as_number(r.get("ratio_vs_sentence_transformers"))
                line += f" {as_number(r['tokens_per_s']):,.0f} | {f'{ratio:.2f}x' if ratio is not None else '-'} |"
                if peers is not None:
                    best = fastest_peer(peers, corpus, d)
                    if best and best[2]:
                        name, tps, own = best
                        line += f" {own / tps:.2f}x ({_cell(name)}) |"
                    else:
                        line += " - |"
            out.append(line)
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def with_speed_block(readme_text: str, body: str) -> str:
    """``readme_text`` with the lines between the speed markers replaced by ``body``; unchanged where the markers
    are absent. A begin marker without its end marker is an error (the block's end would be a guess)."""
    begin = readme_text.find(SPEED_BEGIN)
    if begin < 0:
        return readme_text
    end = readme_text.find(SPEED_END, begin)
    if end < 0:
        raise ValueError(f"README has {SPEED_BEGIN} but no {SPEED_END} after it: add the end marker")
    return readme_text[: begin + len(SPEED_BEGIN)] + "\n" + body + readme_text[end:]


def stale(root: Path = RESULTS, readme: Path | None = README) -> list[str]:
    """What ``main`` would rewrite: the index and / or the README speed block; empty when both are current."""
    root = Path(root)
    found = []
    index = root / INDEX_NAME
    if not index.exists() or index.read_text(encoding="utf-8") != render_index(root):
        found.append(str(index))
    if readme is not None and Path(readme).exists():
        text = Path(readme).read_text(encoding="utf-8")
        if with_speed_block(text, render_speed(root, Path(readme).parent)) != text:
            found.append(f"{readme} (speed block)")
    return found


def write(root: Path = RESULTS, readme: Path | None = README) -> list[Path]:
    """Rewrites the index and the README speed block (where the markers are); returns the files changed."""
    root = Path(root)
    changed = []
    index = root / INDEX_NAME
    text = render_index(root)
    if not index.exists() or index.read_text(encoding="utf-8") != text:
        index.write_text(text, encoding="utf-8")
        changed.append(index)
    if readme is not None and Path(readme).exists():
        old = Path(readme).read_text(encoding="utf-8")
        new = with_speed_block(old, render_speed(root, Path(readme).parent))
        if new != old:
            Path(readme).write_text(new, encoding="utf-8")
            changed.append(Path(readme))
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default evals/results)")
    ap.add_argument("--readme", type=Path, default=README, help="the README holding the speed markers")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when the index or block is stale")
    args = ap.parse_args(argv)
    loose = loose_files(args.results)
    if loose:
        print(
            "files outside a benchmark folder (move each into evals/results/<benchmark>/): "
            + ", ".join(p.name for p in loose),
            file=sys.stderr,
        )
        return 1
    if args.check:
        found = stale(args.results, args.readme)
        for f in found:
            print(f"stale: {f} (run python -m evals.results_index)", file=sys.stderr)
        return 1 if found else 0
    for p in write(args.results, args.readme):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
