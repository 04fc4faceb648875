"""A resumable embedding job on disk: the source rows (read and checked), Parquet shards of ``(id, embedding)``
written atomically, and the manifest that lists the finished ones.

``lab.distributed.embed_dataset`` runs the job on Ray actors; this module holds everything that touches files and
needs no Ray (but to read a ``ray.data.Dataset``). Shard ``k`` holds source rows ``[k * shard_texts, (k + 1) *
shard_texts)``. Each shard is written to a temporary file in the output folder and renamed into place
(``os.replace``), so a crash never leaves a half-written ``shard-*.parquet``; the manifest is rewritten the same way
after every shard, and a shard counts as finished only when the manifest lists it and its file holds that many rows.
A re-run skips finished shards and refuses a folder that holds another job (other rows, shard size, model or
result-changing knobs).

    >>> src = read_source("corpus.jsonl")                     # rows with an "id" and a string "text"
    >>> man = Manifest.open("out/", job_record(src, shard_texts=2048, model=path, knobs={}))
    >>> ids, E = read_embeddings("out/")                      # every finished shard, in source order
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from lab.engine.inputs import check_encodable
from lab.engine.knobs import Knobs
from lab.eval.mteb_adapter import SCHEDULING_KNOBS

MANIFEST = "manifest.json"
FORMAT = 1  # the manifest layout; a folder written by another layout is refused, not guessed at


@dataclass
class Source:
    """The rows of a job, checked: unique ids (all ``int`` or all ``str``) and string texts, in source order."""

    ids: list
    texts: list[str]
    kind: str  # list, jsonl, parquet, ray.data.Dataset

    def __len__(self) -> int:
        return len(self.texts)

    def fingerprint(self) -> str:
        """SHA-256 over every ``(id, text)`` in order: a resume must see the same rows in the same shards."""
        h = hashlib.sha256()
        for i, t in zip(self.ids, self.texts):
            h.update(f"{i!r}\0{t}\0".encode())
        return h.hexdigest()


def read_source(source) -> Source:
    """Read and check a job's rows before any work starts.

    ``source``: a list of strings (ids are their positions), a ``.jsonl`` / ``.jsonl.gz`` or ``.parquet`` path
    whose rows have an ``id`` and a ``text``, or a ``ray.data.Dataset`` with those columns (read in order).
    Raises ``ValueError`` naming the first bad row: a missing or non-string ``text``, a missing id, ids that are
    neither all ints nor all strings, a duplicate id."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"source {path} does not exist")
        name = path.name.lower()
        if name.endswith((".jsonl", ".jsonl.gz")):
            return read_jsonl_source(path)
        if name.endswith(".parquet"):
            return read_parquet_source(path)
        raise ValueError(f"source {path}: unknown file type; use a .jsonl, .jsonl.gz or .parquet file with an 'id' "
                         "and a 'text' per row, a list of strings, or a ray.data.Dataset")
    if callable(getattr(source, "iter_batches", None)):
        return read_dataset_source(source)
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        texts = list(source)
        check_rows(list(range(len(texts))), texts, "the source list")
        return Source(list(range(len(texts))), texts, "list")
    raise ValueError(f"source must be a list of strings, a .jsonl / .parquet path or a ray.data.Dataset; got "
                     f"{type(source).__name__}")


def read_jsonl_source(path: Path) -> Source:
    ids, texts = [], []
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path} line {line_no} is not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(  # noqa: TRY004 - a bad row of the source is a ValueError, like the others
                    f"{path} line {line_no} is a JSON {type(row).__name__}, not an object with an 'id' and a 'text'")
            for key in ("id", "text"):
                if key not in row:
                    raise ValueError(f"{path} line {line_no} (row {len(ids)}) has no {key!r}; every row needs an "
                                     f"'id' and a string 'text' (it has {sorted(row)})")
            ids.append(row["id"])
            texts.append(row["text"])
    check_rows(ids, texts, str(path))
    return Source(ids, texts, "jsonl")


