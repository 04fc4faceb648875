"""Decoder LLMs as embedders, benchmark part: SmolLM2-135M-Instruct through the Engine, in three sections.

1. ``throughput``: ``Engine.embed`` (packed, no padding) against a length-sorted padded transformers embedder (the
   way llm2vec embeds: ``AutoModel``, tokenizer padding, batches of ``--batch-sizes``, attention mask, pooling on
   the padded output) on ``--docs`` evenly spaced texts of ``--corpus``: ``mixed`` (the default; the held-out
   short sentences + long abstracts of ``evals.data_io.mixed_corpus``) or ``scifact`` (abstracts), pooling mean
   and lasttoken, float32 and bfloat16. Each baseline is first timed alone (the contamination check: its median
   alone vs interleaved with the engine is ``baseline_slowdown``), then both systems are timed in the same process
   with their repeats interleaved (median / min / max). Both systems see identical tokens: the baseline truncates
   and appends EOS exactly as the Engine's ``InputProcessor`` does (checked, and the result is a row). Reports
   tokens/s, the speed-up (baseline seconds / Engine seconds), the embeddings' minimum cosine agreement, the
   engine's share of the GEMM roofline (``lab.eval.bench.gemm_roofline`` at the decoder's projections, in the GEMM mode
   its probes chose) and the speed-up ceiling that roofline allows. Targets (issue 15): >= 2.0x in float32 and
   bfloat16, at a minimum cosine of 0.9999 against the same-dtype baseline (``meets_target`` requires both). In
   dtypes other than float32, each system's rows are also compared with the float32 baseline's
   (``min_cosine_vs_float32_baseline``): how far each one's rounding takes it. ``--self-check`` also runs the
   baseline at another batch size and records how well it agrees with itself
   (``min_cosine_vs_itself_other_batch``): the cosine clause's ceiling, since the engine cannot agree with the
   baseline better than the baseline agrees with itself.
2. ``memory``: chunked prefill of one long input (``--lengths`` tokens cut from concatenated SciFact abstracts)
   with ``chunked_prefill`` in ``--chunks``. Each point runs in a fresh subprocess: the model is loaded and warmed
   up, the kernel's RSS high-water mark is reset (``/proc/self/clear_refs``), the long input is embedded, and
   ``VmHWM`` is read (falling back to ``ru_maxrss``, which includes loading, where the reset is not allowed; on
   CUDA ``torch.cuda.max_memory_allocated``). A second, profiled run gives the peak of torch tensor memory
   (``lab.eval.bench.peak_memory``; exact, unlike RSS, which the allocator's retained heap blurs). Also the time and
   the state chunked prefill holds across steps (hidden states + one layer's K/V, ``lab.engine.kv_path``).
3. ``prefix``: queries that share a long instruction (>= 3/4 of every input's tokens; ~130-token instruction +
   SciFact claims) with ``prefix_cache=True`` vs ``False`` on one Engine: speed-up and cosine agreement. Target
   >= 2.5x.

Writes tidy rows (one per section x system x setting x metric; seconds median/min/max, CPU seconds and tokens/s
where timed; the run's ``run_date``) to ``--out`` (default ``evals/results/bench_decoder/<name>_<machine>.csv``,
``<name>`` from ``--name``, the machine ``evals.results_index.device_slug``: the CPU's, or the GPU's under
``--device cuda``), the command in ``<csv>.meta.json``, PNG plots next to it (``<name>_throughput_<machine>.png``,
``<name>_memory_<machine>.png``, ``<name>_prefix_<machine>.png``) and prints a summary. ``--profile`` adds one
``torch.profiler`` call per system and setting: rows with the self time of GEMMs / attention / other ops, and the op
tables in ``<name>_profile_<machine>.txt``. ``--smoke`` shrinks everything (a few docs, one repeat, short inputs) and
names the files ``bench_decoder_smoke_*``; every row carries ``run`` (``smoke`` / ``full`` / ``--label``). Every engine here
is created with ``tune_allocator=True`` (``lab.runtime.allocator``; the memory section's RSS includes the heap it
keeps), and the section rows' ``malloc_tuning`` says whether the settings were in effect.

Sizes: the defaults embed ~40k tokens per system run (128 abstracts at max_length 512), 3 systems x 2 dtypes x 2
poolings x (1 warm-up + 3 repeats) in the throughput section: about 1.9M tokens, tens of minutes on a 2-core CPU.
The padding the baseline pays depends on how many texts are sorted together (7.5% of real tokens at 128 abstracts
and batch 16, 1.9% at 512): it is in each baseline row's note.

    python evals/bench_decoder.py                                          # all sections, default sizes
    python evals/bench_decoder.py --sections throughput --docs 128 --repeats 5 --dtypes float32 bfloat16 --profile
    python evals/bench_decoder.py --sections memory --lengths 1024 2048 4096 8192 --chunks none 256 1024
    python evals/bench_decoder.py --sections prefix --queries 300 --repeats 5
    python evals/bench_decoder.py --smoke                                  # a few minutes on a small CPU
"""

