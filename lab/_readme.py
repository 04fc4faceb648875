"""The README's generated blocks, written from the code so they cannot drift: the knob table (the knob registry,
``lab.engine.knob_registry.KNOBS``), the environment variables (``lab.env``), the CPU fast-path table
(``lab.ops.probes.CANDIDATES``) and the API list (every public name of ``lab`` and of each subpackage's ``__all__``,
with the first line of its docstring).

Each block sits between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in ``README.md``; the lines between are
replaced, everything else is kept. The speed block (``speed``) is written by ``python -m evals.results_index``.

    python -m lab._readme            # rewrite the blocks in README.md
    python -m lab._readme --check    # exit 1 and name the stale blocks

    >>> print(knob_table().splitlines()[0])
    | knob | default | honoured by | meaning |
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
API = Path(__file__).resolve().parent / "API.md"  # the API table, linked from README.md
# the packages whose public names the API block lists: lab itself, then every subpackage with an ``__all__``
PACKAGES = (
    "lab",
    "lab.engine",
    "lab.runtime",
    "lab.ops",
    "lab.models",
    "lab.outputs",
    "lab.adapt",
    "lab.eval",
    "lab.distributed",
    "lab.kernels",
)


def markdown(text: str) -> str:
    """reStructuredText inline literals (````x````) as Markdown code spans (```x```), table pipes escaped."""
    return re.sub(r"``(.+?)``", r"`\1`", text).replace("|", "\\|")


def knob_table() -> str:
    """One row per knob of the registry (``lab.engine.knob_registry.KNOBS``), in its order: default, the call kinds
    that honour it, its doc line."""
    from lab.engine.knob_registry import KNOBS

    rows = ["| knob | default | honoured by | meaning |", "|---|---|---|---|"]
    for k in KNOBS.values():
        shown = "[]" if k.default == () else repr(k.default)
        rows.append(f"| `{k.name}` | `{shown}` | {markdown(k.calls)} | {markdown(k.doc)} |")
    return "\n".join(rows)


def cpu_path_table() -> str:
    """Every CPU fast path of ``lab.ops.probes.CANDIDATES`` with its candidates (the first is the default a probe
    must beat), wrapped into a paragraph; ``LAB_CPU_<NAME>=<candidate>`` forces one for the process."""
    import textwrap

    from lab.ops.probes import CANDIDATES

    items = [f"`{name}` ({' / '.join(f'`{c}`' for c in choices)})" for name, choices in CANDIDATES.items()]
    return textwrap.fill(", ".join(items) + ".", 119, break_on_hyphens=False, break_long_words=False)


def first_line(obj) -> str:
    """The first sentence of ``obj``'s docstring (its first paragraph up to a full stop or a colon that ends a line;
    empty when it has none), on one line."""
    doc = (inspect.getdoc(obj) or "").strip()
    lines = []
    for line in doc.splitlines():
        if not line.strip():
            break
        lines.append(line.strip())
        if line.rstrip().endswith(":"):
            break
    para = " ".join(lines).rstrip(":")
    end = re.search(r"\.(\s|$)", para)
    return para[: end.start() + 1] if end else para


def public_names() -> list[tuple[str, str, object]]:
    """``(package, name, object)`` for every name in ``__all__`` of ``PACKAGES`` (those that define one), in order;
    a name a package re-exports from a package listed before it is listed once, under the first."""
    seen: set[int] = set()
    out = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            out.append((package, name, obj))
    return out


def methods(cls: type) -> list[tuple[str, object]]:
    """The public methods ``cls`` defines itself (properties and inherited methods left out), in source order."""
    return [(name, fn) for name, fn in vars(cls).items() if not name.startswith("_") and inspect.isfunction(fn)]


def api_block() -> str:
    """A table: per public name its package and its docstring's first sentence; a class's own public methods follow
    it on one row."""
    rows = ["| package | name | what |", "|---|---|---|"]
    for package, name, obj in public_names():
        rows.append(f"| `{package}` | `{name}` | {markdown(first_line(obj))} |")
        if inspect.isclass(obj) and methods(obj):
            listed = ", ".join(f"`{m}`" for m, _ in methods(obj))
            rows.append(f"| | `{name}.*` | methods: {listed} |")
    return "\n".join(rows)


def env_table() -> str:
    """Every ``LAB_*`` environment variable (``lab.env.VARIABLES``): accepted values, default, effect."""
    from lab import env

    return env.table()


BLOCKS: dict[str, Callable[[], str]] = {
    "knobs": knob_table,
    "cpu-paths": cpu_path_table,
    "env": env_table,
    "api": api_block,
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def render(text: str, blocks: dict[str, Callable[[], str]] = BLOCKS) -> str:
    """``text`` with every block whose markers it holds rewritten; a begin marker without its end is an error."""
    for name, make in blocks.items():
        begin, end = markers(name)
        if begin not in text:
            continue
        head, _, rest = text.partition(begin)
        if end not in rest:
            raise ValueError(f"README has {begin} but no {end} after it: add the end marker")
        _, _, tail = rest.partition(end)
        text = f"{head}{begin}\n{make()}\n{end}{tail}"
    return text


def stale(readme: Path | None = None) -> list[str]:
    """The blocks ``main`` would rewrite (empty when every block is current): ``readme``'s, or by default those of
    README.md and lab/API.md (the latter named ``API.md:<block>``)."""
    out = []
    for path in [readme] if readme is not None else [README, API]:
        text = path.read_text(encoding="utf-8")
        prefix = "" if path == README or readme is not None else f"{path.name}:"
        out += [
            prefix + name for name in BLOCKS if markers(name)[0] in text and render(text, {name: BLOCKS[name]}) != text
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Rewrite the generated blocks of README.md (knobs, cpu-paths) and lab/API.md (api)."
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a block is stale; write nothing")
    parser.add_argument("--readme", type=Path, default=None, help="one file to process (default: both)")
    args = parser.parse_args(argv)
    paths = [args.readme] if args.readme is not None else [README, API]
    old = stale(args.readme)
    if args.check:
        if old:
            print(f"stale blocks {', '.join(old)}; run python -m lab._readme", file=sys.stderr)
        return 1 if old else 0
    for path in paths:
        path.write_text(render(path.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"rewrote {', '.join(old) or 'nothing (all blocks current)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
