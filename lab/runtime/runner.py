"""The prefill-only runner: the model on its device, its weights, one packed forward, and the CPU worker threads.

It casts weights between dtypes from a master copy (so ``configure(dtype=...)`` is reversible without a reload),
swaps in LoRA-merged copies (``set_merged``), builds the flat inputs (``PackedBatch``) and runs one forward. Which
steps run, on which path, and how outputs are pooled is the executor's business (``lab.engine.executor``).

**Data parallel on CPU.** A packed step's sequences are independent, so on CPU a step can be split across worker
threads, each running its share as its own packed forward with ``1/workers`` of the intra-op threads (PyTorch's
thread count is per thread; weights are shared). Every op then runs without the fork/join barriers of
multi-threaded kernels, and each GEMM stays on one core's cache; on the 2-core development machine this measured
1.09-1.13x (MiniLM, SciFact) and 1.08-1.09x (SmolLM2) end to end over one multi-threaded forward (paired,
interleaved runs), same embeddings. ``run_shared`` runs the shares of one step; ``lab.engine.scheduler.split_for_workers``
decides them (a step that cannot be shared evenly, say one long input with a few short ones, runs undivided).
``run_stream`` runs the shares of a sequence of steps with no barrier between steps: the next steps' shares wait in
the pool's queue, so a worker done with its share of one step starts on the next step instead of waiting for the
other worker (the shares' costs are estimates, and one worker may be slowed for a while by the other's memory
traffic or the machine).

    >>> runner = Runner(model, device=torch.device("cpu"), dtype=torch.float32)
    >>> hidden = runner.forward(runner.pack(requests, causal=False, backend="torch"))     # (T, hidden)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

from lab.ops.batch import OutputRows, PackedBatch
from lab.engine.call import Stats
from lab.engine.inputs import Request
from lab.models.base import PackedModel
from lab.ops.gemm import GEMM_SETTERS, drop_derived
from lab.ops.probes import Decision, decide
from lab.engine.scheduler import split_for_workers

T = TypeVar("T")

STREAM_AHEAD = 1  # steps queued beyond the one ``run_stream`` is collecting


class Runner:
    def __init__(self, model: PackedModel, *, device: torch.device, dtype: torch.dtype):
        self.model = model.eval().to(device)
        self.device = device
        # master weights in their loaded precision; the live module holds casts of them
        self._master = {name: p.detach() for name, p in self.model.named_parameters()}
        # float32 copies of the parameters LoRA adapters changed (``set_merged``); the live weights cast these
        self._merged: dict[str, torch.Tensor] = {}
        self.dtype = None
        self.decisions: list[Decision] = []  # the CPU fast-path choices in force (``plan_cpu_paths``)
        self.set_dtype(dtype)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_shape: tuple[int, int] = (0, 0)

    def set_dtype(self, dtype: torch.dtype) -> None:
        """Re-cast the live weights from the master copy, or a parameter's merged copy when adapters changed it
        (no reload; float32 shares the master's / merged copy's storage). Interrupt-safe: all casts are made before
        any weight is swapped, and a call always leaves every weight in ``dtype`` (it repairs a half-done switch)."""
        params = dict(self.model.named_parameters())
        if dtype == self.dtype and all(p.dtype == dtype for p in params.values()):
            return
        # every cast first: an interrupt here leaves the live weights as they were. Detached, not under
        # ``torch.no_grad()``: an interrupt landing on a ``with`` line's exit skips ``__exit__`` and left grad mode off
        # for the whole thread
        live = {name: self._merged.get(name, self._master[name]).detach().to(self.device, dtype) for name in params}
        self.dtype = None  # in transition: an interrupt during the swaps below leaves a state the next call repairs
        for name, t in live.items():
            params[name].data = t
            drop_derived(params[name])
        self.dtype = dtype

    @property
    def base_weights(self) -> dict[str, torch.Tensor]:
        """The master copy of every parameter as loaded (no adapters merged); read it, do not change it."""
        return self._master

    def set_merged(self, merged: dict[str, torch.Tensor]) -> None:
        """Make ``merged`` (parameter name -> float32 weight: base + LoRA deltas, ``lab.adapt.adapters.merged_weights``)
        the source of those parameters, and every other parameter its master again; ``{}`` restores the base
        weights exactly. The live weights are cast before any is swapped, so an error leaves them as they were."""
        params = dict(self.model.named_parameters())
        unknown = sorted(set(merged) - set(params))
        if unknown:
            raise KeyError(f"merged weights for unknown parameters: {', '.join(unknown[:5])}")
        for name, t in merged.items():
            if t.shape != self._master[name].shape:
                raise ValueError(f"merged {name}: shape {tuple(t.shape)} != {tuple(self._master[name].shape)}")
        with torch.no_grad():
            live = {name: merged.get(name, self._master[name]).to(self.device, self.dtype)
                    for name in set(self._merged) | set(merged)}
            for name, t in live.items():
                params[name].data = t
                drop_derived(params[name])
        self._merged = dict(merged)

    def plan_cpu_paths(self, workers: int) -> list[Decision]:
        """Decide the model's CPU fast paths for the current dtype by probing (``lab.ops.probes``; cached per
        process and shape class), timed with one worker's share of the intra-op threads; sets ``model.plan`` and
        the process's bfloat16 GEMM mode. Off the CPU (or for the padded fallback) there is nothing to decide."""
        self.model.plan.clear()
        self.decisions = []
        if self.device.type != "cpu" or not self.model.packed:
            return self.decisions
        threads = max(1, torch.get_num_threads() // max(1, workers))
        probes = self.model.cpu_probes(self.dtype, threads)
        for probe in probes:  # each choice is in the plan before the next probe runs
            d = decide(probe)
            if d.name in GEMM_SETTERS:
                GEMM_SETTERS[d.name](d.choice)
            self.model.plan[d.name] = d.choice
            self.decisions.append(d)
        return self.decisions

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, num_layers: int | None = None,
                output_rows: OutputRows | None = None) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` of one packed step after its first ``num_layers`` layers (``None`` = all;
        the Engine's ``layer`` knob, resolved), or with ``output_rows`` only those rows ``(B, hidden)``."""
        return self.model(batch.input_ids, batch.positions, batch.meta, batch.token_type_ids,
                          output_rows=output_rows, num_layers=num_layers)

    def pack(self, requests: list[Request], *, causal: bool, backend: str) -> PackedBatch:
        """The flat inputs of ``requests`` on this runner's device."""
        return PackedBatch.build([r.ids for r in requests], causal=causal, device=self.device, backend=backend,
                                 token_type_ids=[r.token_type_ids for r in requests],
                                 pool_start=[r.pool_start for r in requests],
                                 key_lens=[r.key_len for r in requests] if any(r.key_len is not None
                                                                               for r in requests) else None)

    def run_shared(self, fn: Callable[[list], tuple[object, Stats]], items: list, workers: int):
        """``fn(items)`` -> ``(outputs aligned with items, Stats)``, with the items shared among ``workers`` CPU
        worker threads when ``lab.engine.scheduler.split_for_workers`` can share them evenly by their ``length`` (module
        doc): each worker runs ``fn`` on its share under inference mode, and the shares' outputs are put back in
        item order (``_merge``) and their stats added up. Every share finishes before this returns or raises, so no
        worker is still running when the caller moves on."""
        shared = self._submit_shares(fn, items, workers)
        if shared is None:
            with torch.inference_mode():
                return fn(items)
        parts, futures = shared
        wait(futures)
        results = [f.result() for f in futures]
        total = Stats()
        for _, delta in results:
            total.add(delta, concurrent=True)
        return _merge(parts, [rows for rows, _ in results], len(items)), total

    def run_stream(self, fn: Callable[[list], tuple[object, Stats]], steps: Iterable[list], workers: int, *,
                   ahead: int = STREAM_AHEAD) -> Iterator[tuple[list, object, Stats, bool]]:
        """Run ``fn`` on the CPU workers' shares of every step of ``steps`` (as ``run_shared`` shares one step) and
        yield ``(share items, fn's outputs aligned with them, Stats, first share of its step)`` per share, step by
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

    def _submit_shares(self, fn: Callable[[list], T], items: list, workers: int,
                       ) -> tuple[list[list[int]], list[Future]] | None:
        """``items`` split among ``workers`` by their ``length`` (``split_for_workers``) and each share submitted
        to the worker pool (``fn`` under inference mode): ``(parts, futures)``, or ``None`` (nothing submitted)
        when the items cannot be shared evenly and must run undivided."""
        parts = split_for_workers([x.length for x in items], workers)
        if parts is None:
            return None
        pool = self._workers(workers)
        return parts, [pool.submit(_inference, fn, [items[i] for i in part]) for part in parts]

    def cpu_workers(self, workers: int | None, backend: str) -> int:
        """Workers a step may be split across: the knob's value (``None`` = ``torch.get_num_threads()``) on CPU
        with the torch kernels; 1 elsewhere, for the padded transformers fallback, and for the Triton backend
        (on CPU that is Triton's interpreter, which is not thread-safe)."""
        if self.device.type != "cpu" or not self.model.packed or backend != "torch":
            return 1
        return torch.get_num_threads() if workers is None else workers

    def _workers(self, n: int) -> ThreadPoolExecutor:
        """A pool of ``n`` threads with ``torch.get_num_threads() // n`` (at least 1) intra-op threads each, kept
        across calls and rebuilt when either number changes."""
        shape = (n, max(1, torch.get_num_threads() // n))
        if self._pool is None or self._pool_shape != shape:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="lab-cpu-worker",
                                            initializer=torch.set_num_threads, initargs=(shape[1],))
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
