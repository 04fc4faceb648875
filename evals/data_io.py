"""Reading the local evaluation data: JSON-lines files (gzipped or not) and evenly spaced subsets.

Light on purpose (no mteb, no torch): the benchmark scripts import it too, some in fresh subprocesses.

    >>> rows = read_jsonl(Path("evals/data/stsbenchmark/test.jsonl.gz"))
    >>> rows = [rows[i] for i in spread(len(rows), 200)]      # 200 evenly spaced rows
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def read_jsonl(path: Path) -> list[dict]:
    """Every non-blank line of a ``.jsonl`` or ``.jsonl.gz`` file, parsed."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def spread(n_total: int, n: int | None) -> list[int]:
    """``n`` evenly spaced indices into ``range(n_total)`` (all of them when ``n`` is None or too large), so a
    subset keeps every part of a file that is ordered by genre, year or topic."""
    if n is None or n >= n_total:
        return list(range(n_total))
    return sorted({round(i * (n_total - 1) / max(n - 1, 1)) for i in range(n)})


def stsbenchmark_sentences() -> list[str]:
    """STSBenchmark's test sentences: every pair's first sentence, then every pair's second."""
    rows = read_jsonl(DATA / "stsbenchmark" / "test.jsonl.gz")
    return [r["sentence1"] for r in rows] + [r["sentence2"] for r in rows]


def scifact_text(row: dict) -> str:
    """A SciFact corpus row as one text: title, a space, abstract."""
    return (row.get("title", "") + " " + row["text"]).strip()


def mixed_corpus() -> list[str]:
    """The held-out mixed-length corpus of the speed benchmarks: 400 STSBenchmark test sentences (rows 1000-1399 of
    ``stsbenchmark_sentences``, which the ``stsbenchmark`` corpus of ``bench_embed`` does not time with) and 260
    SciFact abstracts (corpus rows 2000-2259, ``scifact_text``), shuffled with a fixed seed. 660 texts, short and
    long mixed as a real collection mixes them."""
    import random

    docs = read_jsonl(DATA / "scifact" / "corpus.jsonl.gz")[2000:2260]
    texts = stsbenchmark_sentences()[1000:1400] + [scifact_text(r) for r in docs]
    random.Random(0).shuffle(texts)
    return texts


CORPORA = ("stsbenchmark", "scifact", "mixed")


def load_corpus(name: str, scifact_docs: int = 1000) -> list[str]:
    """One of the speed benchmarks' corpora (``CORPORA``): ``stsbenchmark`` (``stsbenchmark_sentences``, short),
    ``scifact`` (the first ``scifact_docs`` SciFact abstracts, ``scifact_text``, long) or ``mixed``
    (``mixed_corpus``: 660 texts, short and long, shuffled with a fixed seed)."""
    if name == "stsbenchmark":
        return stsbenchmark_sentences()
    if name == "scifact":
        rows = read_jsonl(DATA / "scifact" / "corpus.jsonl.gz")[:scifact_docs]
        return [scifact_text(r) for r in rows]
    if name == "mixed":
        return mixed_corpus()
    raise ValueError(f"unknown corpus {name!r}; valid: {', '.join(CORPORA)}")
