"""Model names -> local folders: Hugging Face hub ids and revisions, resolved once, through huggingface_hub.

Wherever a model goes (``Engine(model)``, ``adapters=[...]``, an adapter's ``base_model_name_or_path``, the bases of
``lab.adapt``, ``RayEngine``, ``embed_dataset``, the scripts' ``--model``), a name is one of:

- an existing local path (a folder, a ``.gguf`` file): taken as it is; a local path always wins over a hub id of the
  same spelling. A snapshot folder of the hub cache (``.../models--org--name/snapshots/<commit>``) is recognised, so
  the engine still knows its id and commit;
- a hub id, ``org/name`` (or ``name``), with a revision: a branch, a tag or a commit, given as ``revision=`` or
  written ``org/name@rev`` (the one form for adapters, which have no ``revision=`` of their own).

A hub id goes through huggingface_hub, which brings what users of transformers and sentence-transformers expect: its
cache (``HF_HUB_CACHE``, ``HF_HOME``), ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, tokens for gated and private repositories
(``HF_TOKEN`` or ``hf auth login``) and download progress bars. Online, the repository's file list decides what to
fetch (``files_to_fetch``: configs, tokenizer, the one weight format the loader reads, sentence-transformers module
folders, llm2vec and adapter files, the model card; not every file of the repository) and ``snapshot_download``
fetches only those. Offline, or when the hub cannot be reached, the cached snapshot is used. Every failure is a clear
error naming the id, the revision and the fix; the cache is left as huggingface_hub leaves it (an interrupted
download resumes on the next run). Nothing below this module knows there was a hub: the loader gets a folder.

    >>> src = resolve("sentence-transformers/all-MiniLM-L6-v2", revision="main")
    >>> src.folder, src.name, src.revision      # snapshot folder, the id, the commit
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from lab._warn import warn

COMMIT = re.compile(r"[0-9a-f]{40}")
HUB_PAGE = "https://huggingface.co/"  # + a hub id: the model's page
# sentence-transformers keeps its modules in numbered folders (1_Pooling, 2_Dense, 2_Normalize, ...; modules.json)
_MODULE_FOLDER = re.compile(r"\d+_[^/]+")
# top-level files the loader, the tokenizer, sentence-transformers' and llm2vec's configs and the model card need
_SMALL_FILES = ("*.json", "*.txt", "*.model", "*.jinja", "README.md")
# bge-m3's heads beside the model's weights (lab.outputs)
_HEAD_FILES = ("sparse_linear.pt", "colbert_linear.pt")
# weight files of other frameworks or formats, never fetched from a module folder either
_FOREIGN = ("*.onnx", "*.onnx_data", "*.h5", "*.msgpack", "*.ot", "*.tflite", "*.pb", "*.mlmodel", "*.xml")


@dataclass(frozen=True)
class Source:
    """Where a model name resolved to.

    ``folder``: the local folder (or ``.gguf`` file) the loader reads; ``name``: the hub id, or ``local/<folder
    name>`` for a local path; ``revision``: the snapshot's commit for a hub id or a snapshot folder, ``None`` for any
    other local path (``content_revision`` gives one); ``repo_id``: the hub id when there is one."""

    folder: Path
    name: str
    revision: str | None = None
    repo_id: str | None = None

    @property
    def reference(self) -> str | None:
        """The model's hub page, ``None`` for a local folder."""
        return HUB_PAGE + self.repo_id if self.repo_id else None


