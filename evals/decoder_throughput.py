"""The throughput section of ``evals/bench_decoder.py``: ``bench_throughput`` (the Engine against the padded
transformers embedder at each dtype, pooling and batch size, with the GEMM roofline at the decoder's shapes,
``decoder_roofline``, and the baseline's ``--self-check``) and ``--profile``'s op groups (``profile_call``, its op
tables kept in ``PROFILES``)."""

from __future__ import annotations

import statistics
import time
import warnings

from evals.criteria import COSINE_TARGET, cosine_note, meets_speed_target, min_cosine
from evals.decoder_sections import TARGETS, TUNE_ALLOCATOR, Table, throughput_texts
from evals.padded_transformers import PaddedTransformersEmbedder
from lab.eval.bench import interleaved

# the baseline's other batch size for ``--self-check`` (co-prime to 16: the padded batches fall differently)
SELF_CHECK_BATCH = 5
PROFILES: list[str] = []  # op tables of --profile, written to <name>_profile_<machine>.txt


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
