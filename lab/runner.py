"""The prefill-only runner: one packed batch in, one pooled row per request out. No decoding, no sampler.

It owns the model on its device, casts weights between dtypes from a master copy (so ``configure(dtype=...)``
is reversible without a reload), builds the flat inputs (``PackedBatch``) and pools by index. The KV cache exists
only for chunked prefill and the prefix cache (``lab.chunking``); a plain prefill keeps none.

    >>> runner = Runner(model, device=torch.device("cpu"), dtype=torch.float32)
    >>> pooled = runner.embed_batch(requests, causal=False, backend="torch", pooling="mean")   # (B, H) float32
"""

from __future__ import annotations

import torch
from torch import nn

from lab.batch import KVStep, PackedBatch
from lab.inputs import Request
from lab.pooling import pool


class Runner:
    def __init__(self, model: nn.Module, *, device: torch.device, dtype: torch.dtype):
        self.model = model.eval().to(device)
        self.device = device
        # master weights in their loaded precision; the live module holds casts of them
        self._master = {name: p.detach() for name, p in self.model.named_parameters()}
        self.dtype = None
        self.set_dtype(dtype)

    def set_dtype(self, dtype: torch.dtype) -> None:
        """Re-cast the live weights from the master copy (no reload; float32 shares the master's storage)."""
        if dtype == self.dtype:
            return
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.data = self._master[name].to(self.device, dtype)
        self.dtype = dtype

    @property
    def padded_tokens(self) -> int:
        """Padding the last forward used (non-zero only for the transformers fallback)."""
        return getattr(self.model, "padded_tokens", 0)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` of one packed step."""
        return self.model(batch.input_ids, batch.positions, batch.meta, batch.token_type_ids)

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
    def embed_batch(self, requests: list[Request], *, causal: bool, backend: str, pooling: str) -> torch.Tensor:
        """Forward and pool one batch: ``(B, hidden)`` float32 in the order of ``requests``."""
        batch = self.pack(requests, causal=causal, backend=backend)
        hidden = self.forward(batch)
        return pool(hidden, batch.meta, pooling, pool_start=batch.pool_start)
