"""A resumable embedding job over a corpus on Ray actors: ``embed_dataset`` reads the source in batches, sends fixed
shards of ``shard_texts`` rows to whichever actor of a ``RayEngine`` is free (``RayEngine.map_chunks``), and writes
each result as a Parquet shard recorded in a manifest (``lab.distributed.shards``), so a stopped job resumes after
its finished shards.

Actors rather than Ray Data's ``map_batches``: a resumable job needs fixed shards, each written atomically and
recorded once, which Ray Data's writers do not track; a ``ray.data.Dataset`` is still accepted as a source.

    >>> summary = embed_dataset(path, "corpus.jsonl", "out/", num_actors=8, shard_texts=2048)
    >>> ids, E = read_embeddings("out/")           # every finished shard, in source order (lab.distributed.shards)
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from lab._files import make_folder
from lab.distributed.cluster import actor_model
from lab.distributed.ray_engine import RayEngine
from lab.distributed.shards import (
    Manifest,
    job_record,
    model_digest,
    read_source,
    result_knobs,
    write_shard,
)
from lab.engine.knobs import Knobs

__all__ = ["embed_dataset"]


def embed_dataset(
    model_path,
    source,
    out_dir,
    *,
    num_actors: int = 2,
    shard_texts: int = 2048,
    knobs: dict | None = None,
    threads_per_actor: int = 1,
    address: str | None = None,
    show_progress: bool = True,
    on_shard: Callable[[dict], object] | None = None,
) -> pd.DataFrame:
    """Embed a corpus into Parquet shards of ``(id, embedding)`` on Ray actors; resumable.

        >>> summary = embed_dataset(path, "corpus.jsonl", "out/", num_actors=2, knobs={"dtype": "bfloat16"})
        >>> ids, E = read_embeddings("out/")

    Args:
        model_path: a model folder (actors are started for this job and stopped after it), or a ``RayEngine``
            whose actors and knobs to use (then ``knobs``, ``num_actors``, ``threads_per_actor``, ``address`` are
            its own).
        source: a list of strings (ids: their positions), a ``.jsonl`` / ``.jsonl.gz`` / ``.parquet`` path with an
            ``id`` and a ``text`` per row, or a ``ray.data.Dataset`` with those columns. Every row is checked
            before any actor starts: a missing or non-string text, a missing or duplicate id is a ``ValueError``.
            A file or dataset is read in batches, never whole: the driver holds 16 bytes per row (the duplicate
            check) and the texts of the shards in flight (``lab.distributed.shards.Source``).
        out_dir: ``shard-00000.parquet``, ... (shard ``k``: rows ``[k * shard_texts, (k + 1) * shard_texts)``) and
            ``manifest.json`` (the job, and per finished shard its rows, ids digest, file SHA-256, tokens, seconds,
            actor). Re-running into it skips the finished shards that check out (their files and ids as recorded)
            and recomputes the rest; a folder holding another job is refused. The job is keyed by content: the
            rows, ``shard_texts``, the model's and adapters' files (``lab.distributed.shards.model_digest``, hashed
            here when this machine holds the folder, else by an actor) and the knobs that change results, so new
            weights at the same path are another job. A folder that cannot be made (a file in its place) is an
            ``OSError`` naming it before any work; a shard or manifest write that fails (a full disk, a size limit)
            is an ``OSError`` naming the folder and the bytes it needed, the shards written before left whole.
        knobs: Engine knobs for the actors. on_shard: called with each finished shard's row after it is recorded
            (an exception raised in it stops the job; the finished shards stay).

    Returns a DataFrame over every finished shard: shard, actor, pid, rows, tokens, seconds (inside the actor),
    node, file, finished, and ``computed`` (done by this call, not an earlier one). Ctrl-C, a killed process or a
    failed write stops the job; the shards written so far are complete and recorded (each file is renamed into
    place whole, then the manifest rewritten the same way), and the next run resumes after them.
    """
    if not isinstance(shard_texts, int) or isinstance(shard_texts, bool) or shard_texts < 1:
        raise ValueError(f"shard_texts must be a positive int, got {shard_texts!r}")
    given = isinstance(model_path, RayEngine)
    if given and knobs:
        raise ValueError(
            "knobs= is for the actors embed_dataset starts; this RayEngine has its own: "
            "reng.configure(...) before calling embed_dataset(reng, ...)"
        )
    src = read_source(source)
    result_knobs(dict(knobs or {}))  # a bad knob is named before any actor starts or any model is looked up
    out = make_folder(Path(out_dir), "embed_dataset's shards", "point out_dir at a folder that can be written")
    if given:
        model, knobs = model_path.model_path, model_path.knobs
    else:
        model, knobs = actor_model(model_path, dict(knobs or {}))
    reng = model_path if given else None
    computed: set[int] = set()
    try:
        if given:
            digest = reng.model_digest()
        elif os.path.exists(model):
            digest = model_digest(model, Knobs().replace(**knobs).adapters)
        else:  # a folder the actors' nodes hold and this one does not: they hash it
            reng = RayEngine(model, num_actors, threads_per_actor, address, **knobs)
            digest = reng.model_digest()
        manifest = Manifest.open(
            out, job_record(src, shard_texts=shard_texts, model=model, digest=digest, knobs=knobs)
        )
        manifest.save()
        in_flight: dict[int, list] = {}  # shard -> its ids, while an actor embeds its texts
        from tqdm.auto import tqdm

        with tqdm(
            total=math.ceil(len(src) / shard_texts), desc="embed_dataset", unit="shard", disable=not show_progress
        ) as bar:

            def unfinished():  # the shards to compute, read from the source as the actors take them
                for k, ids, texts in src.shards(shard_texts):
                    if manifest.finished(k, ids):
                        bar.update(1)
                        continue
                    in_flight[k] = ids
                    yield k, texts, None

            todo = unfinished()
            first = next(todo, None)
            if first is not None:
                if reng is None:
                    reng = RayEngine(model, num_actors, threads_per_actor, address, **knobs)
                for res in reng.map_chunks(itertools.chain([first], todo)):
                    row = {
                        **write_shard(out, res.key, in_flight.pop(res.key), res.embeddings),
                        "tokens": res.stats.tokens,
                        "seconds": round(res.seconds, 4),
                        "actor": res.actor,
                        "pid": res.pid,
                        "node": res.node,
                        "finished": round(time.time(), 3),
                    }
                    manifest.record(res.key, row)
                    computed.add(res.key)
                    bar.update(1)
                    if on_shard is not None:
                        on_shard({"shard": res.key, **row})
    finally:
        if not given and reng is not None:
            reng.close()
    summary = manifest.summary()
    summary["computed"] = summary["shard"].isin(computed)
    return summary
