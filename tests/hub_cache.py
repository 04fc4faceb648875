"""A Hugging Face hub cache written by hand, laid out exactly as huggingface_hub writes it, without importing it.

``write_hub_cache`` builds ``<cache_dir>/models--org--name/`` with

* ``blobs/<etag>``: one file per distinct content; the etag is the hub's (see ``etag``),
* ``snapshots/<commit>/<path>``: a RELATIVE symlink per file to ``../../blobs/<etag>`` (one more ``../`` per
  subfolder of ``path``),
* ``refs/<branch or tag>``: the 40-hex commit sha, with no trailing newline.

It leaves out huggingface_hub's bookkeeping, which a reader of the cache does not need: ``trees/<commit>.json`` (the
tree listing snapshot_download caches), ``.no_exist/`` (files known to be missing), ``<cache_dir>/.locks/`` and
``<cache_dir>/CACHEDIR.TAG``.

``etag`` (and the LFS rule behind it) is shared with ``tests/hub_server.py``, so the server and a hand-written cache
name blobs the same way, as the hub does: the sha256 of the content for LFS files, the git blob sha1 otherwise.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

# Which files the emulated hub stores in LFS. The real hub decides by the repo's .gitattributes (weights suffixes)
# and by size (files over 10 MB are refused outside LFS); a fixed rule is enough for tests.
LFS_THRESHOLD = 1024 * 1024
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def is_lfs(path: str, data: bytes) -> bool:
    """Whether the emulated hub keeps ``path`` (with content ``data``) in LFS."""
    return len(data) >= LFS_THRESHOLD or path.endswith(LFS_SUFFIXES)


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob holding ``data`` (what ``git hash-object`` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The git-lfs pointer file git stores in place of an LFS file's content."""
    return b"version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n" % (
        hashlib.sha256(data).hexdigest().encode(),
        len(data),
    )


def etag(data: bytes, path: str) -> str:
    """The hub's ETag for a file (unquoted), which huggingface_hub uses as the blob's file name in the cache:
    the sha256 of the content for LFS files, the git blob sha1 of the content for regular ones."""
    return hashlib.sha256(data).hexdigest() if is_lfs(path, data) else git_blob_sha1(data)


def read_folder(folder: Path) -> dict[str, bytes]:
    """Every regular file under ``folder`` (recursively, symlinks followed) keyed by its POSIX path relative to it."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def repo_folder_name(repo_id: str) -> str:
    """The cache folder of a model repo: ``org/name`` -> ``models--org--name``."""
    return "--".join(["models", *repo_id.split("/")])


def write_hub_cache(
    cache_dir: Path,
    repo_id: str,
    files: Mapping[str, bytes] | Path,
    *,
    commit: str,
    refs: Mapping[str, str] | None = None,
) -> Path:
    """Write ``files`` (path in repo -> bytes, or a local folder read recursively) as commit ``commit`` of model
    repo ``repo_id`` into the hub cache ``cache_dir``, and return the snapshot folder.

    ``refs`` maps branch or tag names to commit shas; ``None`` (the default) means ``{"main": commit}``, ``{}`` writes
    no ref (a cache reachable by commit sha only). Calls for other commits of the same repo share its blobs.
    """
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise ValueError(f"commit must be a 40-hex sha, got {commit!r}")
    if isinstance(files, (str, os.PathLike)):
        files = read_folder(Path(files))
    refs = {"main": commit} if refs is None else refs

    repo = Path(cache_dir) / repo_folder_name(repo_id)
    blobs = repo / "blobs"
    snapshot = repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)

    for path, data in files.items():
        parts = path.split("/")
        if not path or path.startswith("/") or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"not a relative repo path: {path!r}")
        blob = blobs / etag(data, path)
        if not blob.exists():  # content-addressed: another commit (or file) may have written it already
            tmp = blob.with_name(blob.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(blob)
        link = snapshot.joinpath(*parts)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        # relative, like huggingface_hub, so the cache survives being moved: ../../blobs/<etag>, one more ../ per
        # subfolder of the file
        link.symlink_to(os.path.relpath(blob, link.parent))

    for name, sha in refs.items():
        ref = repo / "refs" / name
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(sha)  # no trailing newline: huggingface_hub compares and reads the file verbatim
    return snapshot
