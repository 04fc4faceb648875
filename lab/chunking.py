"""Causal prefill with a KV cache: chunked prefill for long inputs, and a shared-prefix (instruction) cache.

Both are the same loop. Each request has a cursor and per-layer cached keys/values of the tokens before it; a
step packs the next piece of several requests (at most ``chunk`` tokens each, under the token budget), attends
over ``cached prefix + piece`` through ``KVStep``, appends the piece's K/V to the cache and folds the piece's
pooled statistics into the request's accumulator. A request's embedding exists only after its last piece
(vLLM's rule). Under causal attention every pooling gives the result of the unchunked forward: mean and
weighted mean are accumulated as sums, cls is taken from the piece holding the first pooled token, lasttoken
from the last piece, max as a running max.

The prefix cache computes the longest token prefix that all requests of a wave share — capped at the tokens
excluded from pooling (the instruction) — once, and starts every request's cursor after it.

    >>> out = CausalPrefill(runner, chunk=512, budget=16384, max_seqs=256, backend="torch", pooling="mean")
    >>> rows, stats = out.run(requests, shared_prefix=True)       # {request.index: (hidden,) float32}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lab.batch import KVStep
from lab.inputs import Request
from lab.pooling import pool


class _LazyPrefix:
    """Per-layer concatenation of every active request's cached K (or V), built only when a layer asks."""

    def __init__(self, segments_per_request: list[list[list[torch.Tensor]]]):
        self.segs = segments_per_request  # [request][layer] -> list of (n, Hkv, D) tensors

    def __getitem__(self, layer: int) -> torch.Tensor:
        return torch.cat([t for per_layer in self.segs for t in per_layer[layer]])


@dataclass(eq=False)  # identity, not field equality: requests hold arrays
class _Active:
    req: Request
    cursor: int
    k: list[list[torch.Tensor]]  # per layer: cached key segments
    v: list[list[torch.Tensor]]
    sum: torch.Tensor | None = None  # mean / weightedmean numerator, or the cls / lasttoken / max row
    weight: float = 0.0
    cached: int = 0  # tokens in the cache

    @property
    def remaining(self) -> int:
        return self.req.length - self.cursor


@dataclass
class PrefillStats:
    tokens_computed: int = 0
    steps: int = 0
    pieces: int = 0
    shared_prefix: int = 0
    peak_cache_tokens: int = 0
    extra: dict = field(default_factory=dict)


