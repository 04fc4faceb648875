"""Past one machine: one ``Engine`` per Ray actor, to embed corpora and run MTEB across a cluster.

``RayEngine`` holds ``num_actors`` actors, each one ``Engine`` on ``threads_per_actor`` CPU threads (and one GPU
when the cluster has GPUs). ``embed`` cuts the texts into one contiguous range per actor with equal token counts
(lengths from ``Engine.tokenize`` on the actors, instruction and truncation included), so the actors finish
together, and puts the rows back in input order. Every call carries the knobs set so far, so ``configure`` reaches
every actor, one that Ray restarted included. ``map_chunks`` feeds chunks to whichever actor is free, two in
flight per actor so none waits on the driver: what ``lab.distributed.dataset.embed_dataset``'s resumable jobs run
on.

Faults are left to Ray: actors are created with ``max_restarts`` and their calls with as many retries, so an actor
killed mid-call comes back (its Engine reloads) and the call runs again; nothing is written until a shard's result
is back, so a shard is written once. An actor whose Engine cannot load fails the constructor with its own error.

    >>> reng = RayEngine(path, num_actors=2)      # a new local cluster; address="auto" joins `ray start --head`
    >>> E = reng.embed(texts)                     # Engine(path).embed(texts), same rows, same order
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Self

import numpy as np
import pandas as pd

from lab.distributed.cluster import (  # ray: imported there, with the install hint where it is missing
    FORWARDED_ENV,
    actor_model,
    check_room,
    connect,
    get,
    ray,
    wait_ready,
    wants_gpu,
)
from lab.distributed.shards import model_digest
from lab.engine.call import Stats
from lab.engine.inputs import check_texts
from lab.engine.knobs import Knobs
from lab.engine.scheduler import WAVE_SIZE

__all__ = ["ChunkResult", "RayEngine", "RayStats", "split_by_tokens"]

IN_FLIGHT = 2  # calls queued per actor: the next one is there when the last returns
CHUNK_TEXTS = WAVE_SIZE  # texts per call in RayEngine.embed (progress, and what a restart redoes)
PER_ACTOR = ["actor", "pid", "node", "calls", *Stats.COUNTS, "seconds", "tokens_per_s"]
_UNSET = object()
_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's open RayEngines: what holds the cluster, when it is full


class EngineActor:
    """One ``Engine`` in one Ray actor process. Each call carries the driver's knobs and applies them first when they
    differ from this actor's: Ray rebuilds a restarted actor from its constructor arguments, the knobs it started
    with, and the next call brings it up to date."""

    def __init__(self, model_path: str, knobs: dict, threads: int, index: int):
        import torch

        torch.set_num_threads(threads)
        from lab.engine import Engine

        self.engine = Engine(model_path, **knobs)
        self.knobs = dict(knobs)
        self.index, self.pid, self.node = index, os.getpid(), ray.util.get_node_ip_address()

    def sync(self, knobs: dict) -> None:
        if knobs != self.knobs:
            self.engine.configure(**knobs)
            self.knobs = dict(knobs)

    def info(self, knobs: dict | None = None) -> dict:
        """What the driver shows of the engine (after applying ``knobs``, when given)."""
        if knobs is not None:
            self.sync(knobs)
        e = self.engine
        return {
            "actor": self.index,
            "pid": self.pid,
            "node": self.node,
            "model_name": e.model_name,
            "embedding_dim": e.embedding_dim,
            "knobs": e.knobs,
            "resolved": e.resolved,
            "num_layers": e.num_layers,
            "adapter_ids": e.adapter_ids,
            "is_cross_encoder": e.is_cross_encoder,
            "revision": e.revision,
        }

    def validate(self, knobs: dict) -> Knobs:
        return self.engine.validate(**knobs)

    def model_digest(self) -> str:
        return model_digest(self.engine.model_path, self.engine.knobs["adapters"])

    def lengths(self, texts: list[str], knobs: dict, call: dict) -> np.ndarray:
        self.sync(knobs)
        return np.array([r.length for r in self.engine.tokenize(texts, **call)], dtype=np.int64)

    def embed(self, texts: list[str], knobs: dict, call: dict) -> dict:
        self.sync(knobs)
        t0 = time.perf_counter()
        emb = self.engine.embed(texts, show_progress=False, **call)
        return {
            "embeddings": emb,
            "stats": self.engine.stats.to_dict(),
            "actor": self.index,
            "pid": self.pid,
            "node": self.node,
            "seconds": time.perf_counter() - t0,
        }


@dataclass
class RayStats(Stats):
    """``Stats`` of a ``RayEngine`` call: the actors' counters summed, ``seconds`` the call's wall time on the driver
    (``tokens_per_s`` over it), and ``per_actor``, one row per actor: its last pid and node, ``calls``, its counters,
    the ``seconds`` it was busy and its ``tokens_per_s`` while busy.

        >>> reng.embed(texts); reng.stats.tokens, reng.stats.per_actor[["actor", "tokens", "seconds"]]
    """

    actors: int = 0
    per_actor: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=PER_ACTOR), repr=False, compare=False)

    def __str__(self) -> str:
        return f"{super().__str__()}; over {self.actors} Ray actor(s)"


@dataclass
class ChunkResult:
    """One chunk embedded by one actor: its rows in the chunk's order, the Engine's stats of that call, which actor
    (index, process, node) ran it and for how long (seconds inside the actor).

        >>> for res in reng.map_chunks([("a", texts[:100], None), ("b", texts[100:], None)]):
        ...     print(res.key, res.embeddings.shape, res.actor, res.seconds)
    """

    key: object
    embeddings: np.ndarray
    stats: Stats
    actor: int
    pid: int
    node: str
    seconds: float


class RayEngine:
    """``num_actors`` Engines on a Ray cluster, used like one Engine.

        >>> reng = RayEngine(path, num_actors=2, threads_per_actor=1, pooling="mean")
        >>> E = reng.embed(texts)               # Engine.embed's rows, in input order
        >>> reng.configure(pooling="cls"); reng.close()

    Args:
        model_path: a model folder every node can read at this path (a shared filesystem, or a copy on each node),
            or a hub id (``org/name``, with the ``revision`` knob or ``org/name@rev``): the driver pins the revision
            to its commit (``lab.models.hub.pin``) and every actor loads that commit from its node's Hugging Face
            cache, fetching it there when need be.
        num_actors: Engines, one per Ray actor (one GPU each when the cluster has GPUs, unless ``device="cpu"``).
        threads_per_actor: CPU threads (Ray ``num_cpus``) of each actor; its Engine runs on that many.
        address: ``None`` starts a new local cluster (the running Ray connection is used when there is one);
            ``"auto"`` joins a cluster started with ``ray start --head`` on this machine, ``"ray://head:10001"``
            connects a Ray client, ``"head-ip:6379"`` a driver on a cluster node.
        max_restarts: how often Ray restarts an actor that died; its calls are retried as often.
        load_timeout: seconds to wait for every actor's Engine to load before giving up (naming the resources).
            Before any actor starts, the cluster's free CPUs (and GPUs) are checked: when they stay short of what
            the actors ask for (``lab.distributed.cluster.PLACE_WAIT`` seconds), a ``RuntimeError`` says what is
            needed, what is free, and which RayEngines of this process hold the rest.
        **knobs: Engine knobs (``pooling``, ``dtype``, ...), as in ``Engine(...)``; ``configure`` changes them live.
            Leave ``device`` at ``auto`` (or ``cuda``) on GPUs: Ray gives each actor one GPU, which it sees as
            ``cuda:0``.
    """

    def __init__(
        self,
        model_path,
        num_actors: int = 2,
        threads_per_actor: int = 1,
        address: str | None = None,
        *,
        max_restarts: int = 3,
        load_timeout: float = 600.0,
        **knobs,
    ):
        for name, v in (("num_actors", num_actors), ("threads_per_actor", threads_per_actor)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(model_path, (str, os.PathLike)):
            raise TypeError(f"model_path must be a path to a model folder, got {type(model_path).__name__}")
        Knobs().replace(**knobs)  # an unknown knob or a bad value is named before any actor starts
        self.model_path, knobs = actor_model(model_path, knobs)
        self.threads_per_actor = threads_per_actor
        self._knobs = dict(knobs)
        self._stats = RayStats()
        self._actors: list = []
        self._started_ray = connect(address)
        options = {
            "num_cpus": threads_per_actor,
            "num_gpus": 1 if wants_gpu(knobs.get("device", "auto")) else 0,
            "max_restarts": max_restarts,
            "max_task_retries": max_restarts,
        }
        env = {k: v for k, v in os.environ.items() if k in FORWARDED_ENV or k.startswith("LAB_")}
        if env:
            options["runtime_env"] = {"env_vars": env}
        check_room(num_actors, options, _LIVE)
        actor_class = ray.remote(EngineActor).options(**options)
        self._actors = [
            actor_class.remote(self.model_path, self._knobs, threads_per_actor, i) for i in range(num_actors)
        ]
        try:
            self._info = wait_ready([a.info.remote() for a in self._actors], load_timeout, self.model_path, options)[0]
        except BaseException:
            self.close()
            raise
        _LIVE.add(self)

    # ------------------------------------------------------------------------------------------ what it shows
    @property
    def actors(self) -> list:
        """The Ray actor handles, one per Engine (``ray.kill(reng.actors[0], no_restart=False)`` restarts one)."""
        return list(self._actors)

    @property
    def stats(self) -> RayStats:
        """The last call's stats: summed over the actors, with ``stats.per_actor`` (a DataFrame, one row each)."""
        return self._stats

    @property
    def knobs(self) -> dict:
        """Current knob values as set (``None`` = the model's default), as the actors hold them."""
        return dict(self._info["knobs"])

    @property
    def resolved(self) -> dict:
        """The knob values that run, with model defaults filled in (``Engine.resolved`` of an actor)."""
        return dict(self._info["resolved"])

    @property
    def model_name(self) -> str:
        return self._info["model_name"]

    @property
    def embedding_dim(self) -> int:
        return self._info["embedding_dim"]

    @property
    def num_layers(self) -> int | None:
        return self._info["num_layers"]

    @property
    def adapter_ids(self) -> list[str]:
        return list(self._info["adapter_ids"])

    @property
    def is_cross_encoder(self) -> bool:
        return self._info["is_cross_encoder"]

    @property
    def revision(self) -> str:
        """What the actors loaded (``Engine.revision``): the snapshot's commit for a hub id, a local folder's content
        hash otherwise. MTEB results are cached by it, and the driver need not hold the folder."""
        return self._info["revision"]

    def model_digest(self) -> str:
        """``lab.distributed.shards.model_digest`` of the actors' model and adapters, computed on an actor (the
        driver need not hold the folder): the content ``embed_dataset`` keys its job by."""
        return get(self._live()[0].model_digest.remote())

    def __repr__(self) -> str:
        r = self.resolved
        return (
            f"RayEngine({self.model_name!r}, {len(self._actors)} actors x {self.threads_per_actor} thread(s), "
            f"pooling={r['pooling']}, normalize={r['normalize']}, dtype={r['dtype']}, device={r['device']})"
        )

    # ------------------------------------------------------------------------------------------------- knobs
    def validate(self, **knobs) -> Knobs:
        """Check a knob change on one actor without applying it (``Engine.validate``): the new knob values, or the
        Engine's ``ValueError`` / ``TypeError`` naming the knob and its valid values."""
        new = {**self._knobs, **knobs}
        Knobs().replace(**new)
        return get(self._live()[0].validate.remote(new))

    def configure(self, **knobs) -> RayEngine:
        """Change knobs live on every actor (no reload). Checked on one actor first: on error nothing changes.
        A restarted actor gets them with its next call. Returns ``self``."""
        self.validate(**knobs)
        new = {**self._knobs, **knobs}
        infos = get([a.info.remote(new) for a in self._actors])
        self._knobs, self._info = new, infos[0]
        return self

    # ------------------------------------------------------------------------------------------------- embed
    def token_lengths(self, texts: list[str], *, instruction=_UNSET) -> np.ndarray:
        """Tokens per text as the actors' Engines count them (special tokens, instruction, truncation), computed
        on all actors at once, one contiguous part each."""
        texts = check_texts(texts)
        return self._lengths(texts, {} if instruction is _UNSET else {"instruction": instruction})

    def _lengths(self, texts: list[str], call: dict) -> np.ndarray:
        actors = self._live()
        parts = [(a, b) for a, b in split_by_tokens(np.ones(len(texts)), len(actors)) if b > a]
        refs = [actors[i].lengths.remote(texts[a:b], self._knobs, call) for i, (a, b) in enumerate(parts)]
        return np.concatenate(get(refs)) if refs else np.zeros(0, dtype=np.int64)

    def embed(self, texts: list[str], *, instruction=_UNSET, show_progress: bool | None = None) -> np.ndarray:
        """Embed ``texts`` across the actors -> ``(len(texts), dim)`` float32, in input order (as ``Engine.embed``).

        Each actor gets one contiguous range of the texts holding ``1 / num_actors`` of the tokens, sent in calls of
        at most ``CHUNK_TEXTS`` texts. ``instruction`` overrides the knob for this call; ``show_progress``: a tqdm
        bar over texts (``None``: for more than ``CHUNK_TEXTS`` texts)."""
        texts = check_texts(texts)
        call = {} if instruction is _UNSET else {"instruction": instruction}
        t0 = time.perf_counter()
        if not texts:
            self._stats = RayStats(actors=len(self._live()))
            return np.zeros((0, self.embedding_dim), dtype=np.float32)
        ranges = split_by_tokens(self._lengths(texts, call), len(self._actors))
        chunks = [
            ((a, b), texts[a:b], actor)
            for actor, (start, stop) in enumerate(ranges)
            for a, b in pieces(start, stop, CHUNK_TEXTS)
        ]
        from tqdm.auto import tqdm

        show = len(texts) > CHUNK_TEXTS if show_progress is None else bool(show_progress)
        out, results = None, []
        with tqdm(total=len(texts), desc="embed (ray)", unit="text", disable=not show) as bar:
            for res in self.map_chunks(chunks, call=call):
                a, b = res.key
                if out is None:
                    out = np.empty((len(texts), *res.embeddings.shape[1:]), dtype=np.float32)
                out[a:b] = res.embeddings
                results.append(res)
                bar.update(b - a)
        self._stats = summarize(results, time.perf_counter() - t0, len(self._actors))
        return out

    def map_chunks(
        self, chunks: Iterable[tuple], *, call: dict | None = None, in_flight: int = IN_FLIGHT
    ) -> Iterator[ChunkResult]:
        """Embed chunks on the actors and yield each ``ChunkResult`` as it comes back (completion order).

        ``chunks``: ``(key, texts, actor)``, ``actor`` an index for a fixed actor or ``None`` for whichever is free
        first, read as the actors take them (an iterator of chunks is never held whole). Each actor has up to
        ``in_flight`` calls queued, and its next is sent before a result is yielded, so the actors work while the
        caller handles it. A call that an actor's death interrupts is retried by Ray on
        the restarted actor; an error inside a call is raised here. Closing the iterator early (an exception,
        Ctrl-C) cancels the calls still queued."""
        actors, call = self._live(), dict(call or {})
        own, rest = [deque() for _ in actors], iter(chunks)
        pending: dict = {}

        def take(i: int) -> tuple | None:
            """Actor ``i``'s next chunk: one waiting for it, else the next of ``chunks`` it may take (those for
            another fixed actor met on the way wait for it)."""
            if own[i]:
                return own[i].popleft()
            for key, texts, actor in rest:
                if actor is None or actor == i:
                    return key, texts
                own[actor].append((key, texts))
            return None

        def submit(i: int) -> None:
            chunk = take(i)
            if chunk is not None:
                pending[actors[i].embed.remote(chunk[1], self._knobs, call)] = (chunk[0], i)

        for _ in range(in_flight):
            for i in range(len(actors)):
                submit(i)
        try:
            while pending:
                [ref], _ = ray.wait(list(pending), num_returns=1)
                key, i = pending.pop(ref)
                res = get(ref)
                submit(i)
                yield ChunkResult(
                    key,
                    res["embeddings"],
                    Stats(**res["stats"]),
                    res["actor"],
                    res["pid"],
                    res["node"],
                    res["seconds"],
                )
        finally:
            for ref in pending:
                with contextlib.suppress(Exception):  # best effort: a call that cannot be cancelled just finishes
                    ray.cancel(ref)

    # ------------------------------------------------------------------------------------------------ studies
    def as_mteb_model(self, **kwargs):
        """These actors as one mteb 2.x encoder (``lab.eval.mteb_adapter.as_mteb_model``, same keyword arguments): mteb
        hands each task's texts to ``embed``, which spreads them over the actors."""
        if self.is_cross_encoder:
            raise ValueError(
                "RayEngine distributes embed only; evaluate a cross-encoder with Engine(path).as_mteb_model()"
            )
        from lab.eval.mteb_adapter import as_mteb_model

        return as_mteb_model(self, **kwargs)

    # ---------------------------------------------------------------------------------------------- lifecycle
    def _live(self) -> list:
        if not self._actors:
            raise RuntimeError("this RayEngine is closed; create a new one")
        return self._actors

    def close(self) -> None:
        """Stop the actors (and the local Ray cluster, when this RayEngine started it)."""
        for a in self._actors:
            with contextlib.suppress(Exception):  # an actor already gone is what we want
                ray.kill(a, no_restart=True)
        self._actors = []
        _LIVE.discard(self)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------- helpers
