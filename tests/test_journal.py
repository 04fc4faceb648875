"""The repository describes what the code does, never how the work on it went: no tracked file (code, docs, notebooks'
sources and outputs, result CSVs) and no tracked path names a work session, a stop, a round of work, an earlier
version, or a result file by the run that made it (``_s18``, ``_rerun``, ``_before_<fix>``, ``_first``). Result files
are named by benchmark and machine (``evals/results_index.py``); git's history holds the rest."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()  # states the patterns, so it is not scanned

# accounts of the work, case-insensitive
JOURNAL = [
    r"\bsessions?\s?[-#]?\d+\b",  # a numbered session, with a space, a dash or a hash before the number
    r"\b(?:this|that|last|previous|next|earlier|later|same) session\b",
    r"\bthis\s+stop\b",
    r"\b(?:first|previous|earlier|older|old) version\b",
    r"\bprevious (?:run|stop|round|attempt)\b",
    r"\bround \d+\b",  # "round 3" of work
    r"\brounds? (?:one|two|three|four|of (?:work|review|fixes))\b",
    r"\b[\w-]*_s\d{1,3}\b",  # a run named by its session: bench_embed_epyc_s17
    r"\b[\w-]*_rerun\b",
    r"\b[\w-]*_(?:before_[a-z0-9_]+|first|second|third)\.(?:csv|png|txt|md|json|log|ipynb|py)\b",
]
# legitimate uses of those words: a match inside one of these spans is not a hit
ALLOW = [
    r"\bray session\b",  # Ray's own term for a running cluster
    r"\brequests\.Session\b",
    r"\bfirst version of the (?:protocol|format|specification)\b",
]
PATTERN = re.compile("|".join(f"(?:{p})" for p in JOURNAL), re.IGNORECASE)
ALLOWED = re.compile("|".join(f"(?:{p})" for p in ALLOW), re.IGNORECASE)
# a path component named by a round of work: bench_embed_xeon_float32_rerun.csv, ..._before_malloc_fix.csv
PATH_PATTERN = re.compile(r"_(?:s\d{1,3}|rerun|before_[a-z0-9_]+|first|second|third)(?:[._]|$)", re.IGNORECASE)


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def hits_in_text(text: str) -> list[tuple[int, str]]:
    """(line number, matched words) of every account of the work in ``text``, allowed spans excepted."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        allowed = [m.span() for m in ALLOWED.finditer(line)]
        for m in PATTERN.finditer(line):
            if not any(a <= m.start() and m.end() <= b for a, b in allowed):
                found.append((number, m.group(0)))
    return found


def read_text(path: Path) -> str | None:
    """The file's text, or ``None`` for a binary file (a NUL byte or not UTF-8: images, weights, gzip)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def journal_hits(root: Path = ROOT, files: list[str] | None = None) -> list[str]:
    """``path:line: words`` for every hit in the tracked files' text and ``path: words`` for every hit in a path."""
    out = []
    for rel in tracked_files() if files is None else files:
        if rel == THIS:
            continue
        for part in Path(rel).parts:
            m = PATH_PATTERN.search(Path(part).stem + Path(part).suffix)
            if m:
                out.append(f"{rel}: file name {part!r}")
        path = root / rel
        if path.is_symlink() or not path.is_file():
            continue
        text = read_text(path)
        if text is not None:
            out += [f"{rel}:{n}: {words!r}" for n, words in hits_in_text(text)]
    return out


def test_no_account_of_the_work_in_the_repository():
    """Every tracked file's text (notebooks' outputs and CSV cells included) and every tracked path."""
    hits = journal_hits()
    assert not hits, (
        "accounts of how the work went (say what the code does; name result files by benchmark and machine): "
        + "\n".join(hits)
    )


def test_the_scanner_finds_and_allows(tmp_path):
    """The patterns on a temporary tree: session numbers, stops, rounds, earlier versions and run-named files are
    hits, in text and in paths; Ray sessions, requests.Session, a tokenizer's rounding and binary files are not."""
    # the journal phrases are assembled here so that this file does not itself contain them
    numbered, stop = "session" + " 21", "This" + " stop"
    files = {
        "notes.md": f"Measured in {numbered}.\n{stop} adds X.\nAs in the previous version.\nround 2 of fixes\n",
        "data/bench_embed_epyc_s17.csv": "a\n1\n",
        "data/bench_embed_xeon_float32_rerun.csv": "a\n1\n",
        "nb.ipynb": '{"outputs": ["wrote bench_embed_f32_first.csv"]}\n',
        "ok.py": "ray session started; requests.Session(); x = round(3.5); rounds = 2; a rerun skips cached work\n",
        "weights.bin": numbered + "\0",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    hits = journal_hits(tmp_path, list(files))
    assert hits == [
        f"notes.md:1: '{numbered}'",
        f"notes.md:2: '{stop}'",
        "notes.md:3: 'previous version'",
        "notes.md:4: 'round 2'",
        "data/bench_embed_epyc_s17.csv: file name 'bench_embed_epyc_s17.csv'",
        "data/bench_embed_xeon_float32_rerun.csv: file name 'bench_embed_xeon_float32_rerun.csv'",
        "nb.ipynb:1: 'bench_embed_f32_first.csv'",
    ], hits