class CausalPrefill:
    def __init__(self, runner, *, chunk: int | None, budget: int, max_seqs: int, backend: str, pooling: str):
        self.runner, self.chunk, self.budget, self.max_seqs = runner, chunk, budget, max_seqs
        self.backend, self.pooling = backend, pooling
        self.num_layers = runner.model.num_layers

    # ------------------------------------------------------------------------------------------------ public
    def run(self, requests: list[Request], *, shared_prefix: bool) -> tuple[dict[int, torch.Tensor], PrefillStats]:
        stats = PrefillStats()
        def empty() -> list[list[torch.Tensor]]:
            return [[] for _ in range(self.num_layers)]

        prefix_k, prefix_v, p = empty(), empty(), 0
        if shared_prefix and len(requests) > 1:
            p = _shared_prefix_length(requests)
        if p:
            # one pseudo-request for the shared prefix: nothing pooled, its cache becomes everyone's start
            pseudo = Request(index=-1, ids=requests[0].ids[:p], pool_start=p)
            done = self._loop([_Active(pseudo, 0, empty(), empty())], stats, keep_cache=True)
            prefix_k, prefix_v = done[0].k, done[0].v
            stats.shared_prefix = p
        active = [
            _Active(r, p, [list(x) for x in prefix_k], [list(x) for x in prefix_v], cached=p)
            for r in sorted(requests, key=lambda r: -r.length)
        ]
        finished = self._loop(active, stats, keep_cache=False)
        return {a.req.index: self._result(a) for a in finished}, stats

    # -------------------------------------------------------------------------------------------------- loop
    def _loop(self, queue: list[_Active], stats: PrefillStats, *, keep_cache: bool) -> list[_Active]:
        finished: list[_Active] = []
        running: list[_Active] = []
        queue = list(queue)
        while running or queue:
            # requests that hold a cache go first (finishing them frees memory); then admit new ones
            step, tokens = [], 0
            for a in running + queue:
                n = self._piece(a)
                if step and (tokens + n > self.budget or len(step) >= self.max_seqs):
                    break
                step.append((a, n))
                tokens += n
            for a, _ in step:
                if a not in running:
                    queue.remove(a)
                    running.append(a)
            self._step(step, keep_cache)
            stats.steps += 1
            stats.pieces += len(step)
            stats.tokens_computed += tokens
            stats.peak_cache_tokens = max(stats.peak_cache_tokens, sum(a.cached for a in running))
            for a, _ in step:
                if a.remaining == 0:
                    running.remove(a)
                    finished.append(a)
                    if not keep_cache:
                        a.k = a.v = None  # free the cache as soon as the request is done
        return finished

    def _piece(self, a: _Active) -> int:
        return a.remaining if self.chunk is None else min(self.chunk, a.remaining)

    @torch.inference_mode()
    def _step(self, step: list[tuple[_Active, int]], keep_cache: bool) -> None:
        prefix_lens = [a.cached for a, _ in step]
        kv = KVStep(num_layers=self.num_layers, capture=True)
        if any(prefix_lens):
            cu = [0]
            for n in prefix_lens:
                cu.append(cu[-1] + n)
            kv.cu_prefix = torch.tensor(cu, dtype=torch.int32, device=self.runner.device)
            kv.prefix_lens = prefix_lens
            kv.prefix_k = _LazyPrefix([a.k for a, _ in step])
            kv.prefix_v = _LazyPrefix([a.v for a, _ in step])
        ids = [a.req.ids[a.cursor : a.cursor + n] for a, n in step]
        batch = self.runner.pack([], causal=True, backend=self.backend, kv=kv,
                                 position_offsets=[a.cursor for a, _ in step], ids=ids)
        hidden = self.runner.forward(batch)
        # where pooling starts inside each piece, and how many pooled tokens came before it (weighted mean)
        local_start = [min(max(a.req.pool_start - a.cursor, 0), n) for a, n in step]
        before = [max(a.cursor - a.req.pool_start, 0) for a, _ in step]
        dev = self.runner.device
        pooled = pool(hidden, batch.meta, self.pooling, pool_start=torch.tensor(local_start, device=dev),
                      weight_offset=torch.tensor(before, device=dev))
        s = 0
        for i, (a, n) in enumerate(step):
            last = a.cursor + n == a.req.length
            if not last or keep_cache:  # the last piece's K/V is never read again
                for layer, (k, v) in enumerate(kv.captured):
                    a.k[layer].append(k[s : s + n].clone())
                    a.v[layer].append(v[s : s + n].clone())
                a.cached += n
            self._accumulate(a, pooled[i], n - local_start[i], before[i], piece_has_first=local_start[i] < n
                             and a.cursor + local_start[i] == a.req.pool_start, last=last)
            a.cursor += n
            s += n

    def _accumulate(self, a: _Active, row: torch.Tensor, n_pooled: int, before: int, *, piece_has_first: bool,
                    last: bool) -> None:
        m = self.pooling
        if m == "mean" and n_pooled:
            a.sum = row * n_pooled if a.sum is None else a.sum + row * n_pooled
            a.weight += n_pooled
        elif m == "weightedmean" and n_pooled:
            w = n_pooled * before + n_pooled * (n_pooled + 1) / 2  # weights before+1 .. before+n_pooled
            a.sum = row * w if a.sum is None else a.sum + row * w
            a.weight += w
        elif (m == "cls" and piece_has_first) or (m == "lasttoken" and last):
            a.sum = row.clone()
        elif m == "max" and n_pooled:
            a.sum = row.clone() if a.sum is None else torch.maximum(a.sum, row)

    def _result(self, a: _Active) -> torch.Tensor:
        if self.pooling in ("mean", "weightedmean"):
            return a.sum / a.weight
        return a.sum


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
