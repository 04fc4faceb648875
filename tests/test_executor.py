"""The one call pipeline: every execution path and worker split gives the same outputs in input order, the CPU
workers run the KV path too, one ``Stats`` per call (bi-encoder scoring included), per-engine truncation warnings,
knobs set by name, and a failed call that leaves the engine's stats as they were."""

from __future__ import annotations

import inspect
import random
import threading
import time
import warnings

import numpy as np
import pytest
from conftest import cosine_rows
from tiny_models import tiny_llama

from lab import Engine
from lab.engine.call import Stats
from lab.engine.knob_registry import KNOBS
from lab.engine.knobs import Knobs
from lab.runtime.pool import WorkerPool

LONG = "Rotary position embeddings rotate queries and keys by their positions. "
TEXTS = [LONG * 3, "a", "Paris", LONG * 2, "What is the capital of France?", LONG * 3 + "again", "b c d", LONG]
INSTRUCTION = "Given a web search query, retrieve relevant passages: "


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tiny_llama(tmp_path_factory.mktemp("llama"), "llama", max_position_embeddings=1024))


def shuffled(texts, seed=0):
    texts = texts[:]
    random.Random(seed).shuffle(texts)
    return texts


class WorkerThreads:
    """Names of the threads each decoder layer-0 call ran on (a forward hook)."""

    def __init__(self, model):
        self.names: set[str] = set()
        self.handle = model.layers[0].register_forward_hook(lambda *_: self.names.add(threading.current_thread().name))

    def take(self) -> set[str]:
        names, self.names = self.names, set()
        return names


@pytest.mark.parametrize("pooling", ["mean", "lasttoken", "cls"])
def test_every_path_and_worker_split_gives_the_same_rows(folder, pooling):
    """Packed, chunked prefill and prefix cache, each with one forward per step and shared among two CPU workers:
    the same embeddings in input order (causal attention, so every path is exact up to float32 rounding)."""
    texts = shuffled(TEXTS)
    eng = Engine(
        folder,
        pooling=pooling,
        normalize=False,
        instruction=INSTRUCTION,
        prefix_cache=False,
        cpu_workers=1,
        max_batch_tokens=4096,
    )
    want = eng.embed(texts)
    threads = WorkerThreads(eng.model)
    for knobs in (
        {"cpu_workers": 2},
        {"chunked_prefill": 8, "cpu_workers": 1},
        {"chunked_prefill": 8, "cpu_workers": 2},
        {"prefix_cache": True, "cpu_workers": 1},
        {"prefix_cache": True, "cpu_workers": 2},
        {"prefix_cache": True, "chunked_prefill": 8, "cpu_workers": 2},
    ):
        eng.configure(**{"chunked_prefill": None, "prefix_cache": False, **knobs})
        got = eng.embed(texts)
        assert got.shape == want.shape
        assert cosine_rows(got, want).min() >= 0.99999, knobs
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4, err_msg=str(knobs))
        ran_on = threads.take()
        if knobs["cpu_workers"] == 2:  # the workers ran these steps (the KV path too), not the calling thread
            assert any(name.startswith("lab-cpu-worker") for name in ran_on), (knobs, ran_on)
        else:
            assert ran_on == {threading.current_thread().name}, (knobs, ran_on)
        if knobs.get("prefix_cache"):
            assert eng.stats.shared_prefix > 3 and eng.stats.tokens_computed < eng.stats.tokens
        if knobs.get("chunked_prefill"):
            assert eng.stats.chunks > len(texts) and eng.stats.state_bytes > 0


def test_kv_path_counts_the_same_work_however_shared(folder):
    """A step's stats do not depend on how many workers shared it (batches, chunks, tokens computed)."""
    texts = shuffled(TEXTS, 1)
    eng = Engine(folder, pooling="mean", chunked_prefill=8, instruction=INSTRUCTION)
    counts = []
    for workers in (1, 2):
        eng.configure(cpu_workers=workers)
        eng.embed(texts)
        s = eng.stats
        counts.append((s.sequences, s.tokens, s.batches, s.chunks, s.tokens_computed, s.shared_prefix))
    assert counts[0] == counts[1]


def test_bi_encoder_score_is_one_call_with_one_stats(folder):
    """Queries and documents run as two passes of one call: one Stats counting both, the KV path's state kept."""
    eng = Engine(folder, pooling="mean", chunked_prefill=8)
    queries, docs = ["q one", "q two", "q one"], [LONG * 2, LONG * 3, "short doc"]
    eng.embed(["q one", "q two"])
    q = eng.stats
    eng.embed([LONG * 2, LONG * 3, "short doc"])
    d = eng.stats
    scores = eng.score(list(zip(queries, docs)), mode="bi-encoder")
    s = eng.stats
    assert scores.shape == (3,) and scores.dtype == np.float32
    for name in ("sequences", "tokens", "batches", "chunks", "tokens_computed"):
        assert getattr(s, name) == getattr(q, name) + getattr(d, name), name
    assert s.state_bytes == max(q.state_bytes, d.state_bytes) > 0
    e = eng.embed(queries), eng.embed(docs)
    want = (e[0] * e[1]).sum(1) / np.linalg.norm(e[0], axis=1) / np.linalg.norm(e[1], axis=1)
    np.testing.assert_allclose(scores, want, atol=1e-5)


