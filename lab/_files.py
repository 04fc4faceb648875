"""Writing files whole, the one way every file the toolkit writes goes (shards, manifests, mteb results, benchmark
results): ``atomic_write`` (a temporary file beside the target, flushed, then renamed over it), ``make_folder`` (a
folder made before any work, a file in its place named) and ``write_failed`` (the error of a failed write, naming the
file, its folder, the bytes it needed and the fix). A write that fails -- a full disk, a file size limit, a folder
that cannot be written -- leaves the file that was there as it was.

    >>> atomic_write(Path("out/manifest.json"), data, fix="free space and run again")
    >>> make_folder(Path("out"), "embed_dataset's shards", "point out_dir at a folder that can be written")
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

NO_ROOM = "free space there (or lift the file size limit, `ulimit -f`)"  # the fix of a full disk or a size limit
WRITE_FIX = f"{NO_ROOM}, or write to another folder"


def atomic_write(path: Path, data: bytes, fix: str = WRITE_FIX) -> None:
    """Write ``data`` to a temporary file beside ``path``, flush it to disk, then rename it over ``path``; a write
    that fails (a full disk, a size limit, a folder that cannot be written) removes the temporary file, leaves
    ``path`` as it was and raises the ``OSError`` again (same errno) naming the folder, the bytes and ``fix``
    (``write_failed``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise write_failed(e, path, len(data), fix) from e
    finally:
        tmp.unlink(missing_ok=True)


def write_failed(e: Exception, path: Path, size: int | None, fix: str) -> OSError:
    """The error of a write of ``path`` that failed with ``e`` (an ``OSError``, or a writer's own error for one:
    ``is_write_error``): an ``OSError`` of the same errno (so the same subclass), naming the file, its folder, the
    bytes the write needed (``size``, when known) and ``fix``."""
    need = f" ({size:,} bytes)" if size is not None else ""
    errno = getattr(e, "errno", None)
    msg = (
        f"cannot write {path.name}{need} to the folder {path.parent}: {getattr(e, 'strerror', None) or e}; "
        f"{fix}. The files written there before are left whole"
    )
    return OSError(errno, msg) if errno is not None else OSError(msg)


def is_write_error(e: BaseException) -> bool:
    """Whether ``e`` is a failed write: an ``OSError``, or safetensors' ``SafetensorError`` (which its writer raises
    for an I/O error such as EFBIG or ENOSPC)."""
    return isinstance(e, OSError) or type(e).__name__ == "SafetensorError"


@contextlib.contextmanager
def staged(tmp: Path, failed: Callable[[BaseException], OSError]) -> Iterator[Path]:
    """A block that writes into the staging folder ``tmp`` (before moving it into place): on any error ``tmp`` is
    removed, and a failed write (``is_write_error``) is raised as ``failed(e)``, the caller's ``OSError`` naming
    the folder and the fix; other errors pass as they are."""
    try:
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_error(e):
            raise failed(e) from e
        raise


def make_folder(folder: Path, what: str, fix: str) -> Path:
    """``folder`` (and its parents) created where missing, before any work is done for ``what``; an ``OSError`` of
    the same errno naming the folder, the file that stands where a folder should (if that is why) and ``fix``."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker is not None else e.strerror or str(e)
        raise OSError(e.errno, f"cannot create the folder {folder} for {what} ({why}); {fix}") from e
    return folder