def split_revision(name: str, revision: str | None = None) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; ``revision`` given as well must agree. A name without ``@``
    keeps ``revision``."""
    repo, at, rev = name.partition("@")
    if not at:
        return name, revision
    if not repo or not rev:
        raise ValueError(
            f"{name!r}: a model name with a revision is written 'org/name@revision' (a branch, a tag or "
            "a commit), both parts non-empty"
        )
    if revision is not None and revision != rev:
        raise ValueError(
            f"{name!r} names revision {rev!r} but revision={revision!r} was passed too; give the revision once"
        )
    return repo, rev


def snapshot_of(path: str | os.PathLike) -> tuple[str, str] | None:
    """``(repo id, commit)`` when ``path`` is (or lies in) a snapshot folder of a Hugging Face hub cache:
    ``.../models--org--name/snapshots/<40 hex>[/...]``; else ``None``."""
    parts = Path(os.path.abspath(os.fspath(path))).parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and COMMIT.fullmatch(parts[i + 1]) and parts[i - 1].startswith("models--"):
            return parts[i - 1].removeprefix("models--").replace("--", "/"), parts[i + 1]
    return None


def looks_like_hub_id(name: str) -> bool:
    """``name`` or ``org/name`` (an optional ``@revision``): no leading ``/`` ``.`` ``~``, at most one slash, no
    backslash. Whether the hub accepts it is huggingface_hub's ``validate_repo_id``'s to say."""
    repo = name.partition("@")[0]
    return bool(repo) and not repo.startswith(("/", ".", "~")) and repo.count("/") <= 1 and "\\" not in repo


def resolve(name: str | os.PathLike, revision: str | None = None, *, what: str = "model") -> Source:
    """The local folder for ``name`` (module docstring): an existing local path as it is, a hub id through
    huggingface_hub's cache (downloading what the Engine reads when online). ``what`` names the role in errors
    (``"model"``, ``"adapter"``, ``"base model"``).

    Raises ``FileNotFoundError`` for a path or an id that cannot be had (offline and not cached: the message names
    the id, the revision, the cache folder and the ``hf download`` command), ``ValueError`` for a malformed id, an
    unknown revision or a repository without a model, ``PermissionError`` for a gated or private repository without
    access, ``ConnectionError`` for a download that broke off."""
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"{what} must be a local path or a hub id ('org/name'), got {type(name).__name__}")
    text = os.fspath(name)
    local = Path(text).expanduser()
    if local.exists():
        if revision is not None:
            raise ValueError(
                f"revision={revision!r} applies to hub ids; {text!r} is a local path, which has no "
                "revisions (pass the hub id instead, or leave revision unset)"
            )
        snap = snapshot_of(local)
        if snap is not None:
            return Source(local, snap[0], snap[1], snap[0])
        return Source(local, f"local/{local_name(local.resolve())}")
    repo_id, rev = _hub_name(text, revision, what)
    folder = _snapshot(repo_id, rev, what)
    return Source(folder, repo_id, folder.name, repo_id)


def _hub_name(text: str, revision: str | None, what: str) -> tuple[str, str | None]:
    """``(repo id, revision)`` of a name that is no local path, checked: not shaped like a hub id is a missing
    path (``FileNotFoundError``), a malformed id a ``ValueError``."""
    if not looks_like_hub_id(text):
        raise FileNotFoundError(
            f"{what} path {text!r} does not exist (and it is not a hub id such as 'org/name'); "
            "pass an existing local folder or a Hugging Face hub id"
        )
    repo_id, rev = split_revision(text, revision)
    _check_id(repo_id, text, what)
    return repo_id, rev


GENERIC_NAMES = frozenset({"model", "models", "snapshot", "weights", "checkpoint", "main"})


def local_name(path: str | os.PathLike) -> str:
    """A local folder's name, as in ``local/<name>``: its parent's name when the folder has a generic name such as
    ``model``."""
    path = Path(path)
    return path.parent.name if path.name.lower() in GENERIC_NAMES and path.parent.name else path.name


def _check_id(repo_id: str, given: str, what: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(
            f"{what} {given!r} is neither an existing local path nor a valid hub id: {e} Hub ids are "
            "'org/name' (letters, digits, '-', '_', '.'), optionally '@revision'"
        ) from None


def _describe(repo_id: str, rev: str | None) -> str:
    return f"{repo_id!r} at revision {rev or 'main'!r}"


def _fetch_command(repo_id: str, rev: str | None) -> str:
    return f"hf download {repo_id}" + (f" --revision {rev}" if rev else "")


def _snapshot(repo_id: str, rev: str | None, what: str) -> Path:
    """The snapshot folder of ``repo_id`` at ``rev``: fetched (only what ``files_to_fetch`` picks) when the hub
    can be reached, else the cached one."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return _cached(repo_id, rev, what, why="HF_HUB_OFFLINE is set")
    return _asking_hub(repo_id, rev, what, lambda: _download(repo_id, rev, what))