from __future__ import annotations

import argparse
import copy
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# after the path set-up: this runs as a script
from evals.criteria import COSINE_TARGET, cosine_note, meets_speed_target, min_cosine
from evals.data_io import mixed_corpus, read_jsonl, scifact_text, spread
from evals.results_index import companion, device_slug, save_file, save_table, stamp
from lab.eval.bench import interleaved
from lab.models.hub import local_folder

DATA = ROOT / "evals" / "data"
RESULTS = ROOT / "evals" / "results"
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
    "run", "section", "corpus", "system", "dtype", "pooling", "setting", "metric", "value", "unit", "target",
    "meets_target", "seconds_median", "seconds_min", "seconds_max", "cpu_seconds_median", "tokens", "tokens_per_s",
    "texts", "repeats", "roofline_tokens_per_s", "roofline_fraction", "baseline_slowdown",
    "threads", "device", "torch", "transformers", "machine", "cpu_model", "cpu_flags", "cpu_paths", "malloc_tuning",
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


def model_path(arg: str | None) -> str:
    """The model folder: ``arg`` (a folder, or a hub id resolved to its snapshot folder), else SmolLM2's."""
    if arg:
        return local_folder(arg)
    from lab.models.gguf import smollm2_path

    return str(smollm2_path())


# --------------------------------------------------------------------------------------------------- baseline
class PaddedTransformersEmbedder:
    """The length-sorted padded transformers embedder (what llm2vec does), as a benchmark system.

    ``AutoModel`` (transformers' own attention, ``sdpa`` by default) over right-padded batches of ``batch_size``
    texts sorted longest first, with an attention mask; mean pooling masks the padding, lasttoken takes each row's
    last real token. The model is loaded in float32 and kept: another dtype runs a cast copy of it, so switching
    back to float32 runs the loaded weights again, not weights rounded by a trip through bfloat16. Tokenization
    matches ``lab.engine.inputs.InputProcessor``: truncation at ``max_length`` (one token less when EOS is appended), then
    EOS appended unless the text already ends with it. Returns float32 numpy rows in input order (not normalized;
    compare by cosine).
    """

    def __init__(self, path: str, *, batch_size: int = 16, dtype: str = "float32", device: str = "cpu",
                 pooling: str = "mean", max_length: int = 512, append_eos: bool = False):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.float32_model = AutoModel.from_pretrained(path, dtype=torch.float32).eval().to(device)
        self.model = self.float32_model
        self.device = torch.device(device)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        self.batch_size, self.max_length = batch_size, max_length
        self.dtype = None
        self.configure(dtype=dtype, pooling=pooling, append_eos=append_eos)

    def configure(self, *, dtype: str | None = None, pooling: str | None = None, append_eos: bool | None = None,
                  batch_size: int | None = None) -> PaddedTransformersEmbedder:
        if dtype is not None and dtype != self.dtype:
            self.model = self.float32_model  # the previous cast copy (if any) is freed
            if dtype != "float32":
                self.model = copy.deepcopy(self.float32_model).to(getattr(self.torch, dtype))
            self.dtype = dtype
        if pooling is not None:
            if pooling not in ("mean", "lasttoken"):
                raise ValueError(f"baseline pooling must be mean or lasttoken, got {pooling!r}")
            self.pooling = pooling
        if append_eos is not None:
            self.append_eos = append_eos and self.tokenizer.eos_token_id is not None
        if batch_size is not None:
            self.batch_size = batch_size
        return self

    @property
    def name(self) -> str:
        return f"padded transformers (batch {self.batch_size})"

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        limit = self.max_length - 1 if self.append_eos else self.max_length
        ids = self.tokenizer(texts, truncation=True, max_length=limit, return_attention_mask=False)["input_ids"]
        if self.append_eos:
            eos = self.tokenizer.eos_token_id
            ids = [x if x and x[-1] == eos else x + [eos] for x in ids]
        return ids

    def padded_tokens(self, texts: list[str]) -> int:
        lengths = sorted((len(x) for x in self.tokenize(texts)), reverse=True)
        b = self.batch_size
        return sum(lengths[i] * len(lengths[i : i + b]) - sum(lengths[i : i + b]) for i in range(0, len(lengths), b))

    def __call__(self, texts: list[str]):
        import numpy as np

        torch = self.torch
        ids = self.tokenize(texts)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = np.empty((len(ids), self.model.config.hidden_size), dtype=np.float32)
        with torch.inference_mode():
            for s in range(0, len(order), self.batch_size):
                rows = order[s : s + self.batch_size]
                lengths = [len(ids[i]) for i in rows]
                width = max(lengths)
                input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for j, i in enumerate(rows):
                    input_ids[j, : lengths[j]] = torch.tensor(ids[i])
                    mask[j, : lengths[j]] = 1
                input_ids, mask = input_ids.to(self.device), mask.to(self.device)
                hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
                if self.pooling == "mean":
                    m = mask.unsqueeze(-1).float()
                    pooled = (hidden.float() * m).sum(1) / m.sum(1)
                else:
                    last = torch.tensor(lengths, device=self.device) - 1
                    pooled = hidden[torch.arange(len(rows), device=self.device), last].float()
                out[rows] = pooled.cpu().numpy()
        return out


