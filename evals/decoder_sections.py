"""The sections of ``evals/bench_decoder.py``: ``throughput`` (``bench_throughput``: the Engine against the padded
transformers embedder, with the GEMM roofline; ``--profile``: ``profile_call``'s op groups), ``memory``
(``bench_memory``: each point of chunked prefill in a fresh ``bench_decoder.py --memory-point`` process, which runs
``memory_point``) and ``prefix`` (``bench_prefix``: the prefix cache on shared-instruction queries); their texts,
targets and the rows they add (``Table``)."""

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

from evals.criteria import COSINE_TARGET, cosine_note, meets_speed_target, min_cosine
from evals.data_io import mixed_corpus, read_jsonl, scifact_text, spread
from evals.padded_transformers import PaddedTransformersEmbedder
from lab.eval.bench import interleaved

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "evals" / "data"
SCRIPT = ROOT / "evals" / "bench_decoder.py"  # the command line, run with --memory-point for each memory point
# the baseline's other batch size for ``--self-check`` (co-prime to 16: the padded batches fall differently)
SELF_CHECK_BATCH = 5
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

PROFILES: list[str] = []  # op tables of --profile, written to <name>_profile_<machine>.txt
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


# --------------------------------------------------------------------------------------------------- profile
GEMM_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::matmul",
    "aten::linear",
    "mkldnn::_linear_pointwise",
    "aten::_addmm_activation",
    "aten::mkldnn_linear",
)


def op_group(name: str) -> str:
    if name in GEMM_OPS or "linear_pointwise" in name or "gemm" in name.lower():
        return "gemm"
    if "scaled_dot_product" in name or "attention" in name.lower() or "flash" in name.lower():
        return "attention"
    return "other_ops"


def profile_call(fn, device: str) -> tuple[dict, str]:
    """One call under ``torch.profiler``: self time per op group (gemm / attention / other ops, seconds, summed
    over every thread that ran ops), the profiled call's wall seconds, and the op table (top 15 by self time).

    Every thread: the engine runs its steps in CPU worker threads, which a profiler started in the main thread does
    not see by default (its rows were all ~0 before). So an engine's groups are thread-seconds (its workers run side
    by side), a padded baseline's the wall time of ops that each use every intra-op thread: compare the groups'
    shares within one system, not seconds across systems."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    t0 = time.perf_counter()
    with profile(activities=acts, experimental_config=every_thread) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ka = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    groups = {"gemm": 0.0, "attention": 0.0, "other_ops": 0.0}
    for e in ka:
        groups[op_group(e.key)] += getattr(e, attr, 0.0) / 1e6
    groups["profiled_wall"] = wall
    return groups, ka.table(sort_by=attr, row_limit=15)


# ------------------------------------------------------------------------------------------------ throughput
def decoder_roofline(eng, dtype: str) -> dict:
    """``lab.eval.bench.gemm_roofline`` at a Llama-family decoder's projections (q/k/v with its key/value heads,
    output, gate, up, down), in the GEMM mode the engine's probes chose for ``dtype``."""
    import torch

    from lab.eval.bench import gemm_roofline

    a = eng.runner.model.args
    h, i = a.hidden_size, a.intermediate_size
    shapes = [
        (h, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim),
        (a.num_heads * a.head_dim, h),
        (h, i),
        (h, i),
        (i, h),
    ]
    return gemm_roofline(h, i, a.num_layers, dtype=getattr(torch, dtype), shapes=shapes, plan=eng.runner.plan)