def pin(name: str | os.PathLike, revision: str | None = None, *, what: str = "model") -> tuple[str, str] | None:
    """``(repo id, commit)`` that ``name`` at ``revision`` means now, without fetching any weights (the hub's
    answer online, the cached snapshot's offline); ``None`` for a local path. ``RayEngine`` and ``embed_dataset``
    hand the commit to every actor, so all of them load the same snapshot even if the branch moves meanwhile."""
    text = os.fspath(name)
    if Path(text).expanduser().exists():
        return None
    repo_id, rev = _hub_name(text, revision, what)
    if rev is not None and COMMIT.fullmatch(rev):
        return repo_id, rev
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return repo_id, _cached(repo_id, rev, what, why="HF_HUB_OFFLINE is set").name
    info = _asking_hub(repo_id, rev, what, lambda: _model_info(repo_id, rev, what))
    return repo_id, info.sha if not isinstance(info, Path) else info.name


def _network_errors(*, any_transport: bool = False) -> tuple[type[BaseException], ...]:
    """What the HTTP client under huggingface_hub (httpx2, httpx or requests, by its version) raises when the hub
    cannot be reached, with the builtin connection and timeout errors; ``any_transport``: any failure of a
    transfer too (a connection closed in the middle of a file)."""
    import importlib

    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    clients = (
        ("httpx2", ("ConnectError", "TimeoutException")),
        ("httpx", ("ConnectError", "TimeoutException")),
        ("requests", ("ConnectionError", "Timeout")),
    )
    if any_transport:
        clients = (("httpx2", ("HTTPError",)), ("httpx", ("HTTPError",)), ("requests", ("RequestException",)))
    for module, names in clients:
        try:
            m = importlib.import_module(module)
        except ImportError:
            continue
        found += [getattr(m, n) for n in names if isinstance(getattr(m, n, None), type)]
    return tuple(found)