# ------------------------------------------------------------------------------------------------------ rows
class Table:
    def __init__(self, run: str, device: str):
        import torch
        import transformers

        self.rows: list[dict] = []
        from lab.ops.probes import cpu_info

        info = cpu_info()
        self.common = {"run": run, "device": device, "torch": torch.__version__,
                       "transformers": transformers.__version__,
                       "machine": f"{platform.machine()} {os.cpu_count()} cpus", "threads": torch.get_num_threads(),
                       "cpu_model": info["cpu_model"], "cpu_flags": info["cpu_flags"]}

    def add(self, section: str, system: str, metric: str, value=None, *, secs: list[float] | None = None,
            tokens: int | None = None, cpu: list[float] | None = None, **kw) -> dict:
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
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise",
            "aten::_addmm_activation", "aten::mkldnn_linear")


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
    """``lab.eval.bench.gemm_roofline`` at a Llama-family decoder's projections (q/k/v with its key/value heads, output,
    gate, up, down), in the GEMM mode the engine's probes chose for ``dtype``."""
    import torch

    from lab.eval.bench import gemm_roofline

    a = eng.runner.model.args
    h, i = a.hidden_size, a.intermediate_size
    shapes = [(h, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim), (a.num_heads * a.head_dim, h), (h, i), (h, i),
              (i, h)]
    return gemm_roofline(h, i, a.num_layers, dtype=getattr(torch, dtype), shapes=shapes, plan=eng.runner.plan)


