"""Scheduler properties (no model): token budget, count limit, oversize inputs, order, the prefetch thread."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import pytest

from lab.engine.scheduler import plan_batches, prefetch_waves
from lab.runtime.pool import MAX_IMBALANCE, split_for_workers


@dataclass
class Req:
    index: int
    length: int


@pytest.mark.parametrize("budget,max_seqs", [(1, 1), (10, 3), (64, 256), (1000, 4), (16384, 256)])
def test_every_request_once_within_limits(budget, max_seqs):
    reqs = [Req(i, random.choice([1, 2, 3, 7, 30, 100])) for i in range(157)]
    random.shuffle(reqs)
    batches = plan_batches(reqs, budget, max_seqs)
    seen = sorted(r.index for b in batches for r in b)
    assert seen == list(range(157))
    for b in batches:
        assert len(b) <= max_seqs
        assert sum(r.length for r in b) <= budget or len(b) == 1  # oversize inputs run alone
        lengths = [r.length for r in b]
        assert lengths == sorted(lengths, reverse=True)  # equal lengths adjacent: dense attention groups


def test_oversize_input_runs_alone():
    batches = plan_batches([Req(0, 5), Req(1, 50), Req(2, 5)], 10, 8)
    assert [[r.index for r in b] for b in batches] == [[1], [0, 2]]


def test_longest_first_packs_densely():
    reqs = [Req(i, n) for i, n in enumerate([3, 9, 1, 8, 2, 7])]
    batches = plan_batches(reqs, 10, 8)
    assert [sum(r.length for r in b) for b in batches] == [9, 8, 10, 3]  # 9 | 8 | 7+3 | 2+1


def test_prefetch_waves_overlaps_and_keeps_order():
    items = list(range(23))
    threads = set()

    def process(chunk, first):
        threads.add(threading.current_thread().name)
        return first, chunk

    out = list(prefetch_waves(items, process, wave_size=5))
    assert [f for f, _ in out] == [0, 5, 10, 15, 20]
    assert [x for _, c in out for x in c] == items
    assert any(t.startswith("lab-tokenize") for t in threads)
    assert list(prefetch_waves([], process, 5)) == []


def test_prefetch_waves_surfaces_errors():
    def boom(chunk, first):
        if first == 5:
            raise RuntimeError("bad wave")
        return chunk

    it = prefetch_waves(list(range(12)), boom, 5)
    assert next(it) == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="bad wave"):
        list(it)


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_split_for_workers_covers_each_sequence_once_longest_first(workers):
    rng = random.Random(workers)
    lengths = [rng.randint(1, 300) for _ in range(57)]
    parts = split_for_workers(lengths, workers)
    assert parts is not None and len(parts) == workers
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    for p in parts:
        assert [lengths[i] for i in p] == sorted((lengths[i] for i in p), reverse=True)
    tokens = [sum(lengths[i] for i in p) for p in parts]
    assert max(tokens) <= MAX_IMBALANCE * sum(tokens) / workers


def test_split_for_workers_declines_what_it_cannot_share():
    assert split_for_workers([5, 5, 5], 1) is None  # one worker
    assert split_for_workers([7], 4) is None  # one sequence
    assert split_for_workers([4000, 3, 3, 3], 2) is None  # one long input among short ones
    assert split_for_workers([256] * 4, 8) == [[0], [1], [2], [3]]  # fewer sequences than workers
    assert split_for_workers([10, 9, 6, 5], 2) == [[0, 3], [1, 2]]
    assert split_for_workers([10, 10, 9, 1], 2) is None  # 19 vs 11 tokens: past MAX_IMBALANCE
