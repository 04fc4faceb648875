"""One call through the engine: what it runs (``Pass``), under which settings (``ExecSettings``), what it counts
(``Stats``), its context (``Call``: timer, progress bar, truncation warning) and where its outputs land in input
order (``OutputBuffer``).

``embed`` runs one pass; ``score`` in bi-encoder mode runs two (queries, documents) inside one ``Call``, so the
stats of a call are always one ``Stats`` counted in one place. The engine publishes them as ``engine.stats`` only
when the call succeeds: a failed or interrupted call leaves the previous call's stats.

    >>> with Call(Stats(), total=len(texts), desc="embed", show_progress=None, warned=set(), max_length=256) as c:
    ...     c.served(requests)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Self

import numpy as np

from lab._warn import warn
from lab.engine.inputs import Request
from lab.engine.scheduler import WAVE_SIZE
from lab.outputs.heads import Pooler, SparseShape


@dataclass
class Stats:
    """What the last call did. ``padded_tokens`` is 0 on the packed path; ``truncated`` counts inputs cut at
    ``max_length``; ``tokens`` are the tokens served, ``tokens_computed`` those run through the model (fewer when
    the prefix cache computed a shared instruction prefix, ``shared_prefix`` tokens long, once); ``chunks`` counts
    the pieces of the KV-cache path (chunked prefill / prefix cache) and ``state_bytes`` the most it held across
    steps (hidden states + one layer's K/V of the inputs in flight, plus the shared prefix's K/V; 0 elsewhere).

        >>> eng.embed(texts); s = eng.stats
        >>> s.tokens, s.padded_tokens, s.tokens_per_s
    """

    sequences: int = 0
    tokens: int = 0
    batches: int = 0
    padded_tokens: int = 0
    truncated: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    tokens_computed: int = 0
    chunks: int = 0
    shared_prefix: int = 0
    state_bytes: int = 0
    path: str = "packed"
    backend: str = "torch"
    adapters: tuple[str, ...] = ()  # names of the LoRA adapters merged into the weights that ran
    split: int = 0  # inputs past max_length split into windows (long_inputs="chunk"; each window is a sequence)
    model: str = ""  # the engine's model_name (a hub id or local/<folder>) ...
    revision: str = ""  # ... and revision (the snapshot's commit, or a local folder's content hash)
    memory_budget: int = 0  # the token budget steps were cut to so they fit the memory ceiling (0: not cut)

    COUNTS = ("sequences", "tokens", "batches", "padded_tokens", "truncated", "tokens_computed", "chunks", "split")

    def add(self, other: Stats, *, concurrent: bool = False) -> None:
        """Count ``other``'s work in this one: counters add up; ``shared_prefix`` is the longest; ``state_bytes``
        the most held at once (summed over ``concurrent`` work, such as CPU workers' shares of one step)."""
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.shared_prefix = max(self.shared_prefix, other.shared_prefix)
        self.state_bytes = (
            self.state_bytes + other.state_bytes if concurrent else max(self.state_bytes, other.state_bytes)
        )

    @classmethod
    def concurrent(cls, deltas: list[Stats]) -> Stats:
        """The work of ``deltas`` done at once (CPU workers' shares of one step), counted in one ``Stats``."""
        total = cls()
        for delta in deltas:
            total.add(delta, concurrent=True)
        return total

    def to_dict(self) -> dict:
        """Every field by name (a plain dict, e.g. for a DataFrame row)."""
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.sequences} sequences, {self.tokens} tokens in {self.batches} batches, "
            f"{self.seconds:.3f} s ({self.tokens_per_s:,.0f} tokens/s); padded {self.padded_tokens}, "
            f"truncated {self.truncated}{f', split {self.split}' if self.split else ''}; {self.path} / {self.backend}"
            + (f"; adapters {', '.join(self.adapters)}" if self.adapters else "")
            + (f"; {self.model} @ {self.revision[:12]}" if self.model else "")
        )


@dataclass(frozen=True)
class ExecSettings:
    """The knobs execution depends on, resolved by the engine for one call."""

    causal: bool
    backend: str
    workers: int  # the CPU workers a step is shared among (the ``cpu_workers`` knob, resolved: ``Runner.cpu_workers``)
    num_layers: int | None  # layers that run (the ``layer`` knob, resolved; ``None`` = all)
    max_batch_tokens: int
    max_num_seqs: int
    chunked_prefill: int | None
    prefix_cache: bool
    items: int = 0  # inputs of the whole call (the compiled forward's payback: ``Runner.forward_path``); 0: unknown