def bench_throughput(args, path: str, table: Table) -> None:
    from lab import Engine

    texts = throughput_texts(args.corpus, args.docs)
    eng = Engine(path, max_length=args.max_length, device=args.device, dtype=args.dtypes[0],
                 max_batch_tokens=args.max_batch_tokens, tune_allocator=TUNE_ALLOCATOR)
    base = PaddedTransformersEmbedder(path, device=args.device, max_length=args.max_length,
                                      batch_size=args.batch_sizes[0], dtype=args.dtypes[0])
    float32_out = {}  # pooling -> the float32 baseline's embeddings (first batch size), the reference of other dtypes
    for dtype in args.dtypes:
        eng.configure(dtype=dtype)  # the probes set this dtype's GEMM mode, which the roofline then times
        roof = decoder_roofline(eng, dtype)
        print(f"  GEMM roofline {dtype}: {roof['gemm_gflops']:.0f} GFLOP/s at the model's shapes -> "
              f"{roof['roofline_tokens_per_s']:.0f} tokens/s", flush=True)
        for pooling in args.poolings:
            eng.configure(dtype=dtype, pooling=pooling)
            base.configure(dtype=dtype, pooling=pooling, append_eos=eng.append_eos)
            common = {"dtype": dtype, "pooling": pooling, "texts": len(texts), "corpus": args.corpus,
                      "malloc_tuning": eng.resolved["malloc_tuning"]}
            # identical tokens: the Engine's own processor vs the baseline's tokenization
            reqs = eng.tokenize(texts)
            same = [list(r.ids) for r in reqs] == base.tokenize(texts)
            n_tokens = sum(r.length for r in reqs)
            table.add("throughput", "check", "identical_tokens", bool(same), tokens=n_tokens,
                      setting=f"max_length={args.max_length}, append_eos={eng.append_eos}", **common)
            systems = {"engine": lambda: eng.embed(texts)}
            for bs in args.batch_sizes:
                systems[f"baseline{bs}"] = (lambda bs=bs: base.configure(batch_size=bs)(texts))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # truncation notices
                # contamination check: each baseline timed alone first (before the engine runs on these texts)
                alone = interleaved({k: v for k, v in systems.items() if k != "engine"}, args.repeats, args.warmup)
                res = interleaved(systems, args.repeats, args.warmup)
            e_secs, e_cpu, e_out = res["engine"]
            e_tps = n_tokens / statistics.median(e_secs)
            table.add("throughput", "engine", "time", secs=e_secs, cpu=e_cpu, tokens=eng.stats.tokens, unit="s",
                      roofline_tokens_per_s=roof["roofline_tokens_per_s"],
                      roofline_fraction=e_tps / roof["roofline_tokens_per_s"],
                      setting=f"max_batch_tokens={eng.knobs['max_batch_tokens']}", **common,
                      cpu_paths=";".join(f"{k}={v}" for k, v in eng.cpu_paths.items()),
                      note=f"{eng.stats.batches} batches, padded {eng.stats.padded_tokens}")
            best = None
            for bs in args.batch_sizes:
                b_secs, b_cpu, b_out = res[f"baseline{bs}"]
                base.configure(batch_size=bs)
                pad = base.padded_tokens(texts)
                alone_secs = statistics.median(alone[f"baseline{bs}"][0])
                table.add("throughput", "padded-transformers", "time", secs=b_secs, cpu=b_cpu, tokens=n_tokens,
                          unit="s", setting=f"batch_size={bs}", **common,
                          baseline_slowdown=statistics.median(b_secs) / alone_secs,
                          note=f"padded tokens {pad} ({pad / n_tokens:.1%} of real); alone {alone_secs:.2f} s")
                ratio = statistics.median(b_secs) / statistics.median(e_secs)
                target = TARGETS.get(("throughput", dtype))
                cos = min_cosine(e_out, b_out)
                table.add("throughput", "engine", "speedup_vs_baseline", ratio, unit="x", setting=f"batch_size={bs}",
                          target=target, meets_target=meets_speed_target(ratio, target, cos),
                          note=cosine_note(ratio, target, cos), **common)
                table.add("throughput", "engine", "speedup_vs_baseline_cpu_time",
                          statistics.median(b_cpu) / statistics.median(e_cpu), unit="x", setting=f"batch_size={bs}",
                          **common, note="CPU seconds ratio (less sensitive to a shared machine)")
                table.add("throughput", "engine", "min_cosine_vs_baseline", cos, target=COSINE_TARGET,
                          meets_target=cos >= COSINE_TARGET, setting=f"batch_size={bs}", **common)
                if args.self_check:  # how well the baseline agrees with itself when only its batching changes
                    other = SELF_CHECK_BATCH if bs != SELF_CHECK_BATCH else bs + 1
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        again = base.configure(batch_size=other)(texts)
                    base.configure(batch_size=bs)
                    own = min_cosine(b_out, again)
                    table.add("throughput", "padded-transformers", "min_cosine_vs_itself_other_batch", own,
                              target=COSINE_TARGET, meets_target=own >= COSINE_TARGET,
                              setting=f"batch_size={bs} vs {other}", **common,
                              note="the baseline against itself at another batch size (other padding, other GEMM "
                                   "shapes): the agreement the cosine clause asks of the engine")
                if dtype == "float32":
                    float32_out.setdefault(pooling, b_out)
                elif pooling in float32_out:  # how far each system's low-precision rows are from float32 ones
                    for system, out in (("engine", e_out), ("padded-transformers", b_out)):
                        table.add("throughput", system, "min_cosine_vs_float32_baseline",
                                  min_cosine(out, float32_out[pooling]), setting=f"batch_size={bs}", **common,
                                  note="against the float32 baseline's rows (the same texts and pooling)")
                table.add("throughput", "engine", "speedup_ceiling_at_gemm_roofline",
                          statistics.median(b_secs) * roof["roofline_tokens_per_s"] / n_tokens, unit="x",
                          setting=f"batch_size={bs}", **common,
                          note="the baseline's time over the engine's if it ran only its GEMMs, at the measured "
                               "GEMM rate (attention and the rest free)")
                if best is None or statistics.median(b_secs) < best[1]:
                    best = (bs, statistics.median(b_secs), cos)
                    b_cpu_best = b_cpu
            if args.profile:
                base.configure(batch_size=best[0])
                for name, fn in (("engine", lambda: eng.embed(texts)), ("padded-transformers", lambda: base(texts))):
                    groups, text = profile_call(fn, args.device)
                    for g, secs in groups.items():
                        table.add("profile", name, f"{g}_seconds", secs, unit="s", **common,
                                  setting=f"batch_size={best[0]}" if name != "engine" else "",
                                  note="self time of the ops in this group under torch.profiler (one call), "
                                       "summed over threads: the engine's CPU workers add up (profile_call)")
                    PROFILES.append(f"== {name}, {dtype}, {pooling}, {len(texts)} docs ==\n{text}")
            ratio = best[1] / statistics.median(e_secs)
            target = TARGETS.get(("throughput", dtype))
            table.add("throughput", "engine", "speedup_vs_best_baseline", ratio, unit="x", target=target,
                      meets_target=meets_speed_target(ratio, target, best[2]),
                      note=cosine_note(ratio, target, best[2]), setting=f"batch_size={best[0]}", **common)
            print(f"  throughput {dtype:8s} {pooling:9s} engine {statistics.median(e_secs):7.2f} s  "
                  f"best baseline (batch {best[0]}) {best[1]:7.2f} s  -> {ratio:.2f}x "
                  f"(CPU time {statistics.median(b_cpu_best) / statistics.median(e_cpu):.2f}x)", flush=True)