def test_truncation_warning_is_per_engine(minilm_path):
    long = ["word " * 50]
    for _ in range(2):  # a second engine warns again; each warns once per max_length
        eng = Engine(minilm_path, max_length=16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng.embed(long)
            eng.embed(long)
        said = [w for w in caught if "truncated" in str(w.message)]
        assert len(said) == 1 and eng.stats.truncated == 1


LOAD_TIME = ("cpu_paths", "tune_allocator", "compile")  # Engine arguments fixed for the engine's life, not knobs


def test_engine_arguments_are_the_knobs_by_name(minilm_path):
    """Every keyword of ``Engine``'s signature but ``model`` and the settings fixed at load (``LOAD_TIME``) is a
    registered knob, in the registry's order with its default, and lands in that knob."""
    skip = ("self", "model", *LOAD_TIME)
    params = [p for p in inspect.signature(Engine.__init__).parameters if p not in skip]
    assert params == list(KNOBS) == list(Knobs())
    defaults = {
        p.name: p.default for p in inspect.signature(Engine.__init__).parameters.values() if p.name not in skip
    }
    assert defaults == {name: k.default for name, k in KNOBS.items()} == dict(Knobs())
    assert [p for p in inspect.signature(Engine).parameters][-3:] == list(LOAD_TIME)
    chosen = {
        "pooling": "max",
        "normalize": False,
        "truncate_dim": 17,
        "max_length": 33,
        "max_batch_tokens": 999,
        "max_num_seqs": 7,
        "instruction": "x: ",
        "include_instruction": True,
        "append_eos": True,
        "prefix_cache": False,
        "attention_backend": "torch",
        "cpu_workers": 1,
        "layer": 3,
    }
    eng = Engine(minilm_path, **chosen)
    assert {k: eng.knobs[k] for k in chosen} == chosen


@pytest.mark.parametrize("workers", [1, 2])  # one forward per step / the steps' shares streamed through 2 workers
def test_failed_call_leaves_stats_as_they_were(minilm_path, monkeypatch, workers):
    eng = Engine(minilm_path, max_batch_tokens=64, cpu_workers=workers)
    eng.embed(["one text", "another text"])
    before = eng.stats
    calls = []

    def boom(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    real = eng.executor._forward_pool
    monkeypatch.setattr(eng.executor, "_forward_pool", boom)
    with pytest.raises(KeyboardInterrupt):
        eng.embed(["some words here"] * 40)  # several batches: the second one is interrupted
    assert eng.stats is before
    monkeypatch.undo()
    np.testing.assert_allclose(eng.embed(["one text"]), Engine(minilm_path).embed(["one text"]), atol=1e-6)


def test_packed_steps_count_the_same_work_however_shared(minilm_path):
    """The packed path streams its steps' shares through the CPU workers: the same rows in input order and the same
    counts (batches are steps, not shares) as one forward per step."""
    texts = shuffled([LONG * (i % 4) + f"text {i}" for i in range(60)], 2)
    eng = Engine(minilm_path, max_batch_tokens=256)
    rows, counts = [], []
    for workers in (1, 2):
        eng.configure(cpu_workers=workers)
        rows.append(eng.embed(texts))
        s = eng.stats
        counts.append((s.sequences, s.tokens, s.batches, s.tokens_computed, s.padded_tokens))
    assert counts[0] == counts[1] and counts[0][2] > 3
    np.testing.assert_allclose(rows[1], rows[0], atol=2e-6)


class Item:
    def __init__(self, length: int, tag: str):
        self.length, self.tag = length, tag


def _stream_steps():
    # step 1 (index 1) cannot be shared evenly: one long item among short ones
    return [
        [Item(10, f"s{k}i{i}") for i in range(4)] if k != 1 else [Item(4000, "long"), Item(3, "x")] for k in range(5)
    ]


def test_run_stream_yields_every_share_in_step_order():
    pool = WorkerPool()
    seen = []

    def fn(items):
        seen.append(threading.current_thread().name)
        return [it.tag for it in items], Stats(tokens_computed=sum(it.length for it in items))

    steps = _stream_steps()
    got = list(pool.run_stream(fn, steps, 2))
    tags = [t for _, out, _, _ in got for t in out]
    assert [it.tag for items, *_ in got for it in items] == tags  # outputs aligned with items
    for step in steps:  # every item once, each step's shares before the next step's
        want = sorted(it.tag for it in step)
        assert sorted(tags[: len(want)]) == want
        tags = tags[len(want) :]
    assert sum(first for *_, first in got) == len(steps)
    assert sum(delta.tokens_computed for _, _, delta, _ in got) == sum(it.length for s in steps for it in s)
    assert threading.current_thread().name in seen  # the unshareable step ran on the calling thread
    assert sum(name.startswith("lab-cpu-worker") for name in seen) == 8  # 4 shared steps x 2 shares


@pytest.mark.parametrize("how", ["error", "close"])
def test_run_stream_leaves_no_worker_running(how):
    """An error in a share, or the caller stopping early: queued shares are cancelled, running ones have finished
    when ``run_stream`` returns or raises."""
    pool = WorkerPool()
    running, ran = [0], []
    lock = threading.Lock()

    def fn(items):
        with lock:
            running[0] += 1
        try:
            time.sleep(0.05)
            if how == "error" and items[0].tag.startswith("s2"):
                raise RuntimeError("share failed")
            ran.append(items[0].tag)
            return [it.tag for it in items], Stats()
        finally:
            with lock:
                running[0] -= 1

    steps = _stream_steps() * 3
    stream = pool.run_stream(fn, steps, 2)
    if how == "error":
        with pytest.raises(RuntimeError, match="share failed"):
            for _ in stream:
                pass
    else:
        next(stream)
        stream.close()
    assert running[0] == 0
    assert len(ran) < 2 * len(steps) - 2  # the later steps' shares never ran
    time.sleep(0.2)
    assert running[0] == 0
