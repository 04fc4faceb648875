"""The prefill-only runner: one packed batch in, one pooled row per request out. No decoding, no sampler.

It owns the model on its device, casts weights between dtypes from a master copy (so ``configure(dtype=...)``
is reversible without a reload), builds the flat inputs (``PackedBatch``) and pools by index. The KV cache exists
only for chunked prefill and the prefix cache (``lab.chunking``); a plain prefill keeps none.

**Data parallel on CPU.** A packed step's sequences are independent, so on CPU the runner splits a step across
worker threads, each running its share as its own packed forward with ``1/workers`` of the intra-op threads
(PyTorch's thread count is per thread; weights are shared). Every op then runs without the fork/join barriers of
multi-threaded kernels, and each GEMM stays on one core's cache; on the 2-core development machine this measured
1.09-1.13x (MiniLM, SciFact) and 1.08-1.09x (SmolLM2) end to end over one multi-threaded forward (paired,
interleaved runs), same embeddings. How the
sequences are shared is ``lab.scheduler.split_for_workers``; a step that cannot be shared evenly (say, one long
input with a few short ones) runs undivided on all threads.

    >>> runner = Runner(model, device=torch.device("cpu"), dtype=torch.float32)
    >>> pooled = runner.embed_batch(requests, causal=False, backend="torch", pooling="mean")   # (B, H) float32
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from lab.batch import KVStep, OutputRows, PackedBatch
from lab.inputs import Request
from lab.pooling import pool, pooled_rows
from lab.scheduler import split_for_workers


class Runner:
    def __init__(self, model: nn.Module, *, device: torch.device, dtype: torch.dtype):
        self.model = model.eval().to(device)
        self.device = device
        # master weights in their loaded precision; the live module holds casts of them
        self._master = {name: p.detach() for name, p in self.model.named_parameters()}
        # float32 copies of the parameters LoRA adapters changed (``set_merged``); the live weights cast these
        self._merged: dict[str, torch.Tensor] = {}
        self.dtype = None
        self.set_dtype(dtype)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_shape: tuple[int, int] = (0, 0)

    def set_dtype(self, dtype: torch.dtype) -> None:
        """Re-cast the live weights from the master copy, or a parameter's merged copy when adapters changed it
        (no reload; float32 shares the master's / merged copy's storage)."""
        if dtype == self.dtype:
            return
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.data = self._merged.get(name, self._master[name]).to(self.device, dtype)
        self.dtype = dtype

    @property
    def base_weights(self) -> dict[str, torch.Tensor]:
        """The master copy of every parameter as loaded (no adapters merged); read it, do not change it."""
        return self._master

    def set_merged(self, merged: dict[str, torch.Tensor]) -> None:
        """Make ``merged`` (parameter name -> float32 weight: base + LoRA deltas, ``lab.adapters.merged_weights``)
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
        self._merged = dict(merged)

    @property
    def padded_tokens(self) -> int:
        """Padding the last forward used (non-zero only for the transformers fallback)."""
        return getattr(self.model, "padded_tokens", 0)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` of one packed step, after its first ``num_layers`` layers (``None`` = all;
        the Engine's ``layer`` knob, resolved)."""
        return self.model(batch.input_ids, batch.positions, batch.meta, batch.token_type_ids, num_layers=num_layers)

    def pack(self, requests: list[Request], *, causal: bool, backend: str, kv: KVStep | None = None,
             position_offsets: list[int] | None = None, ids=None) -> PackedBatch:
        return PackedBatch.build(
            [r.ids for r in requests] if ids is None else ids,
            causal=causal,
            device=self.device,
            backend=backend,
            token_type_ids=[r.token_type_ids for r in requests] if ids is None else None,
            pool_start=[r.pool_start for r in requests] if ids is None else None,
            position_offsets=position_offsets,
            kv=kv,
        )

    @torch.inference_mode()
    def embed_batch(self, requests: list[Request], *, causal: bool, backend: str, pooling: str,
                    workers: int | None = 1, num_layers: int | None = None) -> torch.Tensor:
        """Forward and pool one batch: ``(B, hidden)`` float32 in the order of ``requests``, pooled after the first
        ``num_layers`` layers (``None`` = all; only those run).

        ``workers``: on CPU, split the batch across this many worker threads (``None`` = one per intra-op thread;
        module doc); elsewhere, or when the split would be unbalanced, one forward over the whole batch.
        """
        n = self.cpu_workers(workers, backend)
        parts = split_for_workers([r.length for r in requests], n)
        if parts is None:
            return self._embed(requests, causal, backend, pooling, num_layers)
        executor = self._workers(n)
        futures = [executor.submit(self._embed, [requests[i] for i in part], causal, backend, pooling, num_layers)
                   for part in parts]
        out = None
        for part, fut in zip(parts, futures):
            pooled = fut.result()
            if out is None:
                out = pooled.new_empty(len(requests), pooled.shape[1])
            out[part] = pooled
        return out

    @torch.inference_mode()  # thread-local: entered again in each worker
    def _embed(self, requests: list[Request], causal: bool, backend: str, pooling: str,
               num_layers: int | None = None) -> torch.Tensor:
        """One packed forward, pooled. Under ``cls`` / ``lasttoken`` pooling a model that can
        (``computes_output_rows``) runs its last computed layer for the pooled rows only (``lab.batch.OutputRows``)."""
        batch = self.pack(requests, causal=causal, backend=backend)
        if getattr(self.model, "computes_output_rows", False):
            rows = pooled_rows(batch.meta.seqlens, pooling, [r.pool_start for r in requests])
            if rows is not None:
                sel = OutputRows.build(batch.meta, rows, self.device)
                return self.model(batch.input_ids, batch.positions, batch.meta, output_rows=sel,
                                  num_layers=num_layers).float()
        hidden = self.forward(batch, num_layers)
        return pool(hidden, batch.meta, pooling, pool_start=batch.pool_start)

    def cpu_workers(self, workers: int | None, backend: str) -> int:
        """Workers a step may be split across: the knob's value (``None`` = ``torch.get_num_threads()``) on CPU
        with the torch kernels; 1 elsewhere, for the padded transformers fallback, and for the Triton backend
        (on CPU that is Triton's interpreter, which is not thread-safe)."""
        if self.device.type != "cpu" or hasattr(self.model, "hf") or backend != "torch":
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
