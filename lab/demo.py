"""The demo: embed real sentences with the bundled all-MiniLM-L6-v2, print a similarity table and the throughput.

    python -m lab.demo                 # or: bash .ci/demo (sets up .venv first)
    python -m lab.demo --model PATH    # any local model folder

The bundled model is the ``demo`` extra (``pip install 'prefill-lab[demo]'``). The engine is created with
``tune_allocator=True`` (``lab.runtime.allocator``: glibc keeps freed activations in the heap, for this process) and
the first line printed says whether those settings are in effect.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
from pathlib import Path

SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays an acoustic guitar on stage.",
    "A woman is slicing an onion.",
    "A cook chops vegetables in the kitchen.",
    "Stocks fell sharply after the central bank raised rates.",
    "Markets dropped when interest rates went up.",
]


def _throughput_texts() -> tuple[list[str], str]:
    """STSBenchmark test sentences when run from a checkout (evals/data), else the demo sentences repeated."""
    data = Path(__file__).resolve().parent.parent / "evals" / "data" / "stsbenchmark" / "test.jsonl.gz"
    if data.exists():
        with gzip.open(data, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        return [r["sentence1"] for r in rows] + [r["sentence2"] for r in rows], "STSBenchmark test sentences"
    return SENTENCES * 400, "demo sentences x400"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local model folder (default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import pandas as pd

    from lab import Engine
    from lab._extras import minilm_path

    if args.model is None:
        args.model = minilm_path()
    eng = Engine(args.model, dtype=args.dtype, tune_allocator=True)
    print(eng)
    print(f"malloc_tuning: {eng.resolved['malloc_tuning']} (lab.runtime.allocator)\n")

    emb = eng.embed(SENTENCES)
    short = [s if len(s) <= 34 else s[:31] + "..." for s in SENTENCES]
    table = pd.DataFrame(eng.similarity(emb), index=short, columns=[f"[{i}]" for i in range(len(SENTENCES))])
    with pd.option_context("display.width", 160, "display.precision", 3):
        print("Cosine similarity:\n", table, "\n", sep="")

    texts, what = _throughput_texts()
    eng.embed(texts[:256])  # warm-up
    eng.embed(texts)
    s = eng.stats
    print(
        f"Throughput on {len(texts)} {what}: {s.tokens_per_s:,.0f} tokens/s "
        f"({s.tokens} tokens, {s.batches} packed batches, {s.padded_tokens} padded tokens, {s.seconds:.2f} s)"
    )


if __name__ == "__main__":
    main()
