"""The one call pipeline's execution stage: requests in, per-request outputs out, whatever the path.

Given one wave of ``Request`` objects and a ``Pooler`` (method x head), the executor chooses the path:

- **packed** (the default): token-budget batches (``lab.engine.scheduler.plan_batches``), each one flat forward; when
  the method reads one row per sequence (``cls``, ``lasttoken``) and the model ``computes_output_rows``, its last
  layer runs for those rows only (``lab.ops.batch.OutputRows``);
- **KV** (``lab.engine.kv_path``): causal attention with chunked prefill, or with a prefix the inputs share that the
  prefix cache computes once.

Both paths share their steps among the CPU workers: the packed path streams every step's shares through them with
no barrier between steps, the head applied in the workers (``WorkerPool.run_stream``, faster than a barrier per
step: ``lab.runtime.pool``), the KV path shares one step at a time (``WorkerPool.run_shared``). Both build their
flat inputs with ``lab.engine.inputs.pack``. Both drive the model through its one forward
(``lab.models.base.PackedModel``), and both yield ``(requests, outputs)`` with outputs aligned to those requests,
after the head. A method may return a tuple (several outputs of one forward, ``lab.outputs.kinds``): the workers'
shares are merged per item. The ``rows()`` shortcut applies only when the method reads one row per sequence (for
several outputs: when every one of them reads the same row). Every step's work is counted in the caller's ``Stats``.
Before a wave runs, its memory is checked against the process's ceiling (``lab.runtime.memory``).
Adding an execution path: a class like ``KVPath`` that yields ``(requests, pooled)``, chosen in ``Executor.run``.

    >>> ex = Executor(runner)
    >>> for reqs, out in ex.run(requests, pooler, settings, stats, shared_prefix=False): ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from lab._warn import warn
from lab.engine.call import ExecSettings, Stats
from lab.engine.inputs import Request, pack
from lab.engine.kv_path import KVPath
from lab.engine.scheduler import plan_batches
from lab.ops.batch import OutputRows
from lab.outputs.heads import Pooler, SparseShape
from lab.outputs.kinds import LOGIT_BLOCK_BYTES
from lab.outputs.pooling import PoolingMethod, pool_spans
from lab.runtime import memory
from lab.runtime.runner import Runner


class Executor:
    def __init__(self, runner: Runner):
        self.runner = runner
        self.model = runner.model

    def uses_kv_path(self, s: ExecSettings, *, shared_prefix: bool) -> bool:
        """Causal attention on a model that runs in stages, with chunked prefill, or with a prefix the inputs
        share (``shared_prefix``: an unpooled instruction, a prompt template) and the prefix cache on."""
        if not s.causal or not self.model.staged:
            return False
        return s.chunked_prefill is not None or (s.prefix_cache and shared_prefix)

    def run(
        self, requests: list[Request], pooler: Pooler, s: ExecSettings, stats: Stats, *, shared_prefix: bool
    ) -> Iterator[tuple[list[Request], object]]:
        """Yield ``(requests, outputs)`` per step or group, outputs aligned with those requests (after the head);
        every request of ``requests`` exactly once. Counts batches, chunks, computed and padded tokens in
        ``stats`` (the caller counts what was served). Before anything runs, the wave's memory is checked against
        the process's ceiling (``lab.runtime.memory``): steps of fewer tokens where the largest would not fit
        (``stats.memory_budget``), ``MemoryLimitError`` where one input or the outputs would not."""
        if self.uses_kv_path(s, shared_prefix=shared_prefix):
            s = self.memory_budget(
                requests,
                pooler,
                s,
                stats,
                chunked=s.chunked_prefill is not None,
                prefix=shared_prefix and s.prefix_cache,
            )
            for reqs, pooled, delta in KVPath(self.runner, s, pooler.method).run(
                requests, shared_prefix=shared_prefix
            ):
                stats.add(delta)
                yield reqs, pooler.outputs(pooled, reqs)
            return
        tokens = sum(r.length for r in requests)
        path = self.runner.forward_path(
            tokens * max(1, s.items) // max(1, len(requests)),
            causal=s.causal,
            num_layers=s.num_layers,
            workers=s.workers,
        )
        s = self.memory_budget(requests, pooler, s, stats, eager=path == "eager")
        batches = plan_batches(requests, s.max_batch_tokens, s.max_num_seqs)
        if s.workers > 1:  # the steps' shares streamed through the CPU workers, outputs by the head in the workers

            def share(reqs):
                pooled, delta = self._forward_pool(reqs, pooler.method, s, path)
                return pooler.outputs(pooled, reqs), delta

            for reqs, out, delta, first in self.runner.pool.run_stream(share, batches, s.workers):
                delta.batches = int(first)
                stats.add(delta)
                yield reqs, out
            return
        for batch in batches:
            pooled, delta = self.packed_step(batch, pooler.method, s, path)
            delta.batches = 1
            stats.add(delta)
            yield batch, pooler.outputs(pooled, batch)

    def memory_budget(
        self,
        requests: list[Request],
        pooler: Pooler,
        s: ExecSettings,
        stats: Stats,
        *,
        eager: bool = True,
        chunked: bool = False,
        prefix: bool = False,
    ) -> ExecSettings:
        """``s`` with the token budget this wave's steps fit in (``lab.runtime.memory.fit_budget``); a budget cut
        is recorded in ``stats.memory_budget`` and warned about once per call; CPU steps only (a GPU's memory is
        not estimated). ``eager``: the eager forward runs (not the compiled one); ``chunked``: chunked prefill (its
        steps hold ``chunked_prefill`` tokens per input and the inputs' kept states); ``prefix``: a shared prefix's
        keys/values may be kept."""
        dtype = self.runner.dtype
        if not requests or dtype is None or self.runner.device.type != "cpu":  # device memory is not estimated
            return s
        sh, width = memory.shapes(self.model, self.runner.device, dtype, eager=eager), dtype.itemsize
        lengths = [r.length for r in requests]
        longest, seqs = max(lengths), min(len(requests), s.max_num_seqs)
        shape = pooler.shape
        shapes = shape.values() if isinstance(shape, dict) else [shape]
        head = sum(LOGIT_BLOCK_BYTES + 4 * seqs * x.cols for x in shapes if isinstance(x, SparseShape))
        per_token = 4 * sh.hidden * sum(x is None for x in shapes)  # per-token rows copied to float32
        shared = min(r.pool_start for r in requests) if prefix else 0

        def step(tokens: int) -> int:
            run = min(tokens, s.chunked_prefill * seqs) if chunked else tokens
            kept = memory.state_bytes(sh, tokens if chunked else 0, shared, dtype_bytes=width)
            return (
                memory.step_bytes(sh, run, dtype_bytes=width, sequences=seqs, longest=longest)
                + kept
                + head
                + per_token * tokens
            )

        need = memory.Need(step=step, kept=memory.kept_bytes(shape, lengths, self.model.hidden_size))
        budget = memory.fit_budget(need, budget=s.max_batch_tokens, tokens=sum(lengths), longest=longest)
        if budget == s.max_batch_tokens:
            return s
        if not stats.memory_budget:
            warn(
                f"max_batch_tokens={s.max_batch_tokens}: a step that large needs more memory than the "
                f"process may allocate (lab.runtime.memory.ceiling()); this call runs steps of at most "
                f"{budget} tokens (stats.memory_budget). Set max_batch_tokens={budget} or lower to run so "
                "without this warning",
                memory.MemoryNotice,
            )
        stats.memory_budget = min(budget, stats.memory_budget or budget)
        return dataclasses.replace(s, max_batch_tokens=budget)

    def packed_step(self, batch: list[Request], method: PoolingMethod, s: ExecSettings, path: str = "eager"):
        """One packed step, shared among the CPU workers: ``(pooled aligned with batch, Stats delta)``; ``path``:
        the forward's (``Runner.forward_path``)."""
        pooled, deltas = self.runner.pool.run_shared(
            lambda reqs: self._forward_pool(reqs, method, s, path), batch, s.workers
        )
        return pooled, Stats.concurrent(deltas)

    def _forward_pool(self, requests: list[Request], method: PoolingMethod, s: ExecSettings, path: str):
        batch = pack(requests, causal=s.causal, device=self.runner.device, backend=s.backend)
        delta = Stats(tokens_computed=batch.meta.num_tokens, padded_tokens=self.model.padding(batch.meta))
        rows = None
        if self.model.computes_output_rows:
            rows = method.rows(batch.meta.seqlens, [r.pool_start for r in requests])
        if rows is not None:
            sel = OutputRows.build(batch.meta, rows, self.runner.device)
            return method.from_rows(self.runner.forward(batch, s.num_layers, output_rows=sel, path=path)), delta
        return pool_spans(
            method, self.runner.forward(batch, s.num_layers, path=path), batch.meta, batch.pool_start, batch.pool_end
        ), delta
