"""Throughput measurements -> tidy DataFrames (one row per system x knob setting), ready for ``lab.eval.plots``.

Times are wall-clock over ``repeats`` runs after a warm-up; the table keeps median / min / max. Systems are
Engines (swept through ``configure``, no reload), a ready sentence-transformers baseline, or any callable that
embeds a list of texts. Speed is compared as a ratio in the same run, never asserted in tests.

    >>> base = SentenceTransformerBaseline(path)
    >>> df = throughput({"engine": eng, "sentence-transformers": base}, texts,
    ...                 sweep={"max_batch_tokens": [2048, 16384]}, repeats=3)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import pandas as pd
import torch


class SentenceTransformerBaseline:
    """``SentenceTransformer.encode`` as a benchmark system, reporting the tokens and padding of its batches.

    sentence-transformers sorts inputs by length and pads each batch of ``batch_size`` to its longest input.
    """

    def __init__(self, model, *, batch_size: int = 32, dtype: str = "float32", device: str = "cpu"):
        from sentence_transformers import SentenceTransformer

        self.model = model if not isinstance(model, str) else SentenceTransformer(model, device=device)
        if dtype != "float32":
            self.model = self.model.to(getattr(torch, dtype))
        self.batch_size, self.dtype = batch_size, dtype
        self.name = "sentence-transformers"

    def __call__(self, texts: list[str]):
        return self.model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True)

    def token_counts(self, texts: list[str]) -> tuple[int, int]:
        """(real tokens, padded tokens) of one ``encode`` call, from its own tokenizer and batching rule."""
        tok = self.model.tokenizer
        lengths = sorted(
            (len(x) for x in tok(texts, truncation=True, max_length=self.model.max_seq_length)["input_ids"]),
            reverse=True,
        )
        real = sum(lengths)
        padded = sum(
            max(lengths[i : i + self.batch_size]) * len(lengths[i : i + self.batch_size])
            for i in range(0, len(lengths), self.batch_size)
        )
        return real, padded - real


def _is_engine(x) -> bool:
    return hasattr(x, "configure") and hasattr(x, "embed") and hasattr(x, "stats")


def _time(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleaved(systems: dict, repeats: int, warmup: int) -> dict:
    """Time each ``name -> fn()`` ``repeats`` times, alternating systems within each round (drift in a shared
    machine's load then hits all of them alike). Returns ``name -> (wall seconds, CPU seconds, last output)``;
    CPU seconds (``time.process_time``: every thread of this process) are less sensitive to other processes on a
    shared machine, but count busy-waiting threads as work."""
    outs = {}
    for _ in range(warmup):
        for name, fn in systems.items():
            outs[name] = fn()
    wall = {name: [] for name in systems}
    cpu = {name: [] for name in systems}
    for _ in range(repeats):
        for name, fn in systems.items():
            c0, t0 = time.process_time(), time.perf_counter()
            outs[name] = fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {name: (wall[name], cpu[name], outs[name]) for name in systems}


def throughput(
    systems,
    texts: list[str],
    *,
    sweep: dict[str, list] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    show_progress: bool | None = None,
) -> pd.DataFrame:
    """Time each system on ``texts``; Engines also run every combination of ``sweep`` (restored afterwards).

    Args:
        systems: ``{name: Engine | SentenceTransformerBaseline | callable(texts)}``, or a list (names derived).
        sweep: knob -> values for Engines, e.g. ``{"max_batch_tokens": [1024, 16384], "dtype": [...]}``.
        repeats: timed runs per row (median, min and max are reported).

    Returns:
        one row per (system, knob setting): ``system, <knobs...>, texts, tokens, padded_tokens, seconds_median,
        seconds_min, seconds_max, tokens_per_s, threads, torch``; an Engine's rows also name what it loaded
        (``model``: its ``model_name``, ``revision``: the snapshot's commit or a local folder's content hash).
        ``tokens`` are real (unpadded) tokens, the same count for every system on the same texts, so tokens/s
        compare directly.
    """
    from tqdm.auto import tqdm

    if not isinstance(systems, dict):
        systems = {
            getattr(s, "name", None) or getattr(s, "model_name", None) or f"system{i}": s
            for i, s in enumerate(systems)
        }
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sweep = sweep or {}
    combos = [dict(zip(sweep, vals)) for vals in itertools.product(*sweep.values())] or [{}]
    jobs = [(name, s, c) for name, s in systems.items() for c in (combos if _is_engine(s) else [{}])]
    rows, engine_tokens = [], None
    bar = tqdm(jobs, desc="throughput", disable=not (show_progress if show_progress is not None else len(jobs) > 1))
    for name, system, knobs in bar:
        bar.set_postfix_str(name)
        row = {"system": name, **{k: None for k in sweep}, **knobs}
        if _is_engine(system):
            saved = {k: system.knobs[k] for k in knobs}
            system.configure(**knobs)
            try:
                for _ in range(warmup):
                    system.embed(texts)
                secs = _time(lambda s=system: s.embed(texts), repeats)
                st = system.stats
                row.update(
                    tokens=st.tokens,
                    padded_tokens=st.padded_tokens,
                    tokens_computed=st.tokens_computed,
                    model=system.model_name,
                    revision=system.revision,
                )
                engine_tokens = st.tokens
            finally:
                system.configure(**saved)
        else:
            for _ in range(warmup):
                system(texts)
            secs = _time(lambda s=system: s(texts), repeats)
            if isinstance(system, SentenceTransformerBaseline):
                real, pad = system.token_counts(texts)
                row.update(tokens=real, padded_tokens=pad, tokens_computed=real + pad)
            else:
                row.update(tokens=engine_tokens, padded_tokens=None, tokens_computed=None)
        med = statistics.median(secs)
        row.update(
            texts=len(texts),
            seconds_median=med,
            seconds_min=min(secs),
            seconds_max=max(secs),
            tokens_per_s=(row["tokens"] / med) if row.get("tokens") else None,
            threads=torch.get_num_threads(),
            torch=torch.__version__,
            machine=platform.machine(),
        )
        rows.append(row)
    return pd.DataFrame(rows)


def gemm_roofline(
    hidden: int,
    intermediate: int,
    layers: int,
    *,
    dtype: torch.dtype = torch.float32,
    tokens: int = 4096,
    repeats: int = 20,
    shapes: list[tuple[int, int]] | None = None,
    plan=None,
) -> dict:
    """Measured matmul FLOP/s at the model's GEMM shapes and the tokens/s they imply for its FLOPs per token.

    ``shapes``: one layer's projections as ``(in, out)`` pairs; the default is a BERT layer's (q/k/v ``h -> 3h``,
    output ``h -> h``, FFN ``h -> i -> h``). FLOPs per token count those projections at 2 FLOPs per multiply-add;
    the attention scores (a few % for short inputs) are left out, so the roofline is a ceiling for the GEMM work.
    The GEMM timed is the engine's (``lab.ops.gemm.linear`` under ``plan``, an engine's ``runner.plan``: the mode
    its probes chose, native or widened bfloat16, BLAS or oneDNN float32, oneDNN's on packed or plain weights), i.e.
    the fastest GEMM this machine offers for the dtype. The rate is the best of ``repeats`` timings, not their
    median: a ceiling, which a slow moment on a shared machine cannot lower much.
    """
    from lab.ops.gemm import linear

    if shapes is None:
        shapes = [(hidden, 3 * hidden), (hidden, hidden), (hidden, intermediate), (intermediate, hidden)]
    ws = [torch.randn(o, i, dtype=dtype) * 0.02 for i, o in shapes]
    ins = {i: torch.randn(tokens, i, dtype=dtype) for i, _ in shapes}

    def run():
        for (i, _), w in zip(shapes, ws):
            linear(ins[i], w, plan=plan)

    with torch.inference_mode():
        run()
        secs = min(_time(run, repeats))
    flops_layer = 2 * sum(i * o for i, o in shapes)  # per token
    flops_per_s = flops_layer * tokens / secs
    flops_per_token = layers * flops_layer
    return {
        "gemm_gflops": flops_per_s / 1e9,
        "flops_per_token": flops_per_token,
        "roofline_tokens_per_s": flops_per_s / flops_per_token,
    }


def attention_seconds(
    lengths: list[int],
    heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    threads: int | None = None,
    run_cap: int = 16,
    repeats: int = 3,
    kernel: str = "sdpa",
) -> float:
    """Seconds one bidirectional attention layer takes over sequences of these ``lengths`` in one of the engine's
    CPU kernels (``kernel``, an engine's ``attention_kernel``: ``sdpa``, torch's fused kernel; ``matmul``, the three-op
    path of ``lab.kernels.reference.varlen_attention``; ``bmm``, ``lab.ops.attention.bmm_attention``, batched GEMMs
    over groups of equal-length sequences; ``lab``, ``lab.kernels.cpu_attention``, one thread) on
    ``threads`` intra-op threads (default: the current count; an engine's CPU worker runs with
    ``torch.get_num_threads() // workers``), called through ``lab.ops.attention.attention`` as a layer calls it.

    Per distinct length, a packed run of ``min(count, run_cap)`` random sequences of that length (the runs the
    length-sorted scheduler forms) is timed, best of ``repeats`` after one untimed call, and scaled to the count.
    Measured length by length because the kernel's rate is far from smooth in the length: a sequence can take less
    time than a shorter one (measured: evals/README.md, "Measurements behind the code's choices").
    """
    from lab.ops.attention import attention
    from lab.ops.batch import AttnMeta

    counts: dict[int, int] = {}
    for n in lengths:
        if n < 1:
            raise ValueError(f"sequence lengths must be >= 1, got {n}")
        counts[n] = counts.get(n, 0) + 1
    old = torch.get_num_threads()
    torch.set_num_threads(threads or old)
    total = 0.0
    try:
        with torch.inference_mode():
            for length, count in sorted(counts.items()):
                n = min(count, run_cap)
                q, k, v = (torch.randn(n * length, heads, head_dim, dtype=dtype) for _ in range(3))
                meta = AttnMeta.from_lengths([length] * n, causal=False)

                def run(q=q, k=k, v=v, meta=meta):
                    attention(q, k, v, meta, 0, kernel=kernel)

                run()
                total += min(_time(run, repeats)) * count / n
    finally:
        torch.set_num_threads(old)
    return total


# ------------------------------------------------------------------------------------- lengths, memory, chunking
def texts_of_length(tokenizer, corpus: list[str], n_tokens: int, count: int) -> list[str]:
    """``count`` texts of about ``n_tokens`` tokens each, joined from consecutive ``corpus`` sentences (a sentence
    is added while it brings the total closer to ``n_tokens``; at least one per text), each text starting where
    the previous one ended. Whole sentences are kept, so lengths are approximate: the tables report the tokens
    measured."""
    if not corpus:
        raise ValueError("corpus is empty")
    lengths = [len(ids) for ids in tokenizer(list(corpus), add_special_tokens=False)["input_ids"]]
    out, i = [], 0
    for _ in range(count):
        parts, total = [], 0
        while len(parts) < len(corpus):
            n = lengths[i % len(corpus)]
            if parts and abs(total + n - n_tokens) >= abs(total - n_tokens):
                break
            parts.append(corpus[i % len(corpus)])
            total += n
            i += 1
        out.append(" ".join(parts))
    return out


def throughput_by_length(systems, texts_by_length: dict[int, list[str]], **kwargs) -> pd.DataFrame:
    """``throughput`` once per length bucket; adds ``length`` (measured real tokens per text) and ``bucket``."""
    frames = []
    for bucket, texts in texts_by_length.items():
        df = throughput(systems, texts, **kwargs)
        df.insert(1, "bucket", bucket)
        df.insert(2, "length", df["tokens"] / df["texts"])
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


@contextlib.contextmanager
def _without_profiler_banner():
    """Drop the ``USDT: ... SyncActivityProfilerHandler ... profiler_start / profiler_stop`` lines torch's profiler
    (2.13) prints on the process's stderr (file descriptor 2, below Python) around every profile; other lines written
    there meanwhile are passed on. A notebook would otherwise show two of them per measurement."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
            rest = "".join(line for line in lines if "SyncActivityProfilerHandler" not in line)
            if rest:
                sys.stderr.write(rest)


def peak_memory(fn: Callable[[], object]) -> tuple[object, int]:
    """``(fn(), peak bytes)``: the highest total of torch tensor memory allocated during the call, above what was
    allocated before it, from the torch profiler's memory events (CPU and GPU). Weights and tensors alive before
    the call do not count; allocations outside torch tensors (library scratch buffers) are not seen."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with _without_profiler_banner(), profile(activities=activities, profile_memory=True) as prof:
        result = fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return result, peak


def chunked_prefill(
    engine, texts: list[str], chunk_sizes: list[int | None], *, repeats: int = 1, show_progress: bool | None = None
) -> pd.DataFrame:
    """Each text alone, unchunked and at every chunk size: peak tensor memory, time, and the distance from the
    unchunked embedding (the engine's ``chunked_prefill`` knob is restored afterwards).

    Needs causal attention (a decoder, or ``bidirectional=False``). Returns one row per (text, chunk size):
    ``text, input_tokens, chunked_prefill (None = unchunked), chunks, seconds, peak_mb, state_mb, max_abs_diff,
    cosine``; ``state_mb`` is what chunked prefill held across steps (``Engine.stats.state_bytes``; 0 unchunked).
    """
    import numpy as np
    from tqdm.auto import tqdm

    if not engine.resolved.causal:
        raise ValueError("chunked_prefill needs causal attention: configure(bidirectional=False) first")
    sizes = [None] + [c for c in chunk_sizes if c is not None]
    saved = engine.knobs["chunked_prefill"]
    rows = []
    bar = tqdm(
        total=len(texts) * len(sizes),
        desc="chunked prefill",
        disable=not (show_progress if show_progress is not None else len(texts) * len(sizes) > 4),
    )
    try:
        for i, text in enumerate(texts):
            reference = None
            for chunk in sizes:
                engine.configure(chunked_prefill=chunk)
                run = functools.partial(engine.embed, [text])
                emb, peak = peak_memory(run)
                secs = _time(run, repeats)
                emb = np.asarray(emb[0], dtype=np.float64)
                if reference is None:
                    reference = emb
                cos = float(emb @ reference / (np.linalg.norm(emb) * np.linalg.norm(reference) + 1e-30))
                rows.append(
                    {
                        "text": i,
                        "input_tokens": engine.stats.tokens,
                        "chunked_prefill": chunk,
                        "chunks": engine.stats.chunks,
                        "seconds": statistics.median(secs),
                        "peak_mb": peak / 2**20,
                        "state_mb": engine.stats.state_bytes / 2**20,
                        "max_abs_diff": float(np.abs(emb - reference).max()),
                        "cosine": cos,
                    }
                )
                bar.update()
    finally:
        bar.close()
        engine.configure(chunked_prefill=saved)
    return pd.DataFrame(rows)