# ---------------------------------------------------------------------------------------------------- memory
def memory_point(spec: dict) -> dict:
    """Runs in a fresh subprocess: one long input through ``chunked_prefill=spec['chunk']``; peak memory and time."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    from lab import Engine
    from lab.runtime import memory

    length, chunk = spec["length"], spec["chunk"]
    eng = Engine(spec["path"], pooling="mean", max_length=length, dtype=spec["dtype"], device=spec["device"],
                 chunked_prefill=chunk, tune_allocator=TUNE_ALLOCATOR)
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
    out = dict(spec, seconds=secs, cpu_seconds=cpu, tokens=eng.stats.tokens, chunks=eng.stats.chunks,
               rss_before=rss_before, malloc_tuning=eng.resolved["malloc_tuning"],
               hwm=memory.status_bytes("VmHWM"), hwm_reset=reset,
               ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
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
            spec = {"path": path, "length": length, "chunk": chunk, "dtype": args.memory_dtype,
                    "device": args.device, "threads": torch.get_num_threads()}
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--memory-point", json.dumps(spec)],
                                  capture_output=True, text=True, cwd=str(ROOT), check=False)
            line = next((ln for ln in proc.stdout.splitlines()[::-1] if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                table.add("memory", "engine", "error", setting=f"length={length}, chunk={chunk}",
                          note=(proc.stderr.strip().splitlines() or ["?"])[-1][:200])
                continue
            r = json.loads(line.removeprefix("RESULT "))
            common = {"dtype": args.memory_dtype, "pooling": "mean", "texts": 1, "malloc_tuning": r["malloc_tuning"],
                      "setting": f"length={length}, chunked_prefill={chunk}"}
            table.add("memory", "engine", "time", secs=[r["seconds"]], cpu=[r["cpu_seconds"]], tokens=r["tokens"],
                      unit="s", **common,
                      note=f"{r['chunks']} pieces")
            if "cuda_peak" in r:
                table.add("memory", "engine", "peak_cuda_allocated_mb", r["cuda_peak"] / MB, unit="MB", **common)
                table.add("memory", "engine", "run_cuda_delta_mb", (r["cuda_peak"] - r["cuda_base"]) / MB,
                          unit="MB", **common)
            if r["hwm_reset"]:
                table.add("memory", "engine", "peak_rss_mb", r["hwm"] / MB, unit="MB", **common,
                          note="VmHWM after a reset at the start of the run")
                table.add("memory", "engine", "run_rss_delta_mb", (r["hwm"] - r["rss_before"]) / MB, unit="MB",
                          **common, note="VmHWM minus VmRSS at the start of the run (model loaded, warmed up)")
            else:
                table.add("memory", "engine", "peak_rss_mb", r["ru_maxrss"] / MB, unit="MB", **common,
                          note="ru_maxrss: process lifetime, includes model loading")
            table.add("memory", "engine", "rss_before_run_mb", (r["rss_before"] or 0) / MB, unit="MB", **common)
            table.add("memory", "engine", "peak_tensor_mb", r["tensor_peak"] / MB, unit="MB", **common,
                      note="torch tensor memory above the loaded model, profiler memory events")
            table.add("memory", "engine", "state_mb", r["state_bytes"] / MB, unit="MB", **common,
                      note="hidden states + one layer's K/V held across chunked-prefill steps")
            peak = r["cuda_peak"] if "cuda_peak" in r else (r["hwm"] if r["hwm_reset"] else r["ru_maxrss"])
            print(f"  memory length {length:5d} chunk {chunk!s:>5s}: {r['seconds']:7.2f} s, peak "
                  f"{peak / MB:7.0f} MB (+{((r['hwm'] or 0) - (r['rss_before'] or 0)) / MB:5.0f} MB over "
                  f"idle), tensors {r['tensor_peak'] / MB:6.1f} MB, state {r['state_bytes'] / MB:6.1f} MB",
                  flush=True)


# ---------------------------------------------------------------------------------------------------- prefix
def bench_prefix(args, path: str, table: Table) -> None:
    from lab import Engine

    eng = Engine(path, max_length=args.max_length, device=args.device, dtype=args.prefix_dtype,
                 instruction=INSTRUCTION, tune_allocator=TUNE_ALLOCATOR)
    from lab.engine.inputs import InputProcessor

    # keep claims short enough that the instruction is >= 3/4 of every input (counted with EOS appended, the
    # longer of the two tokenizations, so it holds for every pooling)
    proc = InputProcessor(eng.tokenizer, eng.max_length, append_eos=True)
    n_instr = proc.instruction_length(INSTRUCTION)
    queries = scifact_queries()
    reqs = proc.process(queries, instruction=INSTRUCTION)
    kept = [q for q, r in zip(queries, reqs) if r.pool_start / r.length >= 0.75]
    kept = [kept[i] for i in spread(len(kept), args.queries)]
    for pooling in args.prefix_poolings:
        eng.configure(pooling=pooling)
        reqs = eng.tokenize(kept, instruction=INSTRUCTION)
        fractions = [r.pool_start / r.length for r in reqs]
        common = {"dtype": args.prefix_dtype, "pooling": pooling, "texts": len(kept),
                  "malloc_tuning": eng.resolved["malloc_tuning"]}
        stats = {}

        def run(cache: bool, stats=stats):
            eng.configure(prefix_cache=cache)
            out = eng.embed(kept)
            stats[cache] = eng.stats
            return out

        res = interleaved({"prefix_cache=True": lambda: run(True), "prefix_cache=False": lambda: run(False)},
                          args.repeats, args.warmup)
        eng.configure(prefix_cache=True)
        (c_secs, c_cpu, c_out), (p_secs, p_cpu, p_out) = res["prefix_cache=True"], res["prefix_cache=False"]
        table.add("prefix", "engine", "instruction_fraction_min", min(fractions), **common,
                  setting=f"instruction {n_instr} tokens",
                  note=f"mean {statistics.mean(fractions):.3f}; {len(kept)} of {len(queries)} claims kept")
        for cache, secs, cpu in ((True, c_secs, c_cpu), (False, p_secs, p_cpu)):
            st = stats[cache]
            table.add("prefix", "engine", "time", secs=secs, cpu=cpu, tokens=st.tokens, unit="s", **common,
                      setting=f"prefix_cache={cache}",
                      note=f"tokens_computed {st.tokens_computed}, shared_prefix {st.shared_prefix}, path "
                           f"{'kv-cache' if st.chunks else 'packed'}")
        ratio = statistics.median(p_secs) / statistics.median(c_secs)
        target = TARGETS[("prefix", None)]
        table.add("prefix", "engine", "speedup_prefix_cache", ratio, unit="x", target=target,
                  meets_target=ratio >= target, **common, setting="prefix_cache=True vs False",
                  note=f"token ratio {stats[False].tokens_computed / max(stats[True].tokens_computed, 1):.2f}")
        table.add("prefix", "engine", "speedup_prefix_cache_cpu_time",
                  statistics.median(p_cpu) / statistics.median(c_cpu), unit="x", **common,
                  setting="prefix_cache=True vs False", note="CPU seconds ratio")
        cos = min_cosine(c_out, p_out)
        table.add("prefix", "engine", "min_cosine_cache_vs_nocache", cos, **common,
                  setting="prefix_cache=True vs False")
        print(f"  prefix {pooling:9s}: cache {statistics.median(c_secs):6.2f} s, no cache "
              f"{statistics.median(p_secs):6.2f} s -> {ratio:.2f}x (shared prefix {stats[True].shared_prefix} of "
              f"{n_instr} instruction tokens; min cosine {cos:.6f})", flush=True)


# ------------------------------------------------------------------------------------------------------ plots
def plot(df, csv_path: Path, slug: str | None = None) -> list[Path]:
    """The sections' plots beside ``csv_path`` (``evals.results_index.companion``: ``<name>_<kind>_<slug>.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(kind: str) -> None:  # the current figure, then closed
        written.append(save_file(companion(csv_path, kind, "png", slug), plt.gcf()))
        plt.close()

    run = df["run"].iloc[0] if len(df) else ""
    tp = df[(df.section == "throughput") & (df.metric == "time")]
    if len(tp):
        tp = tp.assign(label=tp.system + " " + tp.setting.str.replace("max_batch_tokens=", "tokens ").str.replace(
            "batch_size=", "batch "), group=tp.dtype + "\n" + tp.pooling)
        pivot = tp.pivot_table(index="group", columns="label", values="tokens_per_s", sort=False)
        ax = pivot.plot.bar(rot=0, figsize=(8, 4.5))
        ax.set_ylabel("tokens / s (median)")
        ax.set_xlabel("")
        corpus = {"scifact": "SciFact abstracts", "mixed": "mixed texts"}.get(tp.corpus.iloc[0], tp.corpus.iloc[0])
        ax.set_title(f"SmolLM2-135M on {corpus}: Engine vs padded transformers\n({run})", fontsize=10)
        speed = df[(df.section == "throughput") & (df.metric == "speedup_vs_best_baseline")]
        for i, group in enumerate(pivot.index):
            r = speed[(speed.dtype + "\n" + speed.pooling) == group]
            if len(r):
                ax.annotate(f"{float(r.value.iloc[0]):.2f}x", (i, pivot.loc[group].max()), ha="center",
                            va="bottom", fontsize=9, xytext=(0, 3), textcoords="offset points")
        plt.tight_layout()
        save("throughput")
    mem = df[df.section == "memory"]
    if len(mem):
        m = mem.assign(length=mem.setting.str.extract(r"length=(\d+)")[0].astype(int),
                       chunk=mem.setting.str.extract(r"chunked_prefill=(\w+)")[0])
        peak_metric = next((x for x in ("run_cuda_delta_mb", "peak_tensor_mb", "run_rss_delta_mb", "peak_rss_mb")
                            if (m.metric == x).any()), "peak_rss_mb")
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
        for chunk, g in m.groupby("chunk", sort=False):
            label = "off" if chunk == "None" else chunk
            for ax, metric, col in ((axes[0], peak_metric, "value"), (axes[1], "run_rss_delta_mb", "value"),
                                    (axes[2], "time", "seconds_median")):
                s = g[g.metric == metric].sort_values("length")
                ax.plot(s.length, s[col], marker="o", label=f"chunked_prefill={label}")
        title0 = {"peak_tensor_mb": "peak tensor memory above the loaded model",
                  "run_cuda_delta_mb": "peak CUDA memory above the loaded model"}.get(peak_metric, "peak memory")
        for ax, title, ylabel in ((axes[0], title0, "MB (" + peak_metric + ")"),
                                  (axes[1], "RSS high-water mark above idle", "MB"), (axes[2], "time", "seconds")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(m.length.unique()), [str(x) for x in sorted(m.length.unique())])
            ax.set_xlabel("input length (tokens)")
            ax.set_title(title)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"SmolLM2-135M, one long input, chunked prefill ({run})", fontsize=11)
        plt.tight_layout()
        save("memory")
    pre = df[(df.section == "prefix") & (df.metric == "time")]
    if len(pre):
        pivot = pre.pivot_table(index="pooling", columns="setting", values="seconds_median", sort=False)
        ax = pivot.plot.bar(rot=0, figsize=(6, 4))
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"shared-instruction queries: prefix cache\n({run})", fontsize=10)
        ax.legend(title="setting", loc="upper left", fontsize=8)
        plt.tight_layout()
        save("prefix")
    return written