def split_by_tokens(lengths, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` ranges covering ``range(len(lengths))`` whose token sums are as equal
    as cuts between texts allow: each cut is the one nearest its share, so a range's sum is within the longest
    text of ``sum / parts``. Ranges are empty when there are fewer texts than parts.

        >>> split_by_tokens([5, 1, 1, 1, 1, 1], 2)
        [(0, 1), (1, 6)]
    """
    lengths = np.asarray(lengths, dtype=np.float64)
    n = len(lengths)
    cum = np.concatenate([[0.0], np.cumsum(lengths)])  # cum[i]: tokens before text i
    bounds = [0]
    for k in range(1, parts):
        target = cum[-1] * k / parts
        i = int(np.searchsorted(cum, target))  # the first cut with at least the target before it
        if i > 0 and target - cum[i - 1] < cum[i] - target:
            i -= 1
        bounds.append(min(max(i, bounds[-1]), n))
    bounds.append(n)
    return list(itertools.pairwise(bounds))


def pieces(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]


def summarize(results: list[ChunkResult], wall: float, actors: int) -> RayStats:
    """One call's ``RayStats`` from its chunks: counters summed, seconds = ``wall``, and per-actor rows."""
    total = RayStats(
        actors=actors, path=results[0].stats.path, backend=results[0].stats.backend, adapters=results[0].stats.adapters
    )
    rows: dict[int, dict] = {}
    for r in results:
        total.add(r.stats, concurrent=True)
        row = rows.setdefault(
            r.actor, {"actor": r.actor, "calls": 0, "seconds": 0.0, **dict.fromkeys(Stats.COUNTS, 0)}
        )
        row.update(pid=r.pid, node=r.node, calls=row["calls"] + 1, seconds=row["seconds"] + r.seconds)
        for c in Stats.COUNTS:
            row[c] += getattr(r.stats, c)
    for row in rows.values():
        row["tokens_per_s"] = row["tokens"] / row["seconds"] if row["seconds"] > 0 else 0.0
    total.seconds = wall
    total.tokens_per_s = total.tokens / wall if wall > 0 else 0.0
    total.per_actor = pd.DataFrame([rows[k] for k in sorted(rows)], columns=PER_ACTOR)
    return total