def _asking_hub(repo_id: str, rev: str | None, what: str, ask):
    """``ask()`` (a call to the hub), its failures turned into errors that name the id, the revision and the fix."""
    import huggingface_hub.errors as hf_errors

    try:
        return ask()
    except hf_errors.GatedRepoError as e:
        raise PermissionError(
            f"{what} {_describe(repo_id, rev)} is gated: accept its conditions on "
            f"https://huggingface.co/{repo_id} and log in (hf auth login, or set HF_TOKEN) "
            f"({_first_line(e)})"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise ValueError(
            f"{what} {repo_id!r} has no revision {rev!r} (a branch, a tag or a commit of the "
            f"repository); see https://huggingface.co/{repo_id}/tree/main for its branches"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{what} {repo_id!r} is not a repository on the hub, or it is private and no token "
            "with access was given (hf auth login, or set HF_TOKEN); a local folder of that "
            "name does not exist either"
        ) from None
    except _incomplete(hf_errors) as e:  # not reachable, and the cached snapshot lacks files
        raise _incomplete_error(repo_id, rev, what, e) from None
    except hf_errors.LocalEntryNotFoundError as e:  # not reachable and not cached
        raise FileNotFoundError(
            _not_cached(repo_id, rev, what, f"the hub could not be reached ({_first_line(e)})")
        ) from None
    except (FileNotFoundError, PermissionError, ConnectionError):  # already ours (the cached snapshot's errors)
        raise
    except (hf_errors.HfHubHTTPError, OSError, *_network_errors(any_transport=True)) as e:
        raise ConnectionError(
            f"downloading {what} {_describe(repo_id, rev)} failed: {type(e).__name__}: "
            f"{_first_line(e)}. What was fetched stays in the cache ({_cache_dir()}); run the same "
            "call again to resume"
        ) from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _download(repo_id: str, rev: str | None, what: str) -> Path:
    """Online: the file list of ``repo_id`` at ``rev``, then ``snapshot_download`` of the files the Engine reads.
    When the hub cannot be reached (a connection error), the cached snapshot, with a warning."""
    from huggingface_hub import snapshot_download

    info = _model_info(repo_id, rev, what)
    if isinstance(info, Path):
        return info
    files = [s.rfilename for s in (info.siblings or [])]
    wanted = files_to_fetch(files, name=_describe(repo_id, rev))
    return Path(snapshot_download(repo_id, revision=rev, allow_patterns=wanted))


def _model_info(repo_id: str, rev: str | None, what: str):
    """The hub's ``model_info`` of ``repo_id`` at ``rev`` (its commit and file list); when the hub cannot be
    reached, the cached snapshot's folder instead, with a warning."""
    from huggingface_hub import HfApi

    try:
        return HfApi().model_info(repo_id, revision=rev)
    except _network_errors() as e:
        folder = _cached(repo_id, rev, what, why=f"the hub could not be reached ({_first_line(e)})")
        warn(f"the hub could not be reached; {what} {repo_id!r} is the cached snapshot {folder.name}")
        return folder


def _cached(repo_id: str, rev: str | None, what: str, *, why: str) -> Path:
    """The cached snapshot of ``repo_id`` at ``rev``, found through huggingface_hub's cache (``refs/`` for a
    branch or tag), with nothing downloaded."""
    import huggingface_hub.errors as hf_errors
    from huggingface_hub import snapshot_download

    try:
        listing = _cached_listing(repo_id, rev)
        wanted = files_to_fetch(listing, name=_describe(repo_id, rev)) if listing else None
        return Path(snapshot_download(repo_id, revision=rev, local_files_only=True, allow_patterns=wanted))
    except _incomplete(hf_errors) as e:
        raise _incomplete_error(repo_id, rev, what, e) from None
    except hf_errors.LocalEntryNotFoundError:
        raise FileNotFoundError(_not_cached(repo_id, rev, what, why)) from None


def _cached_listing(repo_id: str, rev: str | None) -> list[str] | None:
    """The repository's file list as huggingface_hub cached it with the snapshot (``trees/``), when its version
    keeps one; ``None`` otherwise (then the cached folder is taken as it is)."""
    try:
        from huggingface_hub import get_cached_repo_tree
    except ImportError:
        return None
    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=rev)]
    except Exception:  # noqa: BLE001 (no listing cached for this snapshot: nothing to compare against)
        return None


def _incomplete(hf_errors) -> tuple:
    """huggingface_hub's error for a cached snapshot that lacks files (2.x), none before it."""
    found = getattr(hf_errors, "IncompleteSnapshotError", None)
    return (found,) if found else ()


