"""The KV path: causal prefill over cached keys/values -- chunked prefill for long inputs, and a shared-prefix
(instruction) cache. ``lab.engine.executor`` chooses it; it drives the model through the same stages as its forward
(``embed`` / ``run_layers`` / ``finish``, ``lab.models.base``), and shares its steps among the CPU workers.

**Chunked prefill runs layer by layer.** A prefill-only engine never decodes, so nothing needs every layer's K/V
at once. For each layer in turn, the pieces (at most ``chunk`` tokens) of a long input run in order; each piece
attends to the K/V this layer produced for the earlier pieces, and its output overwrites the input's hidden
states. Between steps a long input therefore holds its hidden states plus one layer's K/V,
``hidden + 2 * Hkv * D`` values per token: 3.8 KB for SmolLM2-135M in float32, against 46 KB for a vLLM-style
cache of every layer's K/V and about 27 KB of activations in an unchunked forward. Everything else a step
allocates scales with ``chunk``. The pooled row is computed after the last piece of the last layer, from the
hidden states the unchunked forward gives, so every pooling equals the unchunked one under causal attention. With
the ``layer`` knob only the first k layers run, and the final norm only when k is the last layer.
Several long inputs share the rounds of one layer (one packed step per round) while their tokens fit the budget.

**The prefix cache** computes the longest token prefix that all requests of a wave share, capped at the tokens
excluded from pooling (the instruction), once. Its K/V is kept for every layer (the only all-layer cache; it is
short), and every request runs from the token after it, attending to it as a prefix.

    >>> for reqs, pooled, stats in KVPath(runner, settings, pooling_method("mean")).run(requests): ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from lab.engine.call import ExecSettings, Stats
from lab.engine.inputs import Request, pack
from lab.engine.scheduler import plan_batches
from lab.ops.batch import AttnMeta, KVStep, PackedBatch
from lab.outputs.pooling import PoolingMethod, pool_spans
from lab.runtime.runner import Runner


class _PerLayer:
    """``obj[layer]`` -> ``fn(layer)``: a prefix K or V built only when that layer's attention asks for it."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.fn(layer)