def bench_throughput(args, path: str, table: Table) -> None:
    from lab import Engine

    texts = throughput_texts(args.corpus, args.docs)
    eng = Engine(
        path,
        max_length=args.max_length,
        device=args.device,
        dtype=args.dtypes[0],
        max_batch_tokens=args.max_batch_tokens,
        tune_allocator=TUNE_ALLOCATOR,
    )
    base = PaddedTransformersEmbedder(
        path, device=args.device, max_length=args.max_length, batch_size=args.batch_sizes[0], dtype=args.dtypes[0]
    )
    float32_out = {}  # pooling -> the float32 baseline's embeddings (first batch size), the reference of other dtypes
    for dtype in args.dtypes:
        eng.configure(dtype=dtype)  # the probes set this dtype's GEMM mode, which the roofline then times
        roof = decoder_roofline(eng, dtype)
        print(
            f"  GEMM roofline {dtype}: {roof['gemm_gflops']:.0f} GFLOP/s at the model's shapes -> "
            f"{roof['roofline_tokens_per_s']:.0f} tokens/s",
            flush=True,
        )
        for pooling in args.poolings:
            eng.configure(dtype=dtype, pooling=pooling)
            base.configure(dtype=dtype, pooling=pooling, append_eos=eng.resolved.append_eos)
            common = {
                "dtype": dtype,
                "pooling": pooling,
                "texts": len(texts),
                "corpus": args.corpus,
                "malloc_tuning": eng.resolved["malloc_tuning"],
            }
            # identical tokens: the Engine's own processor vs the baseline's tokenization
            reqs = eng.tokenize(texts)
            same = [list(r.ids) for r in reqs] == base.tokenize(texts)
            n_tokens = sum(r.length for r in reqs)
            table.add(
                "throughput",
                "check",
                "identical_tokens",
                bool(same),
                tokens=n_tokens,
                setting=f"max_length={args.max_length}, append_eos={eng.resolved.append_eos}",
                **common,
            )
            systems = {"engine": lambda: eng.embed(texts)}
            for bs in args.batch_sizes:
                systems[f"baseline{bs}"] = lambda bs=bs: base.configure(batch_size=bs)(texts)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # truncation notices
                # contamination check: each baseline timed alone first (before the engine runs on these texts)
                alone = interleaved({k: v for k, v in systems.items() if k != "engine"}, args.repeats, args.warmup)
                res = interleaved(systems, args.repeats, args.warmup)
            e_secs, e_cpu, e_out = res["engine"]
            e_tps = n_tokens / statistics.median(e_secs)
            table.add(
                "throughput",
                "engine",
                "time",
                secs=e_secs,
                cpu=e_cpu,
                tokens=eng.stats.tokens,
                unit="s",
                roofline_tokens_per_s=roof["roofline_tokens_per_s"],
                roofline_fraction=e_tps / roof["roofline_tokens_per_s"],
                setting=f"max_batch_tokens={eng.knobs['max_batch_tokens']}",
                **common,
                cpu_paths=";".join(f"{k}={v}" for k, v in eng.cpu_paths.items()),
                note=f"{eng.stats.batches} batches, padded {eng.stats.padded_tokens}",
            )
            best = None
            for bs in args.batch_sizes:
                b_secs, b_cpu, b_out = res[f"baseline{bs}"]
                base.configure(batch_size=bs)
                pad = base.padded_tokens(texts)
                alone_secs = statistics.median(alone[f"baseline{bs}"][0])
                table.add(
                    "throughput",
                    "padded-transformers",
                    "time",
                    secs=b_secs,
                    cpu=b_cpu,
                    tokens=n_tokens,
                    unit="s",
                    setting=f"batch_size={bs}",
                    **common,
                    baseline_slowdown=statistics.median(b_secs) / alone_secs,
                    note=f"padded tokens {pad} ({pad / n_tokens:.1%} of real); alone {alone_secs:.2f} s",
                )
                ratio = statistics.median(b_secs) / statistics.median(e_secs)
                target = TARGETS.get(("throughput", dtype))
                cos = min_cosine(e_out, b_out)
                table.add(
                    "throughput",
                    "engine",
                    "speedup_vs_baseline",
                    ratio,
                    unit="x",
                    setting=f"batch_size={bs}",
                    target=target,
                    meets_target=meets_speed_target(ratio, target, cos),
                    note=cosine_note(ratio, target, cos),
                    **common,
                )
                table.add(
                    "throughput",
                    "engine",
                    "speedup_vs_baseline_cpu_time",
                    statistics.median(b_cpu) / statistics.median(e_cpu),
                    unit="x",
                    setting=f"batch_size={bs}",
                    **common,
                    note="CPU seconds ratio (less sensitive to a shared machine)",
                )
                table.add(
                    "throughput",
                    "engine",
                    "min_cosine_vs_baseline",
                    cos,
                    target=COSINE_TARGET,
                    meets_target=cos >= COSINE_TARGET,
                    setting=f"batch_size={bs}",
                    **common,
                )
                if args.self_check:  # how well the baseline agrees with itself when only its batching changes
                    other = SELF_CHECK_BATCH if bs != SELF_CHECK_BATCH else bs + 1
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        again = base.configure(batch_size=other)(texts)
                    base.configure(batch_size=bs)
                    own = min_cosine(b_out, again)
                    table.add(
                        "throughput",
                        "padded-transformers",
                        "min_cosine_vs_itself_other_batch",
                        own,
                        target=COSINE_TARGET,
                        meets_target=own >= COSINE_TARGET,
                        setting=f"batch_size={bs} vs {other}",
                        **common,
                        note="the baseline against itself at another batch size (other padding, other GEMM "
                        "shapes): the agreement the cosine clause asks of the engine",
                    )
                if dtype == "float32":
                    float32_out.setdefault(pooling, b_out)
                elif pooling in float32_out:  # how far each system's low-precision rows are from float32 ones
                    for system, out in (("engine", e_out), ("padded-transformers", b_out)):
                        table.add(
                            "throughput",
                            system,
                            "min_cosine_vs_float32_baseline",
                            min_cosine(out, float32_out[pooling]),
                            setting=f"batch_size={bs}",
                            **common,
                            note="against the float32 baseline's rows (the same texts and pooling)",
                        )
                table.add(
                    "throughput",
                    "engine",
                    "speedup_ceiling_at_gemm_roofline",
                    statistics.median(b_secs) * roof["roofline_tokens_per_s"] / n_tokens,
                    unit="x",
                    setting=f"batch_size={bs}",
                    **common,
                    note="the baseline's time over the engine's if it ran only its GEMMs, at the measured "
                    "GEMM rate (attention and the rest free)",
                )
                if best is None or statistics.median(b_secs) < best[1]:
                    best = (bs, statistics.median(b_secs), cos)
                    b_cpu_best = b_cpu
            if args.profile:
                base.configure(batch_size=best[0])
                for name, fn in (("engine", lambda: eng.embed(texts)), ("padded-transformers", lambda: base(texts))):
                    groups, text = profile_call(fn, args.device)
                    for g, secs in groups.items():
                        table.add(
                            "profile",
                            name,
                            f"{g}_seconds",
                            secs,
                            unit="s",
                            **common,
                            setting=f"batch_size={best[0]}" if name != "engine" else "",
                            note="self time of the ops in this group under torch.profiler (one call), "
                            "summed over threads: the engine's CPU workers add up (profile_call)",
                        )
                    PROFILES.append(f"== {name}, {dtype}, {pooling}, {len(texts)} docs ==\n{text}")
            ratio = best[1] / statistics.median(e_secs)
            target = TARGETS.get(("throughput", dtype))
            table.add(
                "throughput",
                "engine",
                "speedup_vs_best_baseline",
                ratio,
                unit="x",
                target=target,
                meets_target=meets_speed_target(ratio, target, best[2]),
                note=cosine_note(ratio, target, best[2]),
                setting=f"batch_size={best[0]}",
                **common,
            )
            print(
                f"  throughput {dtype:8s} {pooling:9s} engine {statistics.median(e_secs):7.2f} s  "
                f"best baseline (batch {best[0]}) {best[1]:7.2f} s  -> {ratio:.2f}x "
                f"(CPU time {statistics.median(b_cpu_best) / statistics.median(e_cpu):.2f}x)",
                flush=True,
            )


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
