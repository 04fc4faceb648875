"""One prepared GPU check: the Triton kernels at real sizes, their speed against torch, and the engine against
sentence-transformers. Meant for a CUDA machine (about 3-5 minutes on one H100/H200; a budget guard stops at 7).

1. correctness in bf16 and fp16, with the tolerances of ``lab.kernels.tolerances`` (the table the kernel tests
   use): each kernel's max error against the float32 oracle must be at most 2x the plain torch reference's error
   in the same dtype, plus the table's atol as a floor (pooling: against the reference on the same input, both
   accumulate in float32, within the table's atol + rtol * max |reference|);
2. timings with ``triton.testing.do_bench`` (p20 / p50 / p80 ms): each kernel vs its torch reference, attention
   also vs ``scaled_dot_product_attention`` on the flash backend over a padded batch (timing only) and vs
   ``flash_attn_varlen_func`` when flash-attn is installed;
3. ``lab.Engine(...).embed`` (triton and torch backends) vs ``SentenceTransformer.encode`` on the same texts
   (STSBenchmark sentences from ``evals/data/stsbenchmark`` when present), with the embeddings' cosine agreement;
4. a random Llama-family decoder through the engine (both attention backends) against transformers on the GPU
   (``check_decoder``); the rotary section also checks and times the ``pairs`` layout's rotation
   (``lab.models.rope.rotate_pairs_``, a CPU engine's choice) beside the Triton kernel.

Writes tidy rows (one per section / kernel / provider / config / dtype / metric, with the run's ``run_date``) to a
CSV, the command in ``<csv>.meta.json``, and prints a table; exits 1 if a correctness check fails or a section
raised. The default CSV is ``evals/results/gpu_check/gpu_check_<machine>.csv``, the machine the GPU's short name
(``evals.results_index.gpu_slug``: ``h200``), or the CPU's under ``--smoke``; the printed output, kept, goes beside it
as ``gpu_check_<machine>.log``, and the kernel tests' output as ``kernel_tests_<machine>.log``.

    python evals/gpu_check.py                           # -> evals/results/gpu_check/gpu_check_<machine>.csv
    python evals/gpu_check.py /tmp/out.csv --skip-engine
    python evals/gpu_check.py --smoke                   # CPU + Triton interpreter, tiny shapes: checks the script

On a machine where the project cannot be installed (a lent GPU box with its own torch and no package index), run it
from the checkout: ``ln -s ../kernels lab/kernels`` (the mapping the installed package makes), then
``PYTHONPATH=. python3 evals/gpu_check.py --model <a copy of all-MiniLM-L6-v2>``; that is how
``evals/results/gpu_check/gpu_check_h200.csv`` was made (README).

This file is the command line and the run; its parts, in ``evals/``: ``gpu_check_harness`` (``Check``: the rows,
timings and tolerances), ``gpu_check_kernels`` (the attention, pooling, norms and rotary sections) and
``gpu_check_engine`` (the engine and decoder sections).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# after the path set-up: this runs as a script
from evals.gpu_check_engine import check_decoder, check_engine
from evals.gpu_check_harness import COLUMNS, Check
from evals.gpu_check_kernels import check_attention, check_norms, check_pooling, check_rotary

RESULTS = REPO / "evals" / "results" / "gpu_check"


# -------------------------------------------------------------------------------------------------------- main
def csv_text(rows: list[dict]) -> str:
    """The rows as CSV, ``COLUMNS`` in order."""
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows(rows)
    return text.getvalue()


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'section':<9} {'kernel':<16} {'provider':<22} {'dtype':<8} {'metric':<16} {'value':>11} "
        f"{'speedup':>8} {'ok':>5}  config"
    )
    for r in rows:
        ok = "" if r["ok"] == "" else ("PASS" if r["ok"] else "FAIL")
        speed = f"{float(r['speedup']):.2f}x" if r["speedup"] not in ("", None) else ""
        print(
            f"{r['section']:<9} {r['kernel'][:16]:<16} {r['provider'][:22]:<22} {r['dtype']:<8} "
            f"{r['metric'][:16]:<16} {str(r['value'])[:11]:>11} {speed:>8} {ok:>5}  {r['config'][:70]}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "csv", nargs="?", default=None, help="output CSV (default evals/results/gpu_check/gpu_check_<machine>.csv)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU + TRITON_INTERPRET=1, tiny shapes: exercises this script without a GPU",
    )
    parser.add_argument("--skip-engine", action="store_true", help="kernels only (no engine or decoder section)")
    parser.add_argument("--engine-texts", type=int, default=10000, help="texts per engine timing run")
    parser.add_argument("--st-batch-size", type=int, default=128, help="SentenceTransformer.encode batch size")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip further timings after this long")
    parser.add_argument(
        "--model",
        default=None,
        help="all-MiniLM-L6-v2 folder or hub id for the engine section (default: the bundled "
        "package's; a "
        "machine without that package, such as a lent GPU box, gets a copy)",
    )
    args = parser.parse_args(argv)

    if args.smoke:  # must precede the first `import triton` (sentence-transformers imports it too)
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            "evals/gpu_check.py needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). Run it on a CUDA machine, or use "
            "--smoke for a CPU dry run of the script under the Triton interpreter.",
            file=sys.stderr,
        )
        return 2
    from evals.results_index import device_slug, save_table

    device = "cpu" if args.smoke else "cuda"
    if args.csv is None:
        args.csv = str(RESULTS / f"gpu_check_{device_slug(device)}.csv")
    ck = Check(device, args.smoke, args.budget_s)
    dtypes = [torch.float16] if args.smoke else [torch.bfloat16, torch.float16]  # the interpreter lacks bf16 math
    torch.manual_seed(0)
    steps = [
        ("attention", lambda: check_attention(ck, dtypes)),
        ("pooling", lambda: check_pooling(ck, dtypes)),
        ("norms", lambda: check_norms(ck, dtypes)),
        ("rotary", lambda: check_rotary(ck, dtypes)),
    ]
    if not args.skip_engine:
        n = 8 if args.smoke else args.engine_texts
        steps.append(("engine", lambda: check_engine(ck, n, args.st_batch_size, args.model)))
        steps.append(("decoder", lambda: check_decoder(ck, args.model)))
    try:
        for name, step in steps:
            t = time.perf_counter()
            print(f"[{time.perf_counter() - ck.t0:6.1f}s] {name} ...", flush=True)
            with ck.guard(name, name):
                step()
            print(f"[{time.perf_counter() - ck.t0:6.1f}s] {name} done in {time.perf_counter() - t:.1f}s", flush=True)
    finally:
        save_table(Path(args.csv), csv_text(ck.rows))
    print_table(ck.rows)
    print(
        f"\nwrote {len(ck.rows)} rows to {args.csv} in {time.perf_counter() - ck.t0:.0f}s; "
        f"{'SOME CHECKS FAILED' if ck.failed else 'all correctness checks passed'}"
    )
    return 1 if ck.failed else 0


if __name__ == "__main__":
    sys.exit(main())