@dataclass
class _Prefix:
    k: torch.Tensor  # (layers, P, Hkv, D)
    v: torch.Tensor

    @property
    def length(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class KVPath:
    """Causal prefill of one wave of requests over cached keys/values (module doc). ``run`` yields
    ``(requests, pooled, Stats)`` per step or layer-by-layer group, ``pooled`` aligned with those requests.

    Stats: ``batches`` counts packed steps (a layer-by-layer group counts its rounds once, not once per layer);
    ``chunks`` the request pieces run (a request cut into n chunks counts n); ``state_bytes`` the most K/V and
    hidden-state memory held across steps at once (the shared prefix's K/V plus one group's state, summed over
    the CPU workers' shares)."""

    def __init__(self, runner: Runner, s: ExecSettings, method: PoolingMethod):
        self.runner, self.s, self.method, self.workers = runner, s, method, s.workers
        self.model = runner.model
        self.chunk = s.chunked_prefill
        self.num_layers = self.model.num_layers
        self.depth = self.model.layers_to_run(s.num_layers)  # layers that run; the final norm only after the last

    def run(self, requests: list[Request], *, shared_prefix: bool = True):
        """Pooled rows of ``requests`` under causal attention; with ``shared_prefix`` and the prefix cache on, the
        tokens all of them share (at most their unpooled ones) run once. At depth 0 no token attends to another:
        nothing to share."""
        s, p, prefix = self.s, 0, None
        pending = Stats()  # the shared prefix's work, counted with the first step
        if shared_prefix and s.prefix_cache and len(requests) > 1 and self.depth:
            p = _shared_prefix_length(requests)
        if p:
            pseudo = Request(index=-1, ids=requests[0].ids[:p], pool_start=p)
            with torch.inference_mode():
                _, prefix, pending = self._layerwise([_Own(pseudo, p)], None, keep=True)
            pending.shared_prefix = p
        fits = [r for r in requests if self.chunk is None or r.length - p <= self.chunk]
        long = [r for r in requests if self.chunk is not None and r.length - p > self.chunk]
        for batch in plan_batches(_Own.wrap(fits, p), s.max_batch_tokens, s.max_num_seqs):
            pooled, deltas = self.runner.pool.run_shared(lambda part: self._whole(part, prefix), batch, self.workers)
            delta = Stats.concurrent(deltas)
            delta.batches = 1
            delta.add(pending)
            pending = Stats()
            yield [o.req for o in batch], pooled, delta
        for group in plan_batches(_Own.wrap(long, p), s.max_batch_tokens, s.max_num_seqs):
            pooled, deltas = self.runner.pool.run_shared(lambda part: self._group(part, prefix), group, self.workers)
            delta = Stats.concurrent(deltas)
            delta.batches = math.ceil(max(o.length for o in group) / self.chunk)  # its rounds, however shared
            delta.add(pending)
            pending = Stats()
            yield [o.req for o in group], pooled, delta

    # ----------------------------------------------------------------------------------- one step per request
    def _whole(self, batch: list[_Own], prefix: _Prefix | None) -> tuple[torch.Tensor, Stats]:
        """Requests that fit one piece: one packed step, attending to the shared prefix if there is one."""
        p = 0 if prefix is None else prefix.length
        kv = None
        if p:
            n = len(batch)
            kv = KVStep(
                num_layers=self.num_layers,
                prefix_lens=[p] * n,
                cu_prefix=torch.arange(0, (n + 1) * p, p, dtype=torch.int32, device=self.runner.device),
                prefix_k=_PerLayer(lambda layer: prefix.k[layer].repeat(n, 1, 1)),
                prefix_v=_PerLayer(lambda layer: prefix.v[layer].repeat(n, 1, 1)),
            )
        packed = self._pack([o.req for o in batch], p, kv)
        hidden = self.runner.forward(packed, self.depth)
        pooled = pool_spans(self.method, hidden, packed.meta, packed.pool_start, packed.pool_end)
        return pooled, Stats(chunks=len(batch), tokens_computed=packed.meta.num_tokens)

    # ------------------------------------------------------------------------------------------ layer by layer
    def _group(self, group: list[_Own], prefix: _Prefix | None) -> tuple[object, Stats]:
        pooled, _, stats = self._layerwise(group, prefix, keep=False)
        return pooled, stats

    def _layerwise(
        self, group: list[_Own], prefix: _Prefix | None, *, keep: bool
    ) -> tuple[object, _Prefix | None, Stats]:
        """Run ``group`` (each after the shared prefix) one layer at a time, in pieces of ``chunk`` tokens.

        Returns the pooled rows (or with ``keep``, computing the shared prefix itself, nothing pooled), the group's
        K/V of every layer with ``keep``, and the work done.
        """
        model, dev = self.model, self.runner.device
        requests = [o.req for o in group]
        p = 0 if prefix is None else prefix.length
        packed = self._pack(requests, p, None)
        lens = packed.meta.seqlens
        model.check_context(p + max(lens))
        h = model.embed(packed.input_ids, packed.positions, packed.token_type_ids, packed.meta)
        total = h.shape[0]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        chunk = self.chunk or max(lens)
        rounds = []  # per round: [(member, start within member, piece length)]
        for r in range(math.ceil(max(lens) / chunk)):
            rounds.append([(j, r * chunk, min(chunk, n - r * chunk)) for j, n in enumerate(lens) if r * chunk < n])
        steps = [self._round_step(members, starts, p, dev) for members in rounds]

        kv_k = kv_v = None  # (layers or 1, total, Hkv, D): this layer's K/V (every layer's with keep)

        def store(layer: int, k: torch.Tensor, v: torch.Tensor, rows) -> None:
            nonlocal kv_k, kv_v
            if kv_k is None:  # K/V head shapes are known from the first capture
                shape = (self.depth if keep else 1, total, *k.shape[1:])
                kv_k, kv_v = k.new_empty(shape), v.new_empty(shape)
            i = layer if keep else 0
            _put(kv_k[i], rows, k)
            _put(kv_v[i], rows, v)

        def earlier(which: str, members, layer: int) -> torch.Tensor:
            """Prefix of each member for ``layer``: the shared prefix, then this layer's K/V of its earlier pieces.
            Called by the attention after this step's capture, so the buffers exist."""
            buf = (kv_k if which == "k" else kv_v)[layer if keep else 0]
            shared = None if prefix is None else getattr(prefix, which)[layer]
            parts = []
            for j, s, _ in members:
                if shared is not None:
                    parts.append(shared)
                if s:
                    parts.append(buf[starts[j] : starts[j] + s])
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        for layer in range(self.depth):
            for members, (rows, seq_lens, prefix_lens) in zip(rounds, steps):
                kv = KVStep(num_layers=self.num_layers, capture=lambda i, k, v, rows=rows: store(i, k, v, rows))
                if any(prefix_lens):
                    cu = np.concatenate([[0], np.cumsum(prefix_lens)])
                    kv.cu_prefix = torch.tensor(cu, dtype=torch.int32, device=dev)
                    kv.prefix_lens = prefix_lens
                    kv.prefix_k = _PerLayer(lambda i, m=members: earlier("k", m, i))
                    kv.prefix_v = _PerLayer(lambda i, m=members: earlier("v", m, i))
                meta = AttnMeta.from_lengths(seq_lens, causal=True, device=dev, backend=self.s.backend, kv=kv)
                x, residual = model.run_layers(_take(h, rows), packed.positions[rows], meta, range(layer, layer + 1))
                _put(h, rows, model.finish(x, residual, meta, last=False))
        held = h.numel() * h.element_size() + (0 if kv_k is None else 2 * kv_k.numel() * kv_k.element_size())
        stats = Stats(
            batches=len(rounds),
            chunks=sum(len(m) for m in rounds),
            tokens_computed=total,
            state_bytes=held + (0 if prefix is None else prefix.nbytes),
        )
        if keep:
            return None, _Prefix(kv_k, kv_v), stats
        if self.depth == self.num_layers:  # final norm piece by piece, in place (the last layer's output only)
            for rows, _, _ in steps:
                _put(h, rows, model.finish(_take(h, rows), None, packed.meta, last=True))
        return pool_spans(self.method, h, packed.meta, packed.pool_start, packed.pool_end), None, stats

    @staticmethod
    def _round_step(members, starts, p, dev):
        """Rows of ``h`` a round reads (a slice when one member runs), its piece lengths and prefix lengths."""
        seq_lens = [n for _, _, n in members]
        prefix_lens = [p + s for _, s, _ in members]
        if len(members) == 1:
            j, s, n = members[0]
            rows = slice(starts[j] + s, starts[j] + s + n)
        else:
            rows = torch.cat([torch.arange(starts[j] + s, starts[j] + s + n, device=dev) for j, s, n in members])
        return rows, seq_lens, prefix_lens

    def _pack(self, requests: list[Request], p: int, kv: KVStep | None) -> PackedBatch:
        """The tokens of ``requests`` after the shared prefix of ``p`` tokens (``lab.engine.inputs.pack``)."""
        return pack(requests, causal=True, device=self.runner.device, backend=self.s.backend, skip=p, kv=kv)


@dataclass(eq=False)
class _Own:
    """A request seen by the scheduler with the length it computes: its tokens after the shared prefix."""

    req: Request
    length: int

    @staticmethod
    def wrap(requests: list[Request], p: int) -> list[_Own]:
        return [_Own(r, r.length - p) for r in requests]


def _take(t: torch.Tensor, rows) -> torch.Tensor:
    """Rows of ``t``: a view for a slice (one request's piece), a gather for an index tensor (several)."""
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def _put(t: torch.Tensor, rows, value: torch.Tensor) -> None:
    """Write ``value`` into the rows ``_take`` read."""
    if isinstance(rows, slice):
        t[rows] = value
    else:
        t.index_copy_(0, rows, value)


def _shared_prefix_length(requests: list[Request]) -> int:
    """Longest common token prefix of all requests, capped so it is never pooled and every request keeps at least
    one token of its own."""
    cap = min(min(r.pool_start, r.length - 1) for r in requests)
    if cap <= 0:
        return 0
    first = requests[0].ids[:cap]
    p = cap
    for r in requests[1:]:
        diff = (r.ids[:p] != first[:p]).nonzero()[0]
        if len(diff):
            p = int(diff[0])
            if p == 0:
                return 0
    return p