def read_parquet_source(path: Path) -> Source:
    import pyarrow.parquet as pq

    columns = pq.read_schema(path).names
    missing = [c for c in ("id", "text") if c not in columns]
    if missing:
        raise ValueError(f"{path} has no {' or '.join(repr(c) for c in missing)} column (it has {columns}); every "
                         "row needs an 'id' and a string 'text'")
    table = pq.read_table(path, columns=["id", "text"])
    ids, texts = table.column("id").to_pylist(), table.column("text").to_pylist()
    check_rows(ids, texts, str(path))
    return Source(ids, texts, "parquet")


def read_dataset_source(ds) -> Source:
    """A ``ray.data.Dataset``'s ``id`` and ``text`` columns, read in order (``preserve_order`` on the dataset's own
    context while reading, so the same dataset gives the same shards when a job resumes)."""
    columns = ds.columns()
    missing = [c for c in ("id", "text") if c not in columns]
    if missing:
        raise ValueError(f"the ray.data.Dataset has no {' or '.join(repr(c) for c in missing)} column (it has "
                         f"{columns}); every row needs an 'id' and a string 'text'")
    from ray.data import DataContext

    options = (getattr(ds, "context", None) or DataContext.get_current()).execution_options  # its own, if it has one
    keep, options.preserve_order = options.preserve_order, True
    ids, texts = [], []
    try:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            ids += batch.column("id").to_pylist()
            texts += batch.column("text").to_pylist()
    finally:
        options.preserve_order = keep
    check_rows(ids, texts, "the ray.data.Dataset")
    return Source(ids, texts, "ray.data.Dataset")


def check_rows(ids: list, texts: list, where: str) -> None:
    """``ValueError`` naming the first bad row of ``where``: text missing or not a string (or not valid Unicode),
    id missing, ids not all ``int`` or all ``str``, a duplicate id."""
    seen: dict = {}
    kind = None
    for row, (i, t) in enumerate(zip(ids, texts)):
        if t is None:
            raise ValueError(f"{where}: row {row} (id {i!r}) has no text; every row needs a string 'text'")
        if not isinstance(t, str):
            raise ValueError(  # noqa: TRY004 - a bad row of the source is a ValueError, like a missing text
                f"{where}: row {row} (id {i!r}) has a {type(t).__name__} text ({t!r:.40}), not a string; convert or "
                "drop it")
        check_encodable(t, f"{where}: row {row}")
        if i is None:
            raise ValueError(f"{where}: row {row} has no id")
        if isinstance(i, bool) or not isinstance(i, (int, str)):
            raise ValueError(  # noqa: TRY004 - a bad row of the source is a ValueError, like a missing id
                f"{where}: row {row} has a {type(i).__name__} id ({i!r}); ids must be ints or strings")
        if kind is None:
            kind = str if isinstance(i, str) else int
        elif not isinstance(i, kind):
            raise ValueError(f"{where}: row {row} has a {type(i).__name__} id ({i!r}) but earlier ids are "
                             f"{kind.__name__}s; use one type for every id")
        if i in seen:
            raise ValueError(f"{where}: id {i!r} appears twice (rows {seen[i]} and {row}); ids must be unique, since "
                             "each is written once")
        seen[i] = row


# -------------------------------------------------------------------------------------------------- the manifest
def result_knobs(knobs: dict) -> dict:
    """The knobs that change embeddings, checked and JSON-shaped (scheduling knobs such as ``max_batch_tokens``
    may change between a run and its resume)."""
    full = asdict(Knobs().replace(**knobs))
    return json.loads(json.dumps({k: v for k, v in full.items() if k not in SCHEDULING_KNOBS}))


def job_record(source: Source, *, shard_texts: int, model: str, knobs: dict) -> dict:
    """What a resume must match: the rows (count and fingerprint), the shard size, the model and its knobs."""
    return {"rows": len(source), "shard_texts": shard_texts, "source": source.fingerprint(), "model": model,
            "knobs": result_knobs(knobs)}


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.parquet"


