"""A resumable embedding job on disk: the source rows (read and checked), Parquet shards of ``(id, embedding)``
written atomically, and the manifest that lists the finished ones.

``lab.distributed.embed_dataset`` runs the job on Ray actors; this module holds everything that touches files and
needs no Ray (but to read a ``ray.data.Dataset``). Shard ``k`` holds source rows ``[k * shard_texts, (k + 1) *
shard_texts)``. Each shard is written to a temporary file in the output folder and renamed into place
(``os.replace``), so a crash never leaves a half-written ``shard-*.parquet``; the manifest is rewritten the same way
after every shard and records, per shard, its file's SHA-256 and a digest of its ids. A write that fails (a full
disk, a file size limit, a folder that cannot be written) raises an ``OSError`` naming the folder, the bytes it
needed and what to do (``lab._files.atomic_write``), and leaves the files written before whole.

A job is keyed by what computes its vectors, not by paths: the rows (a fingerprint of every id and text), the shard
size, ``model_digest`` (the content of the model's weights, tokenizer and config files and of the adapters', in
order) and the knobs that change results. A re-run into the folder of the same job skips the shards that check out
(listed, the file's SHA-256 as recorded, its ids those of the shard's rows) and recomputes the others; a folder of
another job, a manifest entry beyond the job's shards or one whose file is not a plain name inside the folder is
refused. ``read_embeddings`` checks every shard the same way and names the file that does not match.

    >>> src = read_source("corpus.jsonl")                     # rows with an "id" and a string "text"
    >>> job = job_record(src, shard_texts=2048, model=path, digest=model_digest(path), knobs={})
    >>> man = Manifest.open("out/", job)
    >>> ids, E = read_embeddings("out/")                      # every finished shard, in source order
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from lab._files import NO_ROOM, atomic_write
from lab.engine.inputs import check_encodable
from lab.engine.knobs import Knobs
from lab.eval.mteb_adapter import SCHEDULING_KNOBS

MANIFEST = "manifest.json"
FORMAT = 2  # the manifest layout; a folder written by another layout is refused, not guessed at
INT64 = (-(2**63), 2**63 - 1)  # the ids Parquet's int64 column holds
# model-folder files a loader never reads (other frameworks' weights, docs): left out of model_digest
NOT_READ = (".md", ".h5", ".msgpack", ".ot", ".onnx")
INFO_KEYS = ("model", "adapters")  # recorded in the job for people to read; a resume compares the content instead
# what to do when a shard or the manifest cannot be written (a full disk, a size limit, a read-only folder)
JOB_FIX = (
    f"{NO_ROOM} and run embed_dataset again: it resumes after the shards already written; or point out_dir at "
    "a folder with room (the job starts over there)"
)


BATCH_ROWS = 8192  # rows a file or dataset source is read in at a time


class Source:
    """The rows of a job, checked once (``read_source``) and read again in order, shard by shard (``shards``). A file
    or a dataset is never held in memory whole: the check keeps 16 bytes per row (a hash of its id, for the
    duplicate check) and a shard's rows are read when the shard is sent. ``batches()`` yields ``(ids, texts)`` lists
    in source order, ``kind``: list, jsonl, parquet, ray.data.Dataset."""

    def __init__(self, kind: str, batches: Callable[[], Iterator[tuple[list, list]]], where: str):
        self.kind, self.where, self.batches = kind, where, batches
        self.rows, self._fingerprint = _check_rows(batches, where)

    def __len__(self) -> int:
        return self.rows

    def fingerprint(self) -> str:
        """SHA-256 over every ``(id, text)`` in order, each field length-prefixed (no text or id can pass for
        another's end): a resume must see the same rows in the same shards."""
        return self._fingerprint

    def shards(self, size: int) -> Iterator[tuple[int, list, list[str]]]:
        """``(k, ids, texts)`` of shard ``k`` (rows ``[k * size, (k + 1) * size)``) for every shard, in order."""
        ids: list = []
        texts: list[str] = []
        k = 0
        for more_ids, more_texts in self.batches():
            ids += more_ids
            texts += more_texts
            if len(ids) >= size:
                for start in range(0, len(ids) - size + 1, size):
                    yield k, ids[start : start + size], texts[start : start + size]
                    k += 1
                cut = len(ids) - len(ids) % size
                ids, texts = ids[cut:], texts[cut:]
        if ids:
            yield k, ids, texts

    @property
    def ids(self) -> list:
        """Every id in order (reads the whole source: for small sources)."""
        return [i for ids, _ in self.batches() for i in ids]

    @property
    def texts(self) -> list[str]:
        """Every text in order (reads the whole source: for small sources)."""
        return [t for _, texts in self.batches() for t in texts]


def framed(data: bytes) -> bytes:
    """``data`` prefixed with its length (8 bytes, little-endian)."""
    return len(data).to_bytes(8, "little") + data


def id_bytes(i) -> bytes:
    """An id as bytes that tell ints from strings (``1`` and ``"1"`` differ)."""
    return (b"i" + str(i).encode()) if isinstance(i, int) else (b"s" + str(i).encode("utf-8"))


def ids_digest(ids) -> str:
    """SHA-256 over ``ids`` in order (length-prefixed, ints told from strings): what a shard's file must hold."""
    h = hashlib.sha256()
    for i in ids:
        h.update(framed(id_bytes(i)))
    return h.hexdigest()


def read_source(source) -> Source:
    """Check a job's rows before any work starts, reading them once in batches (``Source``).

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
            return Source("jsonl", functools.partial(_jsonl_batches, path), str(path))
        if name.endswith(".parquet"):
            _parquet_columns(path)
            return Source("parquet", functools.partial(_parquet_batches, path), str(path))
        raise ValueError(
            f"source {path}: unknown file type; use a .jsonl, .jsonl.gz or .parquet file with an 'id' "
            "and a 'text' per row, a list of strings, or a ray.data.Dataset"
        )
    if callable(getattr(source, "iter_batches", None)):
        columns = source.columns()
        missing = [c for c in ("id", "text") if c not in columns]
        if missing:
            raise ValueError(
                f"the ray.data.Dataset has no {' or '.join(repr(c) for c in missing)} column (it has "
                f"{columns}); every row needs an 'id' and a string 'text'"
            )
        return Source("ray.data.Dataset", functools.partial(_dataset_batches, source), "the ray.data.Dataset")
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        texts = list(source)
        return Source("list", lambda: iter([(list(range(len(texts))), texts)]), "the source list")
    raise ValueError(
        f"source must be a list of strings, a .jsonl / .parquet path or a ray.data.Dataset; got "
        f"{type(source).__name__}"
    )


def _jsonl_batches(path: Path) -> Iterator[tuple[list, list]]:
    ids, texts, row = [], [], 0
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path} line {line_no} is not valid JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(  # noqa: TRY004 - a bad row of the source is a ValueError, like the others
                    f"{path} line {line_no} is a JSON {type(record).__name__}, not an object with an 'id' and a 'text'"
                )
            for key in ("id", "text"):
                if key not in record:
                    raise ValueError(
                        f"{path} line {line_no} (row {row}) has no {key!r}; every row needs an "
                        f"'id' and a string 'text' (it has {sorted(record)})"
                    )
            ids.append(record["id"])
            texts.append(record["text"])
            row += 1
            if len(ids) == BATCH_ROWS:
                yield ids, texts
                ids, texts = [], []
    if ids:
        yield ids, texts


def _parquet_columns(path: Path) -> None:
    import pyarrow.parquet as pq

    columns = pq.read_schema(path).names
    missing = [c for c in ("id", "text") if c not in columns]
    if missing:
        raise ValueError(
            f"{path} has no {' or '.join(repr(c) for c in missing)} column (it has {columns}); every "
            "row needs an 'id' and a string 'text'"
        )


def _parquet_batches(path: Path) -> Iterator[tuple[list, list]]:
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as f:
        for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=["id", "text"]):
            yield batch.column("id").to_pylist(), batch.column("text").to_pylist()


def _dataset_batches(ds) -> Iterator[tuple[list, list]]:
    """A ``ray.data.Dataset``'s ``id`` and ``text`` columns, read in order (``preserve_order`` on the dataset's own
    context while reading, so the same dataset gives the same shards when a job resumes)."""
    from ray.data import DataContext

    options = (getattr(ds, "context", None) or DataContext.get_current()).execution_options  # its own, if it has one
    keep, options.preserve_order = options.preserve_order, True
    try:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=BATCH_ROWS):
            yield batch.column("id").to_pylist(), batch.column("text").to_pylist()
    finally:
        options.preserve_order = keep


def _check_rows(batches: Callable[[], Iterator[tuple[list, list]]], where: str) -> tuple[int, str]:
    """Read the rows once: ``ValueError`` naming the first bad row of ``where`` (text missing or not a string, or
    not valid Unicode; id missing, ids not all ``int`` or all ``str``, an int id outside 64 bits (Parquet's), a
    duplicate id), else ``(rows, fingerprint)``. Duplicates are found by sorting 16-byte hashes of the ids, then
    confirmed (and named) by reading the ids of the rows whose hashes collide."""
    h, kind, row, hashes = hashlib.sha256(), None, 0, []
    for ids, texts in batches():
        for i, t in zip(ids, texts):
            if t is None:
                raise ValueError(f"{where}: row {row} (id {i!r}) has no text; every row needs a string 'text'")
            if not isinstance(t, str):
                raise ValueError(  # noqa: TRY004 - a bad row of the source is a ValueError, like a missing text
                    f"{where}: row {row} (id {i!r}) has a {type(t).__name__} text ({t!r:.40}), not a string; "
                    "convert or drop it"
                )
            check_encodable(t, f"{where}: row {row}")
            if i is None:
                raise ValueError(f"{where}: row {row} has no id")
            if isinstance(i, bool) or not isinstance(i, (int, str)):
                raise ValueError(  # noqa: TRY004 - a bad row of the source is a ValueError, like a missing id
                    f"{where}: row {row} has a {type(i).__name__} id ({i!r}); ids must be ints or strings"
                )
            if isinstance(i, int) and not INT64[0] <= i <= INT64[1]:
                raise ValueError(
                    f"{where}: row {row} has the id {i}, outside the 64-bit range the Parquet shards "
                    f"store ({INT64[0]} to {INT64[1]}); use smaller ints or string ids"
                )
            if kind is None:
                kind = str if isinstance(i, str) else int
            elif not isinstance(i, kind):
                raise ValueError(
                    f"{where}: row {row} has a {type(i).__name__} id ({i!r}) but earlier ids are "
                    f"{kind.__name__}s; use one type for every id"
                )
            key = id_bytes(i)
            h.update(framed(key))
            h.update(framed(t.encode("utf-8")))
            hashes.append(hashlib.blake2b(key, digest_size=16).digest())
            row += 1
    _check_unique(hashes, batches, where)
    return row, h.hexdigest()


def _check_unique(hashes: list[bytes], batches, where: str) -> None:
    """``ValueError`` for the first row (in source order) whose id an earlier row has."""
    keys = np.frombuffer(b"".join(hashes), dtype=np.dtype([("a", "<u8"), ("b", "<u8")]))
    order = np.argsort(keys, order=("a", "b"), kind="stable")
    same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    if not len(same):
        return
    rows = {int(r) for j in same for r in (order[j], order[j + 1])}
    found, row = {}, 0
    for ids, _ in batches():
        for i in ids:
            if row in rows:
                found[row] = i
            row += 1
    first: dict = {}
    for r in sorted(found):
        i = found[r]
        if i in first:
            raise ValueError(
                f"{where}: id {i!r} appears twice (rows {first[i]} and {r}); ids must be unique, since "
                "each is written once"
            )
        first[i] = r


# -------------------------------------------------------------------------------------------------- the manifest
def result_knobs(knobs: dict) -> dict:
    """The knobs that change embeddings, checked and JSON-shaped (scheduling knobs such as ``max_batch_tokens``
    may change between a run and its resume)."""
    full = dict(Knobs().replace(**knobs))
    return json.loads(json.dumps({k: v for k, v in full.items() if k not in SCHEDULING_KNOBS}))


_FILE_DIGESTS: dict[tuple, str] = {}  # (resolved path, size, mtime_ns) -> SHA-256, for this process


def file_digest(path: Path) -> str:
    """SHA-256 of a file's content, remembered per (path, size, mtime) so a file is read once per process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        _FILE_DIGESTS[key] = h.hexdigest()
    return _FILE_DIGESTS[key]


def folder_files(folder: Path, subfolders: bool) -> list[tuple[str, Path]]:
    """``(name relative to folder, path)`` of the files of ``folder`` a loader may read: every file at its top (but
    docs and other frameworks' weights, ``NOT_READ``) and, with ``subfolders``, those of the sentence-transformers
    module folders its ``modules.json`` names (a Pooling or Dense config, ColBERT's projection)."""

    def keep(f: Path) -> bool:
        return f.is_file() and not f.name.startswith(".") and not f.name.lower().endswith(NOT_READ)

    files = {f.name: f for f in folder.iterdir() if keep(f)}
    modules = folder / "modules.json"
    if subfolders and modules.is_file():
        try:
            entries = json.loads(modules.read_text(encoding="utf-8"))
            names = {str(m.get("path") or "") for m in entries if isinstance(m, dict)}
        except (ValueError, AttributeError, TypeError):
            names = set()  # the loader names what is wrong with it; modules.json itself is hashed
        for name in names - {""}:
            norm = os.path.normpath(name)
            if os.path.isabs(name) or norm == ".." or norm.startswith(".." + os.sep):
                continue  # a path outside the folder: the loader refuses it
            sub = folder / norm
            if sub.is_dir():
                files |= {f.relative_to(folder).as_posix(): f for f in sub.rglob("*") if keep(f)}
    return sorted(files.items())


def model_digest(model_path, adapters=()) -> str:
    """SHA-256 over the content of what an Engine on ``model_path`` with these ``adapters`` computes with: the
    model folder's files (weights, config, tokenizer, sentence-transformers modules; a ``.gguf`` file itself) and
    each adapter folder's, in merge order (an adapter-only folder as the model: its base, then it); a model or an
    adapter named by hub id counts by its snapshot's files (``lab.models.hub.resolve``). File names
    count relative to their folder, so a copy of a folder elsewhere has the same digest."""
    from lab.adapt.adapters import split_adapter_model
    from lab.models.hub import resolve

    folders = tuple(str(resolve(a, what=f"adapter {k}").folder) for k, a in enumerate(adapters))  # ids: snapshots
    model, adapters = split_adapter_model(str(resolve(model_path).folder), folders)
    h = hashlib.sha256()
    for role, root in [("model", Path(model)), *((f"adapter {k}", Path(a)) for k, a in enumerate(adapters))]:
        root = root.expanduser()
        if not root.exists():
            raise FileNotFoundError(f"{role} {str(root)!r} does not exist")
        files = [(root.name, root)] if root.is_file() else folder_files(root, subfolders=role == "model")
        h.update(framed(role.encode()))
        for name, f in files:
            h.update(framed(name.encode("utf-8")) + framed(file_digest(f).encode()))
    return h.hexdigest()


def job_record(source: Source, *, shard_texts: int, model: str, digest: str, knobs: dict) -> dict:
    """What a resume must match: the rows (count and fingerprint), the shard size, the content of the model and
    adapter files (``digest``, from ``model_digest``) and the knobs that change results. ``model`` and the adapter
    paths are recorded too, for people to read (``INFO_KEYS``), and not compared."""
    knobs = result_knobs(knobs)
    adapters = knobs.pop("adapters", [])
    return {
        "rows": len(source),
        "shard_texts": shard_texts,
        "source": source.fingerprint(),
        "model_files": digest,
        "knobs": knobs,
        "model": model,
        "adapters": adapters,
    }


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.parquet"


def shard_count(job: dict) -> int:
    return -(-job["rows"] // job["shard_texts"])


def read_manifest(out_dir: Path) -> tuple[dict, dict[int, dict]]:
    """The manifest's job and shards, checked: this layout, every shard of the job (none beyond it), every file a
    plain name inside ``out_dir``. ``ValueError`` naming the manifest and what is wrong."""
    path = out_dir / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, not {FORMAT}")
        job, shards = data["job"], {int(k): dict(v) for k, v in data["shards"].items()}
        count = shard_count(job)
        for k, v in shards.items():
            for field_, kind in (("file", str), ("rows", int), ("ids", str), ("sha256", str)):
                if not isinstance(v.get(field_), kind):
                    raise ValueError(  # noqa: TRY004 - a bad manifest is a ValueError, as a bad job is
                        f"shard {k} has no {field_!r} {kind.__name__}"
                    )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a manifest this version reads ({e}); use a new out_dir") from None
    extra = sorted(k for k in shards if not 0 <= k < count)
    if extra:
        raise ValueError(
            f"{path} lists shard(s) {extra}, but its job has {count} shard(s) (0 to {count - 1}: "
            f"{job['rows']} rows, shard_texts={job['shard_texts']}); the manifest was edited or mixed "
            "with another's; use a new out_dir"
        )
    for k, v in shards.items():
        name = v["file"]
        if Path(name).name != name or name in ("", ".", "..") or "\\" in name:
            raise ValueError(
                f"{path}: shard {k}'s file {name!r} is not a file name inside {out_dir}; refusing to "
                "read or trust a path outside the output folder"
            )
    return job, shards


class Manifest:
    """``manifest.json`` of an output folder: the job and its finished shards, rewritten atomically after each."""

    def __init__(self, out_dir: Path, job: dict, shards: dict[int, dict]):
        self.out_dir, self.job, self.shards = out_dir, job, shards

    @classmethod
    def open(cls, out_dir, job: dict) -> Manifest:
        """The folder's manifest (created empty when absent). ``ValueError`` when it records another job, or is
        not one to trust (``read_manifest``); stale temporary files of an interrupted write are removed."""
        out_dir = Path(out_dir)
        for stale in [*out_dir.glob(".shard-*.tmp"), *out_dir.glob(f".{MANIFEST}.*.tmp")]:
            stale.unlink(missing_ok=True)  # an interrupted write's leftovers: never trusted, never read
        if not (out_dir / MANIFEST).exists():
            return cls(out_dir, job, {})
        old, shards = read_manifest(out_dir)
        diff = [k for k in sorted(set(job) | set(old)) if k not in INFO_KEYS and job.get(k) != old.get(k)]
        if diff:
            named = {
                "source": "the rows (ids / texts / their order) differ",
                "model_files": "the model's files differ (weights, tokenizer, configs or adapters: another "
                "model, or the folder changed since)",
            }
            details = "; ".join(
                [named[k] for k in named if k in diff]
                + [f"{k}: {old.get(k)!r} there, {job.get(k)!r} now" for k in diff if k not in named]
            )
            raise ValueError(
                f"{out_dir} holds another job ({details}); resume with the same source, shard_texts, "
                "model and knobs, or use a new out_dir"
            )
        return cls(out_dir, job, shards)

    def finished(self, shard: int, ids: list) -> bool:
        """Listed under its own file name, holding exactly ``ids`` (the shard's rows), its SHA-256 as recorded: a
        shard that fails any of these is computed again."""
        record = self.shards.get(shard)
        if (
            record is None
            or record["file"] != shard_name(shard)
            or record["rows"] != len(ids)
            or record["ids"] != ids_digest(ids)
        ):
            return False
        try:
            read_shard(self.out_dir, shard, record)
        except (OSError, ValueError):
            return False
        return True

    def record(self, shard: int, row: dict) -> None:
        """Add a finished shard (its file already in place; ``row`` with ``write_shard``'s fields) and rewrite the
        manifest."""
        self.shards[shard] = row
        self.save()

    def save(self) -> None:
        """Write the manifest atomically (the job is recorded before the first shard, so a folder is never
        mistaken for another job's)."""
        data = {"format": FORMAT, "job": self.job, "shards": {str(k): self.shards[k] for k in sorted(self.shards)}}
        atomic_write(self.out_dir / MANIFEST, json.dumps(data, indent=1).encode("utf-8"), JOB_FIX)

    def summary(self) -> pd.DataFrame:
        """One row per finished shard: shard, actor, pid, rows, tokens, seconds, node, file, finished (epoch s)."""
        cols = ["shard", "actor", "pid", "rows", "tokens", "seconds", "node", "file", "finished"]
        rows = [{"shard": k, **{c: v.get(c) for c in cols[1:]}} for k, v in sorted(self.shards.items())]
        return pd.DataFrame(rows, columns=cols)


def write_shard(out_dir: Path, shard: int, ids: list, embeddings: np.ndarray) -> dict:
    """Write one shard, ``id`` and ``embedding`` (a fixed-size list of float32), atomically. Returns what the
    manifest records of it: ``file`` (its name), ``rows``, ``ids`` (``ids_digest``) and ``sha256`` (the file's)."""
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
    data = sink.getvalue().to_pybytes()
    atomic_write(Path(out_dir) / name, data, JOB_FIX)
    return {"file": name, "rows": n, "ids": ids_digest(ids), "sha256": hashlib.sha256(data).hexdigest()}


def read_shard(out_dir: Path, shard: int, record: dict) -> tuple[list, np.ndarray]:
    """A shard's ``(ids, embeddings)``, checked against its manifest ``record``: its own file name, the file's
    SHA-256, its row count and ids digest. ``ValueError`` naming the file and what differs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = out_dir / record["file"]
    fix = f"run embed_dataset into {out_dir} again to recompute it"
    if record["file"] != shard_name(shard):
        raise ValueError(
            f"{out_dir / MANIFEST} lists {record['file']!r} as shard {shard}'s file, not "
            f"{shard_name(shard)!r}; the manifest was edited; {fix}"
        )
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise ValueError(
            f"{path} is not the file written as shard {shard} (its SHA-256 differs from the manifest's): "
            f"it was changed or replaced since; {fix}"
        )
    table = pq.read_table(pa.BufferReader(data))
    ids = table.column("id").to_pylist()
    if len(ids) != record["rows"] or ids_digest(ids) != record["ids"]:
        raise ValueError(
            f"{path} does not hold shard {shard}'s ids (the manifest's record and the file disagree); {fix}"
        )
    col = table.column("embedding").combine_chunks()
    return ids, col.flatten().to_numpy().reshape(len(col), -1)


def read_embeddings(out_dir) -> tuple[list, np.ndarray]:
    """``(ids, embeddings (n, dim) float32)`` of every shard the manifest lists as finished, in source order.

        >>> ids, E = read_embeddings("out/")     # the out_dir of embed_dataset

    Each shard is checked as ``read_shard`` says (its file's SHA-256 and ids as recorded), and the manifest as
    ``read_manifest`` says: a ``ValueError`` names the shard file or entry that does not match."""
    out_dir = Path(out_dir)
    _, shards = read_manifest(out_dir)
    ids, parts = [], []
    for k in sorted(shards):
        shard_ids, emb = read_shard(out_dir, k, shards[k])
        ids += shard_ids
        parts.append(emb)
    return ids, (np.concatenate(parts) if parts else np.zeros((0, 0), dtype=np.float32))
