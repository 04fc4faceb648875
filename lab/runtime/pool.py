"""The CPU worker pool: a packed step's sequences shared among worker threads, and how many workers run.

**Data parallel on CPU.** A packed step's sequences are independent, so on CPU a step can be split across worker
threads, each running its share as its own packed forward with ``1/workers`` of the intra-op threads (PyTorch's
thread count is per thread; weights are shared). Every op then runs without the fork/join barriers of
multi-threaded kernels, and each GEMM stays on one core's cache: faster end to end than one multi-threaded forward,
same embeddings. ``split_for_workers`` decides the shares (a step that cannot be shared evenly, say one long input
with a few short ones, runs undivided); ``run_shared`` runs the shares of one step; ``run_stream`` runs the shares
of a sequence of steps with no barrier between steps: the next steps' shares wait in the pool's queue, so a worker
done with its share of one step starts on the next step instead of waiting for the other worker (the shares' costs
are estimates, and one worker may be slowed for a while by the other's memory traffic or the machine), faster than
a barrier per step. The head runs in the workers, so the calling thread only places rows. The worker count is not
probed: a probe short enough for load time measures the wrong thing (a one-layer probe favoured one worker where
the whole run was faster on two). Measured: evals/README.md, "Measurements behind the code's choices".
``workers_for`` is the one rule for how many workers a step may use.

    >>> pool = WorkerPool()
    >>> outputs, extras = pool.run_shared(fn, items, workers=2)     # fn(share) -> (outputs aligned, extra)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

T = TypeVar("T")

STREAM_AHEAD = 1  # steps queued beyond the one ``run_stream`` is collecting


MAX_IMBALANCE = 1.15  # the busiest worker's load over an even share, past which a batch is not split
ATTENTION_COST_TOKENS = 1024  # a sequence of L tokens costs ~ L * (1 + L / this): its GEMMs plus its attention


def split_for_workers(lengths: list[int], workers: int) -> list[list[int]] | None:
    """Indices of a batch's sequences per worker, each list longest first (so equal lengths stay adjacent).

    Longest first, each sequence goes to the least-loaded worker (cost ~ tokens plus attention's quadratic term).
    ``None`` when fewer than two workers would get work, or when the busiest would carry more than
    ``MAX_IMBALANCE`` times an even share (one long input among short ones): the batch then runs undivided."""
    n = min(workers, len(lengths))
    if n < 2:
        return None
    parts: list[list[int]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        w = loads.index(min(loads))
        parts[w].append(i)
        loads[w] += lengths[i] * (1 + lengths[i] / ATTENTION_COST_TOKENS)
    if max(loads) > MAX_IMBALANCE * sum(loads) / n:
        return None
    return parts


def worker_threads(workers: int) -> int:
    """The intra-op threads each of ``workers`` CPU workers runs with: an even share of this thread's, at least 1."""
    return max(1, torch.get_num_threads() // max(1, workers))


def workers_for(knob: int | None, *, device: torch.device, packed: bool, backend: str) -> int:
    """Workers a step may be split across: the ``cpu_workers`` knob's value (``None`` = ``torch.get_num_threads()``)
    on CPU with the torch kernels; 1 elsewhere, for the padded transformers fallback, and for the Triton backend (on
    CPU that is Triton's interpreter, which is not thread-safe)."""
    if device.type != "cpu" or not packed or backend != "torch":
        return 1
    return torch.get_num_threads() if knob is None else knob


class WorkerPool:
    """Worker threads kept across calls (``workers`` of them, each with its share of the intra-op threads)."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._pool_shape: tuple[int, int] = (0, 0)

    def run_shared(self, fn: Callable[[list], tuple[object, T]], items: list, workers: int) -> tuple[object, list[T]]:
        """``fn(items)`` -> ``(outputs aligned with items, extra)``, with the items shared among ``workers`` CPU
        worker threads when ``split_for_workers`` can share them evenly by their ``length`` (module doc): each worker
        runs ``fn`` on its share under inference mode. Returns the shares' outputs put back in item order
        (``_merge``) and the list of their extras (one, when the items ran undivided). Every share finishes before
        this returns or raises, so no worker is still running when the caller moves on."""
        shared = self._submit_shares(fn, items, workers)
        if shared is None:
            with torch.inference_mode():
                out, extra = fn(items)
            return out, [extra]
        parts, futures = shared
        wait(futures)
        results = [f.result() for f in futures]
        return _merge(parts, [rows for rows, _ in results], len(items)), [extra for _, extra in results]

    def run_stream(
        self, fn: Callable[[list], tuple[object, T]], steps: Iterable[list], workers: int, *, ahead: int = STREAM_AHEAD
    ) -> Iterator[tuple[list, object, T, bool]]:
        """Run ``fn`` on the CPU workers' shares of every step of ``steps`` (as ``run_shared`` shares one step) and
        yield ``(share items, fn's outputs aligned with them, its extra, first share of its step)`` per share, step by
        step, in order. Up to ``ahead`` steps beyond the one being collected have their shares queued, so the
        workers never wait at a step's end. A step that cannot be shared runs undivided on the calling thread with
        all its intra-op threads once the steps before it are done. On an error, an interrupt, or the caller
        closing the iterator, queued shares are cancelled and running ones finish before it returns or raises."""
        pending: deque[tuple[list, list[list[int]], list[Future]]] = deque()

        def collect(keep: int):  # yield the oldest steps' shares until `keep` steps are pending
            while len(pending) > keep:
                step, parts, futures = pending[0]  # stays pending (its futures awaited on exit) until collected
                for k, (part, future) in enumerate(zip(parts, futures)):
                    out, delta = future.result()
                    yield [step[i] for i in part], out, delta, k == 0
                pending.popleft()

        try:
            for step in steps:
                shared = self._submit_shares(fn, step, workers)
                if shared is None:  # runs alone, with every intra-op thread: everything queued before it first
                    yield from collect(0)
                    with torch.inference_mode():
                        out, delta = fn(step)
                    yield step, out, delta, True
                    continue
                pending.append((step, *shared))
                yield from collect(ahead)
            yield from collect(0)
        finally:
            futures = [f for _, _, fs in pending for f in fs]
            for f in futures:
                f.cancel()
            wait(futures)

    def _submit_shares(
        self,
        fn: Callable[[list], T],
        items: list,
        workers: int,
    ) -> tuple[list[list[int]], list[Future]] | None:
        """``items`` split among ``workers`` by their ``length`` (``split_for_workers``) and each share submitted
        to the worker pool (``fn`` under inference mode): ``(parts, futures)``, or ``None`` (nothing submitted)
        when the items cannot be shared evenly and must run undivided."""
        parts = split_for_workers([x.length for x in items], workers)
        if parts is None:
            return None
        pool = self._workers(workers)
        return parts, [pool.submit(_inference, fn, [items[i] for i in part]) for part in parts]

    def _workers(self, n: int) -> ThreadPoolExecutor:
        """A pool of ``n`` threads with ``torch.get_num_threads() // n`` (at least 1) intra-op threads each, kept
        across calls and rebuilt when either number changes."""
        shape = (n, worker_threads(n))
        if self._pool is None or self._pool_shape != shape:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(
                n, thread_name_prefix="lab-cpu-worker", initializer=torch.set_num_threads, initargs=(shape[1],)
            )
            self._pool_shape = shape
        return self._pool


def _merge(parts: list[list[int]], outs: list, n: int):
    """The workers' outputs (``outs[w]`` aligned with the items ``parts[w]``) put back in item order: tensors
    scattered into one, lists into one list, tuples (several outputs of one forward) item by item."""
    first = outs[0]
    if isinstance(first, tuple):
        return tuple(_merge(parts, [o[k] for o in outs], n) for k in range(len(first)))
    if isinstance(first, torch.Tensor):
        out = first.new_empty((n, *first.shape[1:]))
        for part, rows in zip(parts, outs):
            out[part] = rows
        return out
    out = [None] * n
    for part, rows in zip(parts, outs):
        for i, row in zip(part, rows):
            out[i] = row
    return out


def _inference(fn: Callable[[list], T], items: list) -> T:
    with torch.inference_mode():  # thread-local: entered in each worker
        return fn(items)