class Manifest:
    """``manifest.json`` of an output folder: the job and its finished shards, rewritten atomically after each."""

    def __init__(self, out_dir: Path, job: dict, shards: dict[int, dict]):
        self.out_dir, self.job, self.shards = out_dir, job, shards

    @classmethod
    def open(cls, out_dir, job: dict) -> Manifest:
        """The folder's manifest (created empty when absent). ``ValueError`` when it records another job; stale
        temporary files of an interrupted write are removed."""
        out_dir = Path(out_dir)
        for stale in [*out_dir.glob(".shard-*.tmp"), *out_dir.glob(f".{MANIFEST}.*.tmp")]:
            stale.unlink(missing_ok=True)  # an interrupted write's leftovers: never trusted, never read
        path = out_dir / MANIFEST
        if not path.exists():
            return cls(out_dir, job, {})
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            old, shards = data["job"], {int(k): v for k, v in data["shards"].items()}
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path} is not a manifest this version can resume ({e}); use a new out_dir") from None
        diff = [k for k in sorted(set(job) | set(old)) if job.get(k) != old.get(k)]
        if diff:
            details = "; ".join(f"{k}: {old.get(k)!r} there, {job.get(k)!r} now" for k in diff if k != "source")
            if "source" in diff:
                details = "; ".join(filter(None, ["the rows (ids / texts / their order) differ", details]))
            raise ValueError(f"{out_dir} holds another job ({details}); resume with the same source, shard_texts, "
                             "model and knobs, or use a new out_dir")
        return cls(out_dir, job, shards)

    def finished(self, shard: int, rows: int) -> bool:
        """Listed, and its file holds ``rows`` rows (read from the Parquet footer, not the data)."""
        import pyarrow.parquet as pq

        record = self.shards.get(shard)
        if record is None or record.get("rows") != rows:
            return False
        try:
            return pq.read_metadata(self.out_dir / record["file"]).num_rows == rows
        except (OSError, ValueError):
            return False

    def record(self, shard: int, row: dict) -> None:
        """Add a finished shard (its file already in place) and rewrite the manifest."""
        self.shards[shard] = row
        self.save()

    def save(self) -> None:
        """Write the manifest atomically (the job is recorded before the first shard, so a folder is never
        mistaken for another job's)."""
        data = {"format": FORMAT, "job": self.job,
                "shards": {str(k): self.shards[k] for k in sorted(self.shards)}}
        atomic_write(self.out_dir / MANIFEST, json.dumps(data, indent=1).encode("utf-8"))

    def summary(self) -> pd.DataFrame:
        """One row per finished shard: shard, actor, pid, rows, tokens, seconds, node, file, finished (epoch s)."""
        cols = ["shard", "actor", "pid", "rows", "tokens", "seconds", "node", "file", "finished"]
        rows = [{"shard": k, **{c: v.get(c) for c in cols[1:]}} for k, v in sorted(self.shards.items())]
        return pd.DataFrame(rows, columns=cols)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, flush it to disk, then rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(out_dir: Path, shard: int, ids: list, embeddings: np.ndarray) -> str:
    """Write one shard, ``id`` and ``embedding`` (a fixed-size list of float32), atomically; returns its name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
    n, dim = embeddings.shape
    if n != len(ids):
        raise ValueError(f"shard {shard}: {len(ids)} ids but {n} embeddings")
    column = pa.FixedSizeListArray.from_arrays(pa.array(embeddings.reshape(-1)), dim)
    table = pa.table({"id": pa.array(ids), "embedding": column})
    name = shard_name(shard)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write(Path(out_dir) / name, sink.getvalue().to_pybytes())
    return name


def read_embeddings(out_dir) -> tuple[list, np.ndarray]:
    """``(ids, embeddings (n, dim) float32)`` of every shard the manifest lists as finished, in source order."""
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    data = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    ids, parts = [], []
    for key in sorted(data["shards"], key=int):
        table = pq.read_table(out_dir / data["shards"][key]["file"])
        ids += table.column("id").to_pylist()
        col = table.column("embedding").combine_chunks()
        parts.append(col.flatten().to_numpy().reshape(len(col), -1))
    return ids, (np.concatenate(parts) if parts else np.zeros((0, 0), dtype=np.float32))
