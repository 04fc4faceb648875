"""The sections of ``evals/bench_decoder.py`` besides throughput (``decoder_throughput``): ``memory``
(``bench_memory``: each point of chunked prefill in a fresh ``bench_decoder.py --memory-point`` process, which runs
``memory_point``) and ``prefix`` (``bench_prefix``: the prefix cache on shared-instruction queries); the texts of
every section, the targets and the rows they add (``Table``)."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from evals.criteria import min_cosine
from evals.data_io import mixed_corpus, read_jsonl, scifact_text, spread
from lab.eval.bench import interleaved

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "evals" / "data"
SCRIPT = ROOT / "evals" / "bench_decoder.py"  # the command line, run with --memory-point for each memory point
TARGETS = {("throughput", "float32"): 2.0, ("throughput", "bfloat16"): 2.0, ("prefix", None): 2.5}  # issue 15

# ~130 tokens with SmolLM2's tokenizer; ends in a newline so the claim's first token never merges with it
INSTRUCTION = (
    "Instruct: You are given a scientific claim written by an expert annotator. Represent the claim so that it "
    "retrieves the abstracts of research papers that support or refute it. Pay attention to the biomedical "
    "entities it names (genes, proteins, cell types, tissues, diseases, drugs and patient populations), to the "
    "direction and the size of any effect it states, and to the experimental setting it implies, such as an in "
    "vitro assay, an animal model, a randomized clinical trial or an observational cohort. Ignore the wording and "
    "the style of the claim: what matters is the finding it asserts and the evidence that could confirm it.\n"
    "Claim:\n"
)

COLUMNS = [
    "run",
    "section",
    "corpus",
    "system",
    "dtype",
    "pooling",
    "setting",
    "metric",
    "value",
    "unit",
    "target",
    "meets_target",
    "seconds_median",
    "seconds_min",
    "seconds_max",
    "cpu_seconds_median",
    "tokens",
    "tokens_per_s",
    "texts",
    "repeats",
    "roofline_tokens_per_s",
    "roofline_fraction",
    "baseline_slowdown",
    "threads",
    "device",
    "torch",
    "transformers",
    "machine",
    "cpu_model",
    "cpu_flags",
    "cpu_paths",
    "malloc_tuning",
    "note",
]
# every engine here tunes glibc's allocator for its process (lab.runtime.allocator); the rows' malloc_tuning says
# whether the settings were in effect (off glibc, or on CUDA, they are not)
TUNE_ALLOCATOR = True


# ------------------------------------------------------------------------------------------------------- data


def scifact_docs(n: int | None = None) -> list[str]:
    docs = read_jsonl(DATA / "scifact" / "corpus.jsonl.gz")
    return [scifact_text(docs[i]) for i in spread(len(docs), n)]


def throughput_texts(corpus: str, n: int | None) -> list[str]:
    """The throughput section's texts: ``n`` evenly spaced texts of the ``mixed`` corpus (short sentences and long
    abstracts, ``evals.data_io.mixed_corpus``) or of the SciFact abstracts."""
    if corpus == "scifact":
        return scifact_docs(n)
    if corpus == "mixed":
        texts = mixed_corpus()
        return [texts[i] for i in spread(len(texts), n)]
    raise ValueError(f"unknown corpus {corpus!r}; valid: mixed, scifact")


def scifact_queries() -> list[str]:
    folder = DATA / "scifact"
    path = next((p for p in (folder / "queries.test.jsonl", folder / "queries.test.jsonl.gz") if p.exists()), None)
    if path is None:
        raise FileNotFoundError(f"no SciFact queries in {folder} (queries.test.jsonl[.gz])")
    return [q["text"] for q in read_jsonl(path)]


# ------------------------------------------------------------------------------------------------------ rows
class Table:
    def __init__(self, run: str, device: str):
        import torch
        import transformers

        self.rows: list[dict] = []
        from lab.ops.probes import cpu_info

        info = cpu_info()
        self.common = {
            "run": run,
            "device": device,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus",
            "threads": torch.get_num_threads(),
            "cpu_model": info["cpu_model"],
            "cpu_flags": info["cpu_flags"],
        }

    def add(
        self,
        section: str,
        system: str,
        metric: str,
        value=None,
        *,
        secs: list[float] | None = None,
        tokens: int | None = None,
        cpu: list[float] | None = None,
        **kw,
    ) -> dict:
        row = {c: None for c in COLUMNS}
        row.update(self.common, section=section, system=system, metric=metric, value=value, **kw)
        if secs:
            med = statistics.median(secs)
            row.update(seconds_median=med, seconds_min=min(secs), seconds_max=max(secs), repeats=len(secs))
            if tokens:
                row.update(tokens=tokens, tokens_per_s=tokens / med)
        elif tokens is not None:
            row["tokens"] = tokens
        if cpu:
            row["cpu_seconds_median"] = statistics.median(cpu)
        self.rows.append(row)
        return row

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows, columns=COLUMNS)


# ---------------------------------------------------------------------------------------------------- memory
def memory_point(spec: dict) -> dict:
    """Runs in a fresh subprocess: one long input through ``chunked_prefill=spec['chunk']``; peak memory and time."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    from lab import Engine
    from lab.runtime import memory

    length, chunk = spec["length"], spec["chunk"]
    eng = Engine(
        spec["path"],
        pooling="mean",
        max_length=length,
        dtype=spec["dtype"],
        device=spec["device"],
        chunked_prefill=chunk,
        tune_allocator=TUNE_ALLOCATOR,
    )
    # a text of more than `length` tokens, cut by the engine's truncation to exactly `length`
    text, n = "", 0
    docs = iter(scifact_docs())
    while n <= length:
        text += next(docs) + "\n\n"
        n = len(eng.tokenizer(text)["input_ids"])
    cuda = eng.device.type == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng.embed([text[:400]])  # warm-up on a short input: lazy initialization is not the run's memory
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_alloc = torch.cuda.memory_allocated()
        rss_before = memory.status_bytes("VmRSS")
        reset = memory.reset_peak()
        c0, t0 = time.process_time(), time.perf_counter()
        eng.embed([text])
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = dict(
        spec,
        seconds=secs,
        cpu_seconds=cpu,
        tokens=eng.stats.tokens,
        chunks=eng.stats.chunks,
        rss_before=rss_before,
        malloc_tuning=eng.resolved["malloc_tuning"],
        hwm=memory.status_bytes("VmHWM"),
        hwm_reset=reset,
        ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    out["state_bytes"] = eng.stats.state_bytes
    from lab.eval.bench import peak_memory

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["tensor_peak"] = peak_memory(lambda: eng.embed([text]))[1]
    if cuda:
        out["cuda_peak"] = torch.cuda.max_memory_allocated()
        out["cuda_base"] = base_alloc
    return out


def bench_memory(args, path: str, table: Table) -> None:
    import torch

    MB = 1 << 20
    for length in args.lengths:
        for chunk in args.chunks:
            spec = {
                "path": path,
                "length": length,
                "chunk": chunk,
                "dtype": args.memory_dtype,
                "device": args.device,
                "threads": torch.get_num_threads(),
            }
            proc = subprocess.run(
                [sys.executable, str(SCRIPT), "--memory-point", json.dumps(spec)],
                capture_output=True,
                text=True,
                cwd=str(ROOT),
                check=False,
            )
            line = next((ln for ln in proc.stdout.splitlines()[::-1] if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                table.add(
                    "memory",
                    "engine",
                    "error",
                    setting=f"length={length}, chunk={chunk}",
                    note=(proc.stderr.strip().splitlines() or ["?"])[-1][:200],
                )
                continue
            r = json.loads(line.removeprefix("RESULT "))
            common = {
                "dtype": args.memory_dtype,
                "pooling": "mean",
                "texts": 1,
                "malloc_tuning": r["malloc_tuning"],
                "setting": f"length={length}, chunked_prefill={chunk}",
            }
            table.add(
                "memory",
                "engine",
                "time",
                secs=[r["seconds"]],
                cpu=[r["cpu_seconds"]],
                tokens=r["tokens"],
                unit="s",
                **common,
                note=f"{r['chunks']} pieces",
            )
            if "cuda_peak" in r:
                table.add("memory", "engine", "peak_cuda_allocated_mb", r["cuda_peak"] / MB, unit="MB", **common)
                table.add(
                    "memory",
                    "engine",
                    "run_cuda_delta_mb",
                    (r["cuda_peak"] - r["cuda_base"]) / MB,
                    unit="MB",
                    **common,
                )
            if r["hwm_reset"]:
                table.add(
                    "memory",
                    "engine",
                    "peak_rss_mb",
                    r["hwm"] / MB,
                    unit="MB",
                    **common,
                    note="VmHWM after a reset at the start of the run",
                )
                table.add(
                    "memory",
                    "engine",
                    "run_rss_delta_mb",
                    (r["hwm"] - r["rss_before"]) / MB,
                    unit="MB",
                    **common,
                    note="VmHWM minus VmRSS at the start of the run (model loaded, warmed up)",
                )
            else:
                table.add(
                    "memory",
                    "engine",
                    "peak_rss_mb",
                    r["ru_maxrss"] / MB,
                    unit="MB",
                    **common,
                    note="ru_maxrss: process lifetime, includes model loading",
                )
            table.add("memory", "engine", "rss_before_run_mb", (r["rss_before"] or 0) / MB, unit="MB", **common)
            table.add(
                "memory",
                "engine",
                "peak_tensor_mb",
                r["tensor_peak"] / MB,
                unit="MB",
                **common,
                note="torch tensor memory above the loaded model, profiler memory events",
            )
            table.add(
                "memory",
                "engine",
                "state_mb",
                r["state_bytes"] / MB,
                unit="MB",
                **common,
                note="hidden states + one layer's K/V held across chunked-prefill steps",
            )
            peak = r["cuda_peak"] if "cuda_peak" in r else (r["hwm"] if r["hwm_reset"] else r["ru_maxrss"])
            print(
                f"  memory length {length:5d} chunk {chunk!s:>5s}: {r['seconds']:7.2f} s, peak "
                f"{peak / MB:7.0f} MB (+{((r['hwm'] or 0) - (r['rss_before'] or 0)) / MB:5.0f} MB over "
                f"idle), tensors {r['tensor_peak'] / MB:6.1f} MB, state {r['state_bytes'] / MB:6.1f} MB",
                flush=True,
            )


# ---------------------------------------------------------------------------------------------------- prefix
def bench_prefix(args, path: str, table: Table) -> None:
    from lab import Engine

    eng = Engine(
        path,
        max_length=args.max_length,
        device=args.device,
        dtype=args.prefix_dtype,
        instruction=INSTRUCTION,
        tune_allocator=TUNE_ALLOCATOR,
    )
    from lab.engine.inputs import InputProcessor

    # keep claims short enough that the instruction is >= 3/4 of every input (counted with EOS appended, the
    # longer of the two tokenizations, so it holds for every pooling)
    proc = InputProcessor(eng.tokenizer, eng.resolved.max_length, append_eos=True)
    n_instr = proc.instruction_length(INSTRUCTION)
    queries = scifact_queries()
    reqs = proc.process(queries, instruction=INSTRUCTION)
    kept = [q for q, r in zip(queries, reqs) if r.pool_start / r.length >= 0.75]
    kept = [kept[i] for i in spread(len(kept), args.queries)]
    for pooling in args.prefix_poolings:
        eng.configure(pooling=pooling)
        reqs = eng.tokenize(kept, instruction=INSTRUCTION)
        fractions = [r.pool_start / r.length for r in reqs]
        common = {
            "dtype": args.prefix_dtype,
            "pooling": pooling,
            "texts": len(kept),
            "malloc_tuning": eng.resolved["malloc_tuning"],
        }
        stats = {}

        def run(cache: bool, stats=stats):
            eng.configure(prefix_cache=cache)
            out = eng.embed(kept)
            stats[cache] = eng.stats
            return out

        res = interleaved(
            {"prefix_cache=True": lambda: run(True), "prefix_cache=False": lambda: run(False)},
            args.repeats,
            args.warmup,
        )
        eng.configure(prefix_cache=True)
        (c_secs, c_cpu, c_out), (p_secs, p_cpu, p_out) = res["prefix_cache=True"], res["prefix_cache=False"]
        table.add(
            "prefix",
            "engine",
            "instruction_fraction_min",
            min(fractions),
            **common,
            setting=f"instruction {n_instr} tokens",
            note=f"mean {statistics.mean(fractions):.3f}; {len(kept)} of {len(queries)} claims kept",
        )
        for cache, secs, cpu in ((True, c_secs, c_cpu), (False, p_secs, p_cpu)):
            st = stats[cache]
            table.add(
                "prefix",
                "engine",
                "time",
                secs=secs,
                cpu=cpu,
                tokens=st.tokens,
                unit="s",
                **common,
                setting=f"prefix_cache={cache}",
                note=f"tokens_computed {st.tokens_computed}, shared_prefix {st.shared_prefix}, path "
                f"{'kv-cache' if st.chunks else 'packed'}",
            )
        ratio = statistics.median(p_secs) / statistics.median(c_secs)
        target = TARGETS[("prefix", None)]
        table.add(
            "prefix",
            "engine",
            "speedup_prefix_cache",
            ratio,
            unit="x",
            target=target,
            meets_target=ratio >= target,
            **common,
            setting="prefix_cache=True vs False",
            note=f"token ratio {stats[False].tokens_computed / max(stats[True].tokens_computed, 1):.2f}",
        )
        table.add(
            "prefix",
            "engine",
            "speedup_prefix_cache_cpu_time",
            statistics.median(p_cpu) / statistics.median(c_cpu),
            unit="x",
            **common,
            setting="prefix_cache=True vs False",
            note="CPU seconds ratio",
        )
        cos = min_cosine(c_out, p_out)
        table.add(
            "prefix", "engine", "min_cosine_cache_vs_nocache", cos, **common, setting="prefix_cache=True vs False"
        )
        print(
            f"  prefix {pooling:9s}: cache {statistics.median(c_secs):6.2f} s, no cache "
            f"{statistics.median(p_secs):6.2f} s -> {ratio:.2f}x (shared prefix {stats[True].shared_prefix} of "
            f"{n_instr} instruction tokens; min cosine {cos:.6f})",
            flush=True,
        )