@dataclass(frozen=True)
class Pass:
    """One sweep over inputs: ``items`` are tokenized a wave at a time by ``tokenize(items[i:j], i)`` (requests
    numbered by item index), run through ``pooler``; ``shared_prefix``: the inputs start with the same unpooled
    tokens (an instruction, a prompt template), which the prefix cache may compute once."""

    items: list
    tokenize: Callable[[list, int], list[Request]]
    pooler: Pooler
    shared_prefix: bool = False


class OutputBuffer:
    """The outputs of one pass in input order, by ``shape`` (a pooler's, ``Pooler.shape``): a float32 array
    ``(N, *shape)``; a list of N arrays when the outputs are ragged (``None``: per-token outputs); a
    ``scipy.sparse.csr_matrix`` ``(N, cols)`` for a ``SparseShape`` (steps arrive as csr blocks of their rows); or
    a dict of these for a dict of shapes (several outputs of one forward, ``lab.outputs.kinds``)."""

    def __init__(self, n: int, shape):
        self.n, self.shape = n, shape
        if isinstance(shape, dict):
            self.rows = {name: OutputBuffer(n, s) for name, s in shape.items()}
        elif isinstance(shape, SparseShape):
            self.rows = []  # (input positions, csr block) per step
        else:
            self.rows = np.empty((n, *shape), dtype=np.float32) if shape is not None else [None] * n

    def place(self, requests: list[Request], out) -> None:
        """Write ``out`` (aligned with ``requests``: a tensor, a list, a csr matrix, or a dict of these) at the
        requests' input positions."""
        if isinstance(self.shape, dict):
            for name, buf in self.rows.items():
                buf.place(requests, out[name])
        elif isinstance(self.shape, SparseShape):
            self.rows.append((np.asarray([r.index for r in requests], dtype=np.int64), out))
        elif isinstance(self.rows, np.ndarray):
            self.rows[[r.index for r in requests]] = out.cpu().numpy()
        else:
            for r, row in zip(requests, out):
                self.rows[r.index] = row.cpu().numpy()

    def result(self):
        if isinstance(self.shape, dict):
            return {name: buf.result() for name, buf in self.rows.items()}
        if isinstance(self.shape, SparseShape):
            from scipy import sparse

            if not self.rows:
                return sparse.csr_matrix((self.n, self.shape.cols), dtype=np.float32)
            where = np.concatenate([i for i, _ in self.rows])
            stacked = sparse.vstack([m for _, m in self.rows], format="csr", dtype=np.float32)
            order = np.empty_like(where)
            order[where] = np.arange(len(where))
            return stacked[order]
        return self.rows


class Call:
    """Context of one call: times it, drives a tqdm bar (``show_progress`` ``None``: for more than ``WAVE_SIZE``
    inputs), counts what was served, and on success warns about truncation once per ``max_length`` per engine
    (``warned`` is the engine's own set; the count is always in ``stats.truncated``)."""

    def __init__(
        self, stats: Stats, *, total: int, desc: str, show_progress: bool | None, warned: set, max_length: int
    ):
        self.stats, self.total, self.desc = stats, total, desc
        self.show = total > WAVE_SIZE if show_progress is None else bool(show_progress)
        self.warned, self.max_length = warned, max_length
        self.bar = None
        self.t0 = 0.0

    def __enter__(self) -> Self:
        self.t0 = time.perf_counter()
        if self.show:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc=self.desc, unit="text")
        return self

    def served(self, requests: list[Request]) -> None:
        """Count served sequences, tokens and truncated inputs; advance the progress bar."""
        s = self.stats
        s.sequences += len(requests)
        s.tokens += sum(r.length for r in requests)
        s.truncated += sum(r.truncated for r in requests)
        if self.bar is not None:
            self.bar.update(len(requests))

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.bar is not None:
            self.bar.close()
        if exc_type is not None:
            return
        s = self.stats
        s.seconds = time.perf_counter() - self.t0
        s.tokens_per_s = s.tokens / s.seconds if s.seconds > 0 else 0.0
        if s.split and ("split", self.max_length) not in self.warned:
            self.warned.add(("split", self.max_length))
            warn(
                f"{s.split} input(s) were longer than max_length={self.max_length} tokens and were split into windows "
                "whose pooled vectors were averaged (long_inputs='chunk'; counted in stats.split; this warning is "
                "shown once per max_length)",
            )
        if s.truncated and self.max_length not in self.warned:
            self.warned.add(self.max_length)
            warn(
                f"{s.truncated} input(s) were longer than max_length={self.max_length} tokens and were truncated "
                "(counted in stats.truncated; this warning is shown once per max_length)",
            )