def summary(df) -> str:
    import pandas as pd

    keep = df[df.metric.isin(["time", "speedup_vs_baseline", "speedup_vs_best_baseline", "min_cosine_vs_baseline",
                              "min_cosine_vs_float32_baseline", "min_cosine_vs_itself_other_batch",
                              "speedup_vs_baseline_cpu_time",
                              "speedup_prefix_cache_cpu_time",
                              "identical_tokens", "peak_rss_mb", "run_rss_delta_mb", "peak_cuda_allocated_mb",
                              "peak_tensor_mb", "state_mb", "speedup_prefix_cache", "min_cosine_cache_vs_nocache",
                              "instruction_fraction_min", "gemm_seconds", "attention_seconds",
                              "other_ops_seconds", "profiled_wall_seconds", "speedup_ceiling_at_gemm_roofline"])]
    cols = ["section", "system", "dtype", "pooling", "setting", "metric", "value", "target", "meets_target",
            "seconds_median", "cpu_seconds_median", "tokens_per_s", "roofline_fraction", "baseline_slowdown"]
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 40,
                           "display.float_format", "{:.4g}".format):
        return keep[cols].to_string(index=False)


# ------------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, 
                    help="model folder or hub id (org/name[@revision]; default: the cached SmolLM2-135M-Instruct)")
    ap.add_argument("--sections", nargs="+", default=["throughput", "memory", "prefix"],
                    choices=["throughput", "memory", "prefix"])
    ap.add_argument("--corpus", default="mixed", choices=["mixed", "scifact"],
                    help="throughput texts: the held-out mixed corpus (short sentences + long abstracts) or SciFact")
    ap.add_argument("--docs", type=int, default=None, help="throughput texts, evenly spaced (default 128)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per system (median; default 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--poolings", nargs="+", default=["mean", "lasttoken"], choices=["mean", "lasttoken"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=None, help="baseline batch sizes (default 16 32)")
    ap.add_argument("--max-batch-tokens", type=int, default=16384, help="throughput: the Engine's token budget")
    ap.add_argument("--max-length", type=int, default=None, help="throughput / prefix max_length (default 512)")
    ap.add_argument("--lengths", nargs="+", type=int, default=None, help="memory: input lengths (1024..8192)")
    ap.add_argument("--chunks", nargs="+", default=None, help="memory: chunked_prefill values, 'none' = off")
    ap.add_argument("--memory-dtype", default="float32")
    ap.add_argument("--queries", type=int, default=None, help="prefix: SciFact claims (default all that qualify)")
    ap.add_argument("--prefix-poolings", nargs="+", default=["mean", "lasttoken"], choices=["mean", "lasttoken"])
    ap.add_argument("--prefix-dtype", default="float32")
    ap.add_argument("--profile", action="store_true",
                    help="throughput: also profile one call of each system (op-group rows + <name>_profile_<machine>.txt)")
    ap.add_argument("--self-check", action="store_true",
                    help="throughput: also run the baseline at another batch size (untimed) and record how well it "
                         "agrees with itself (min_cosine_vs_itself_other_batch)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script (run label 'smoke')")
    ap.add_argument("--out", type=Path, default=None,
                    help="CSV path (default evals/results/bench_decoder/<name>_<machine>.csv)")
    ap.add_argument("--name", default=None,
                    help="the files' name before the machine (default bench_decoder, bench_decoder_smoke with --smoke)")
    ap.add_argument("--label", default=None, help="the rows' run label (default 'smoke' with --smoke, else 'full')")
    ap.add_argument("--memory-point", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    small = args.smoke
    defaults = {"docs": (6, 128), "repeats": (1, 3), "batch_sizes": ([16], [16, 32]), "max_length": (256, 512),
                "lengths": ([256, 512, 1024], [1024, 2048, 4096, 8192]),
                "chunks": (["none", "128", "512"], ["none", "256", "1024"]), "queries": (32, None)}
    for k, (s, f) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, s if small else f)
    args.chunks = [None if str(c).lower() in ("none", "off", "0") else int(c) for c in args.chunks]
    args.slug = device_slug(args.device)
    if args.out is None:
        name = args.name or ("bench_decoder_smoke" if small else "bench_decoder")
        args.out = RESULTS / "bench_decoder" / f"{name}_{args.slug}.csv"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_point:
        print("RESULT " + json.dumps(memory_point(json.loads(args.memory_point))), flush=True)
        return 0
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_path(args.model)
    table = Table(args.label or ("smoke" if args.smoke else "full"), args.device)
    t0 = time.perf_counter()
    for section in args.sections:
        print(f"[{section}]", flush=True)
        {"throughput": bench_throughput, "memory": bench_memory, "prefix": bench_prefix}[section](args, path, table)
    df = stamp(table.frame())
    save_table(args.out, df)
    pngs = plot(df, args.out, args.slug)
    if PROFILES:
        pngs.append(save_file(companion(args.out, "profile", "txt", args.slug), "\n\n".join(PROFILES) + "\n"))
    print()
    print(summary(df))
    print(f"\nwrote {args.out} ({len(df)} rows)" + "".join(f", {p}" for p in pngs)
          + f" in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
