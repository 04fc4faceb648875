"""evals/results_index.py: the committed index of evals/results and README.md's speed block are current, every
results file is listed, and the generator's rules on a temporary results folder."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest

from lab._repo import import_evals

ri = import_evals("results_index")
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "evals" / "results"
REGENERATE = "run `python -m evals.results_index` and commit evals/results/README.md (and README.md's speed block)"


def tracked(folder: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", str(folder)], cwd=ROOT, capture_output=True, check=True)
    return [ROOT / p for p in out.stdout.decode().split("\0") if p]


def test_committed_index_is_current():
    """evals/results/README.md is what the generator makes from the results as they are."""
    index = RESULTS / ri.INDEX_NAME
    assert index.exists(), f"{index} is missing: {REGENERATE}"
    assert index.read_text(encoding="utf-8") == ri.render_index(RESULTS), f"{index} is stale: {REGENERATE}"


def test_readme_speed_block_is_current():
    """Where README.md holds the speed markers, the block between them is the generated one."""
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    if ri.SPEED_BEGIN not in text:
        pytest.skip(f"README.md has no {ri.SPEED_BEGIN} marker: no speed block to check")
    assert ri.with_speed_block(text, ri.render_speed(RESULTS, ROOT)) == text, f"README.md's speed block: {REGENERATE}"


def test_every_results_file_is_listed_and_dated():
    """No tracked file under evals/results is an orphan: each lies in a benchmark folder and is one of an index
    entry's files (a self-documenting folder's files count as its README's), every sidecar belongs to a listed
    file, and every run outside such a folder has a date."""
    entries = ri.entries(RESULTS)
    listed = {f for e in entries for f in e.files}
    documented = [e.path.parent for e in entries if e.path.name == "README.md"]
    orphans = []
    for path in tracked(RESULTS):
        if path == RESULTS / ri.INDEX_NAME or any(d in path.parents for d in documented):
            continue
        if path.name.endswith(ri.META_SUFFIX):
            if Path(str(path)[: -len(ri.META_SUFFIX)]) not in listed:
                orphans.append(path)
        elif path not in listed:
            orphans.append(path)
    assert not orphans, f"results files not in the index (move them into a benchmark folder): {orphans}"
    undated = [e.path for e in entries if e.path.name != "README.md" and e.date == "-"]
    assert not undated, f"runs without a run_date column or a .meta.json sidecar: {undated}"


def test_result_names_end_with_their_machine():
    """Every results file outside a self-documenting folder ends with the slug of the machine that made it."""
    bad = []
    for e in ri.entries(RESULTS):
        if e.path.name == "README.md" or e.benchmark == "panel":
            continue
        for f in e.files:
            slug = ri.split_stem(f.stem)[1]
            if not slug or slug != e.machine:
                bad.append(f)
    assert not bad, f"result files whose name does not end with their machine: {bad}"


def _write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _embed_rows(when: str) -> list[dict]:
    common = {
        "corpus": "mixed",
        "dtype": "float32",
        "cpu_model": "Test CPU 9000",
        "cpu_flags": "avx2 fma",
        "run_date": when,
    }
    return [
        {**common, "system": "engine", "tokens_per_s": "3000", "ratio_vs_sentence_transformers": "1.5"},
        {**common, "system": "sentence-transformers", "tokens_per_s": "2000", "ratio_vs_sentence_transformers": "1"},
    ]


def test_generator_on_a_temporary_folder(tmp_path):
    """Index rows from a CSV's run_date and from a sidecar; plots grouped with their CSV; the speed block with and
    without a peers file; the README left alone without markers and stale until regenerated with them."""
    root = tmp_path / "evals" / "results"
    _write_csv(root / "bench_embed" / "bench_embed_test-cpu-9000.csv", _embed_rows("2030-01-02"))
    (root / "bench_embed" / "bench_embed_test-cpu-9000.png").write_bytes(b"png")
    _write_csv(root / "study" / "study_h200.csv", [{"score": "1"}])
    (root / "study" / "study_loss_h200.png").write_bytes(b"png")
    ri.write_meta(root / "study" / "study_h200.csv", "python evals/study.py --fast", "2030-02-03")
    (root / "cache").mkdir()
    (root / "cache" / "x.json").write_text("{}")  # mteb's cache: not a result

    entries = {e.path.name: e for e in ri.entries(root)}
    assert set(entries) == {"bench_embed_test-cpu-9000.csv", "study_h200.csv"}
    embed, study = entries["bench_embed_test-cpu-9000.csv"], entries["study_h200.csv"]
    assert (embed.machine, embed.date, embed.command) == ("test-cpu-9000", "2030-01-02", "-")
    assert "3,000 tok/s (1.50x sentence-transformers)" in embed.headline
    assert [f.name for f in embed.files] == ["bench_embed_test-cpu-9000.csv", "bench_embed_test-cpu-9000.png"]
    assert (study.machine, study.date, study.command) == ("h200", "2030-02-03", "python evals/study.py --fast")
    assert study.headline == "1 rows" and [f.name for f in study.files] == ["study_h200.csv", "study_loss_h200.png"]

    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nno markers\n")
    assert ri.stale(root, readme) == [str(root / "README.md")]
    ri.write(root, readme)
    assert ri.stale(root, readme) == [] and readme.read_text() == "# x\n\nno markers\n"
    assert "| bench_embed | test-cpu-9000 | 2030-01-02 |" in (root / "README.md").read_text()

    readme.write_text(f"# x\n\n{ri.SPEED_BEGIN}\nold\n{ri.SPEED_END}\n\nafter\n")
    assert ri.stale(root, readme) == [f"{readme} (speed block)"]
    assert ri.main(["--results", str(root), "--readme", str(readme), "--check"]) == 1
    ri.write(root, readme)
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{ri.SPEED_END}\n\nafter\n")
    assert "**test-cpu-9000**: Test CPU 9000 (avx2 fma)" in text and "| mixed | 3,000 | 1.50x |" in text
    assert "evals/results/bench_embed/bench_embed_test-cpu-9000.csv" in text and "fastest peer" not in text
    assert ri.main(["--results", str(root), "--readme", str(readme), "--check"]) == 0

    _write_csv(
        root / "bench_peers" / "bench_peers_test-cpu-9000.csv",
        [
            {"system": "engine", "corpus": "mixed", "dtype": "float32", "tokens_per_s": "3300"},
            {"system": "peer-a", "corpus": "mixed", "dtype": "float32", "tokens_per_s": "1100"},
            {"system": "peer-b", "corpus": "mixed", "dtype": "float32", "tokens_per_s": "1500"},
        ],
    )
    assert ri.stale(root, readme) == [str(root / "README.md"), f"{readme} (speed block)"]
    ri.write(root, readme)
    assert "| 3,000 | 1.50x | 2.20x (peer-b) |" in readme.read_text()


def test_orphans_and_broken_inputs_are_named(tmp_path, capsys):
    """A file outside a benchmark folder stops the generator with its name; a sidecar that is not JSON names its
    path; a begin marker without an end marker is an error."""
    root = tmp_path / "results"
    _write_csv(root / "bench_embed" / "bench_embed_test-cpu-9000.csv", _embed_rows("2030-01-02"))
    (root / "loose.csv").write_text("a\n1\n")
    assert ri.main(["--results", str(root), "--readme", str(tmp_path / "none.md")]) == 1
    assert "loose.csv" in capsys.readouterr().err
    (root / "loose.csv").unlink()
    assert ri.main(["--results", str(root), "--readme", str(tmp_path / "none.md")]) == 0

    (root / "study").mkdir()
    (root / "study" / "notes_h200.log").write_text("log\n")
    Path(str(root / "study" / "notes_h200.log") + ri.META_SUFFIX).write_text("{not json")
    with pytest.raises(ValueError, match="notes_h200.log.meta.json"):
        ri.entries(root)
    with pytest.raises(ValueError, match="no <!-- speed:end -->"):
        ri.with_speed_block(f"{ri.SPEED_BEGIN}\nx\n", "body\n")


def test_writing_helpers(tmp_path):
    """The names the scripts write: result_path, companion (kind before the slug), gpu_slug, write_meta, stamp."""
    assert ri.result_path("bench_x", slug="h200", root=tmp_path) == tmp_path / "bench_x" / "bench_x_h200.csv"
    assert (
        ri.result_path("bench_x", "bench_x_quick", slug="a-b", ext="png", root=tmp_path).name
        == "bench_x_quick_a-b.png"
    )
    assert (
        ri.companion(tmp_path / "bench_decoder_a-b.csv", "memory", "png", "a-b").name == "bench_decoder_memory_a-b.png"
    )
    assert ri.companion(tmp_path / "mine.csv", "memory", "png", "a-b").name == "mine_memory.png"
    assert [ri.gpu_slug(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB")] == [
        "h200",
        "h100",
        "a100",
    ]
    meta = ri.write_meta(tmp_path / "r.csv", "python x.py", "2030-01-02")
    assert json.loads(meta.read_text()) == {"date": "2030-01-02", "command": "python x.py"}
    assert ri.stamp([{"a": 1}], "2030-01-02") == [{"a": 1, "run_date": "2030-01-02"}]
    assert ri.command_line([str(ROOT / "evals" / "bench_x.py"), "--n", "a b"]) == "python evals/bench_x.py --n 'a b'"


def test_save_helpers_write_each_file_whole(tmp_path):
    """save_run names its files by benchmark and machine (``extra`` files by suffix), save_table writes the table,
    its other files and the sidecar; a file whose data fails to render leaves the one written before as it was and no
    temporary file beside it."""
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"a": [1, 2]})
    csv_path = ri.save_run(df, tmp_path / "bench_x", "bench_x", slug="h200", extra={".md": "# x\n"})
    assert sorted(p.name for p in csv_path.parent.iterdir()) == [
        "bench_x_h200.csv",
        "bench_x_h200.csv.meta.json",
        "bench_x_h200.md",
    ]
    assert csv_path.read_text() == "a\n1\n2\n" and json.loads(Path(f"{csv_path}.meta.json").read_text())["date"]

    class Broken:  # a figure whose rendering fails half-way
        def savefig(self, f, **kw):
            f.write(b"half")
            raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        ri.save_table(csv_path, "a\n3\n", {csv_path.with_suffix(".md"): Broken()})
    assert csv_path.with_suffix(".md").read_text() == "# x\n"
    assert sorted(p.name for p in csv_path.parent.iterdir()) == [
        "bench_x_h200.csv",
        "bench_x_h200.csv.meta.json",
        "bench_x_h200.md",
    ]
    assert ri.save_file(tmp_path / "new" / "b.bin", b"\x00").read_bytes() == b"\x00"