def _incomplete_error(repo_id: str, rev: str | None, what: str, e: BaseException) -> FileNotFoundError:
    return FileNotFoundError(
        f"{what} {_describe(repo_id, rev)}: {_first_line(e)} Fetch it with: {_fetch_command(repo_id, rev)}"
    )


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _not_cached(repo_id: str, rev: str | None, what: str, why: str) -> str:
    folder = Path(_cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    return (
        f"{what} {_describe(repo_id, rev)} is not in the Hugging Face cache and cannot be downloaded: {why}. "
        f"Looked in {folder} (the cache: HF_HUB_CACHE, or HF_HOME/hub). Fetch it where the hub can be reached "
        f"with: {_fetch_command(repo_id, rev)} (then copy the cache here), or pass a local folder"
    )


def files_to_fetch(files: list[str], *, name: str = "the repository") -> list[str]:
    """The files of a repository the Engine reads, from its file list: the top-level configs, tokenizer files and
    model card (``*.json``, ``*.txt``, ``*.model``, ``*.jinja``, ``README.md``), the weights in the one format the
    loader would read (``lab.models.folder``: ``model.safetensors`` or its shards, else ``pytorch_model.bin`` or
    its shards, else the first ``.gguf``), an adapter's weights, bge-m3's heads, and the files of
    sentence-transformers' numbered module folders (``1_Pooling``, ``2_Dense``, ...). Raises ``ValueError`` for a
    repository with neither ``config.json``, ``adapter_config.json`` nor a ``.gguf`` file, or a ``config.json``
    without weights it can read."""
    top = [f for f in files if "/" not in f]
    wanted = {f for f in top if any(fnmatch.fnmatch(f, p) for p in _SMALL_FILES) or f in _HEAD_FILES}
    wanted |= {
        f
        for f in files
        if "/" in f
        and _MODULE_FOLDER.fullmatch(PurePosixPath(f).parts[0])
        and not any(fnmatch.fnmatch(f, p) for p in _FOREIGN)
    }
    weights = _weights(top)
    wanted -= {"model.safetensors.index.json", "pytorch_model.bin.index.json"} - set(weights)  # another format's
    adapter = [f for f in ("adapter_model.safetensors", "adapter_model.bin") if f in top][:1]
    ggufs = sorted(f for f in top if f.endswith(".gguf"))
    if "config.json" not in top and "adapter_config.json" not in top:
        if ggufs:
            return sorted(wanted | {ggufs[0]})
        listed = ", ".join(sorted(files)[:12]) or "none"
        raise ValueError(
            f"{name} holds no model: no config.json (a transformers model folder needs one), no "
            f"adapter_config.json and no .gguf file; its files: {listed}"
        )
    if "config.json" in top and not weights and not adapter and not ggufs:
        raise ValueError(
            f"{name} has a config.json but no weights the engine reads (model.safetensors or its "
            "shards, pytorch_model.bin, a .gguf file) and no adapter; its files: "
            f"{', '.join(sorted(files)[:12])}"
        )
    return sorted(wanted | set(weights) | set(adapter) | ({ggufs[0]} if ggufs and not weights else set()))


def _weights(top: list[str]) -> list[str]:
    """The model weight files the loader reads, by name (``lab.models.folder``'s order)."""
    if "model.safetensors.index.json" in top:
        return [
            "model.safetensors.index.json",
            *(f for f in top if f.endswith(".safetensors") and not f.startswith("adapter_model")),
        ]
    if "model.safetensors" in top:
        return ["model.safetensors"]
    if "pytorch_model.bin.index.json" in top:
        return ["pytorch_model.bin.index.json", *(f for f in top if re.fullmatch(r"pytorch_model.*\.bin", f))]
    return ["pytorch_model.bin"] if "pytorch_model.bin" in top else []


def content_revision(path: str | os.PathLike) -> str:
    """A local folder's revision: ``local-`` + 12 hex digits of a hash over ``config.json`` and samples of the
    weight files (start, middle, end; fine-tunes of one base share name, config and sizes, not weights)."""
    path = Path(path)
    h = hashlib.sha256()
    for f in sorted(path.iterdir()) if path.is_dir() else [path]:
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.is_file() and f.suffix in {".safetensors", ".bin", ".gguf", ".pt"}:
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with f.open("rb") as fh:
                for offset in (0, size // 2, max(size - 65536, 0)):
                    fh.seek(offset)
                    h.update(fh.read(65536))
    return "local-" + h.hexdigest()[:12]


def local_folder(name: str | os.PathLike, revision: str | None = None) -> str:
    """The folder ``name`` resolves to (``resolve``), as a string: what the scripts' ``--model`` hands to loaders
    that take folders (sentence-transformers, ONNX Runtime, OpenVINO). An Engine given a snapshot folder still
    knows the hub id and the commit (``snapshot_of``)."""
    return str(resolve(name, revision).folder)
