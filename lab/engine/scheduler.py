"""Token-budget scheduling: which requests run together, in what order; tokenization overlapped with compute.

Batches are packed longest-first under two limits — the sum of lengths ``<= max_batch_tokens`` and the count
``<= max_num_seqs`` — so batches are dense and equal lengths sit next to each other (the torch attention path
runs each run of equal lengths as one masked-free call). An input longer than the budget runs alone. Input order
is restored by the output processor from ``Request.index``.

On CPU a batch is then shared among worker threads (``lab.runtime.pool``), each an even share of the work.

Tokenization of the next wave of texts runs in a background thread while the model works on the current one
(the Workflow Defined Engine's split of input processing from execution).

    >>> for batch in plan_batches(requests, max_batch_tokens=16384, max_num_seqs=256): ...
    >>> for requests in prefetch_waves(texts, tokenize_fn, wave_size=2048): ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar


class HasLength(Protocol):
    @property
    def length(self) -> int: ...


R = TypeVar("R", bound=HasLength)


def plan_batches(requests: list[R], max_batch_tokens: int, max_num_seqs: int) -> list[list[R]]:
    """Greedy longest-first packing. Every request lands in exactly one batch; a batch never exceeds either
    limit unless it holds a single request longer than ``max_batch_tokens``."""
    order = sorted(requests, key=lambda r: -r.length)
    batches: list[list[R]] = []
    current: list[R] = []
    tokens = 0
    for r in order:
        if current and (tokens + r.length > max_batch_tokens or len(current) >= max_num_seqs):
            batches.append(current)
            current, tokens = [], 0
        current.append(r)
        tokens += r.length
    if current:
        batches.append(current)
    return batches


T = TypeVar("T")

WAVE_SIZE = 4096  # texts tokenized per wave; the next wave is tokenized while this one runs


def prefetch_waves(items: list, process: Callable[[list, int], T], wave_size: int) -> Iterator[T]:
    """Yield ``process(items[i:i+wave_size], i)`` for each wave, computing wave ``k+1`` in a thread while the
    caller consumes wave ``k``. Exceptions surface in the caller, in order."""
    if len(items) <= wave_size:  # one wave: no thread to start
        if items:
            yield process(items, 0)
        return
    starts = list(range(0, len(items), wave_size))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lab-tokenize") as pool:
        pending = pool.submit(process, items[:wave_size], 0)
        for k, s in enumerate(starts):
            result = pending.result()
            if k + 1 < len(starts):
                nxt = starts[k + 1]
                pending = pool.submit(process, items[nxt : nxt + wave_size], nxt)
            yield result
