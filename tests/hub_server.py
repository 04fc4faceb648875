"""A small Hugging Face hub on 127.0.0.1, for testing "models by hub id" against the real huggingface_hub client.

``HubServer`` serves model repos (branches, tags, commits; public, private or gated) over real sockets through the
endpoints huggingface_hub 2.4.0 calls:

* ``GET /api/models/{repo}`` and ``GET /api/models/{repo}/revision/{rev}``: ``HfApi.model_info`` / ``repo_info`` (the
  first thing ``snapshot_download`` asks for a branch or tag, to learn the commit sha; skipped for a 40-hex sha),
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=...``: ``list_repo_tree`` / ``list_repo_files`` (asked by
  ``snapshot_download`` with the commit sha, and cached by it in ``models--org--name/trees/<commit>.json``),
* ``GET /api/models/{repo}/refs``: ``list_repo_refs``,
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: ``hf_hub_download`` (a HEAD for the metadata, then a GET). A regular
  file answers 200 with ``ETag`` (its git blob sha1), ``Content-Length`` and ``X-Repo-Commit``; an LFS file answers
  302 with ``Location`` on a second origin (the "CDN", ``server.cdn_url``), ``X-Linked-Etag`` (its sha256),
  ``X-Linked-Size`` and ``X-Repo-Commit``, as the hub does for LFS files outside Xet. huggingface_hub stops at a
  redirect to another origin and reads the metadata off the 302, then GETs the CDN url without the token. No
  ``X-Xet-*`` header or ``xetHash`` is ever sent, so hf_xet stays out of the way and files come over plain HTTP.

Errors carry the hub's ``X-Error-Code`` so that ``hf_raise_for_status`` picks the same classes as against the hub:
unknown repo 404 ``RepoNotFound`` -> ``RepositoryNotFoundError``; private repo without the token 401 ``RepoNotFound``
-> ``RepositoryNotFoundError``; unknown revision 404 ``RevisionNotFound`` -> ``RevisionNotFoundError``; missing file
404 ``EntryNotFound`` (with ``X-Repo-Commit``, which makes huggingface_hub write ``.no_exist/<commit>/<path>``) ->
``RemoteEntryNotFoundError`` (an ``EntryNotFoundError``); a gated repo's files without the token 401 ``GatedRepo``
(403 with a wrong token) -> ``GatedRepoError``. As on the hub, a gated repo's metadata (model_info, tree) is public;
only its files are gated.

Usage::

    server = HubServer()
    sha = server.add_repo("org/name", files={"config.json": b"{}"}, tags=("v1",))
    with server:                                  # 127.0.0.1:<free port>; stopped and joined on exit
        snapshot_download("org/name", endpoint=server.url, cache_dir=tmp_path, token=False)
        server.requests                           # [(method, path), ...] in the order served, both origins
        server.downloaded                         # ["org/name/config.json", ...]: files whose bytes went out

Offline mode. huggingface_hub 2.4.0 reads ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) from the environment ONCE,
at import, into ``huggingface_hub.constants.HF_HUB_OFFLINE``; ``constants.is_offline_mode()`` returns that attribute
at call time, and the request hook of its shared httpx client raises ``OfflineModeIsEnabled`` on every request while
it is true. tests/conftest.py sets ``HF_HUB_OFFLINE=1`` before anything imports huggingface_hub, so changing the
environment variable in a test does nothing: a test that talks to this server must flip the attribute, with pytest's
monkeypatch so it is restored afterwards (``go_online(monkeypatch)`` below does exactly that). While offline,
``snapshot_download`` / ``hf_hub_download`` serve from the cache only, as with ``local_files_only=True``.

Pass ``endpoint=server.url``, ``cache_dir=`` and ``token=`` (``False`` for "no token": ``None`` would send a token
found in ``HF_TOKEN`` or ``~/.cache/huggingface/token``) explicitly rather than patching ``constants.ENDPOINT``, which
is also read at import.

Downloads of a file named in ``server.interrupt`` never get past the middle of the file: a GET sends its headers
(the full ``Content-Length``) and the bytes before the middle, then closes the connection; a ranged GET (a resume)
gets the bytes of its range that lie before the middle. huggingface_hub 2.4.0 retries 5 times, sleeping 1 s before
each (``file_download.time.sleep``), then re-raises ``httpx2.RemoteProtocolError``. Below its 10 MB read chunk the
bytes received before the cut never reach it (httpx2's ``iter_bytes`` raises before handing over a partial chunk), so
each retry is a full GET again, without ``Range``: 6 GETs in all. Its temporary ``blobs/<etag>.<id>.incomplete`` is
deleted, and no blob or snapshot symlink is written for the file.

The server answers with HTTP/1.0 (one request per connection), so no idle keep-alive connection outlives a request
and stopping joins every handler thread; each connection has a 10 s socket timeout. It never logs to stderr: handler
exceptions are kept in ``server.errors``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from hub_cache import etag, git_blob_sha1, is_lfs, lfs_pointer, read_folder

if TYPE_CHECKING:
    import pytest
    from typing_extensions import Self

__all__ = ["HubServer", "go_online"]


def go_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let huggingface_hub make HTTP requests for the rest of this test, whatever HF_HUB_OFFLINE said at import."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@dataclass(frozen=True)
class _File:
    path: str
    data: bytes
    lfs: bool
    etag: str  # the blob's name in the cache
    oid: str  # the git blob id in the tree: of the content, or of the LFS pointer
    sha256: str
    pointer_size: int | None


def _make_file(path: str, data: bytes) -> _File:
    lfs = is_lfs(path, data)
    pointer = lfs_pointer(data) if lfs else None
    return _File(
        path=path,
        data=data,
        lfs=lfs,
        etag=etag(data, path),
        oid=git_blob_sha1(pointer if pointer is not None else data),
        sha256=hashlib.sha256(data).hexdigest(),
        pointer_size=len(pointer) if pointer is not None else None,
    )


@dataclass
class _Commit:
    sha: str
    files: dict[str, _File]
    date: str


@dataclass
class _Repo:
    repo_id: str
    private: bool
    gated: bool | str
    created: str
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)

    def resolve(self, revision: str) -> _Commit | None:
        """A branch, a tag or a full commit sha, as the hub accepts them (branches win over tags of the same name)."""
        sha = self.branches.get(revision) or self.tags.get(revision) or revision
        return self.commits.get(sha)


class _HttpError(Exception):
    def __init__(self, status: int, code: str | None, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, dict(headers or {})


class _Server(ThreadingHTTPServer):
    # handler threads are joined by server_close(), so a test never leaves one running
    daemon_threads = False
    block_on_close = True

    def __init__(self, hub: HubServer, role: str):
        self.hub = hub
        self.role = role  # "hub" or "cdn"
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.hub.errors.append(sys.exc_info()[1])  # keep it for tests instead of printing a traceback


class HubServer:
    """A model hub on 127.0.0.1 (see the module docstring). Build repos before or while it runs."""

    def __init__(self) -> None:
        self.token: str | None = None
        self.interrupt: set[str] = set()
        self.requests: list[tuple[str, str]] = []
        self.downloaded: list[str] = []
        self.errors: list[BaseException] = []
        self._repos: dict[str, _Repo] = {}
        self._lfs: dict[str, bytes] = {}  # the CDN's content-addressed store: sha256 -> bytes
        self._lock = threading.Lock()
        self._servers: list[_Server] = []
        self._threads: list[threading.Thread] = []
        self._ncommits = 0

    # -- repos --------------------------------------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: Mapping[str, bytes] | Path,
        *,
        branch: str = "main",
        tags: Iterable[str] = (),
        private: bool = False,
        gated: bool | str = False,
    ) -> str:
        """Create model repo ``repo_id`` with one commit of ``files`` (path -> bytes, or a local folder) on ``branch``,
        tagged ``tags``; return the commit sha. ``gated`` is ``False``, ``True`` (shown as ``"manual"``), ``"auto"``
        or ``"manual"``; gated and private repos need ``Authorization: Bearer <server.token>``."""
        with self._lock:
            if repo_id in self._repos:
                raise ValueError(f"repo {repo_id} exists; use add_commit")
            self._repos[repo_id] = _Repo(
                repo_id=repo_id,
                private=private,
                gated="manual" if gated is True else gated,
                created=self._date(self._ncommits),
            )
        return self.add_commit(repo_id, files, branch=branch, tags=tags)

    def add_folder(self, repo_id: str, folder: Path, **kwargs: Any) -> str:
        """``add_repo`` with every file under ``folder``, recursively."""
        return self.add_repo(repo_id, read_folder(Path(folder)), **kwargs)

    def add_commit(
        self, repo_id: str, files: Mapping[str, bytes] | Path, *, branch: str = "main", tags: Iterable[str] = ()
    ) -> str:
        """A new commit holding exactly ``files`` on ``branch`` (created if new; the branch moves to it), tagged
        ``tags`` (a tag already there moves too); return its sha."""
        if isinstance(files, Path):
            files = read_folder(files)
        entries = {path: _make_file(path, bytes(data)) for path, data in files.items()}
        with self._lock:
            repo = self._repos[repo_id]
            self._ncommits += 1
            # deterministic: the same repos built in the same order give the same shas in every run
            digest = hashlib.sha1(f"{repo_id}\0{self._ncommits}\0".encode())
            for path in sorted(entries):
                digest.update(f"{path}\0{entries[path].etag}\n".encode())
            sha = digest.hexdigest()
            repo.commits[sha] = _Commit(sha=sha, files=entries, date=self._date(self._ncommits))
            repo.branches[branch] = sha
            for tag in tags:
                repo.tags[tag] = sha
            for f in entries.values():
                if f.lfs:
                    self._lfs[f.sha256] = f.data
        return sha

    def add_tag(self, repo_id: str, tag: str, revision: str) -> str:
        """Point ``tag`` at ``revision`` (a branch, tag or commit sha); return the commit sha."""
        with self._lock:
            repo = self._repos[repo_id]
            commit = repo.resolve(revision)
            if commit is None:
                raise KeyError(revision)
            repo.tags[tag] = commit.sha
            return commit.sha

    @staticmethod
    def _date(n: int) -> str:
        return f"2024-01-01T00:{n // 60 % 60:02d}:{n % 60:02d}.000Z"

    # -- lifecycle ----------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The hub endpoint, ``http://127.0.0.1:PORT`` (for ``endpoint=`` / ``HF_ENDPOINT``)."""
        return self._origin(0)

    @property
    def cdn_url(self) -> str:
        """The origin LFS files are redirected to (another port, so another origin, like the hub's CDN)."""
        return self._origin(1)

    def _origin(self, i: int) -> str:
        if not self._servers:
            raise RuntimeError("HubServer is not running")
        host, port = self._servers[i].server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Self:
        if self._servers:
            raise RuntimeError("HubServer is already running")
        self._servers = [_Server(self, "hub"), _Server(self, "cdn")]
        for s in self._servers:
            # a short poll so stop() returns quickly
            t = threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, name=f"hub-{s.role}")
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        for s in self._servers:
            s.shutdown()
        for t in self._threads:
            t.join()
        for s in self._servers:
            s.server_close()  # joins the handler threads (block_on_close)
        self._servers, self._threads = [], []

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- request handling (called from handler threads) ---------------------------------------------------------------

    def _log(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def _access(self, repo: _Repo, authorization: str | None, files: bool) -> None:
        """Raise the hub's answer when the caller may not see ``repo`` (or, with ``files``, download from it)."""
        sent = authorization[len("Bearer ") :] if authorization and authorization.startswith("Bearer ") else None
        ok = self.token is not None and sent == self.token
        if repo.private and not ok:
            # the hub does not tell a private repo from a missing one: 401 + RepoNotFound
            raise _HttpError(401, "RepoNotFound", "Invalid username or password.")
        if repo.gated and files and not ok:
            if sent is None:
                raise _HttpError(
                    401,
                    "GatedRepo",
                    f"Access to model {repo.repo_id} is restricted. You must have access to it "
                    "and be authenticated to access it. Please log in.",
                )
            raise _HttpError(
                403,
                "GatedRepo",
                f"Access to model {repo.repo_id} is restricted and you are not in the authorized list.",
            )

    def _repo(self, repo_id: str) -> _Repo:
        repo = self._repos.get(repo_id)
        if repo is None:
            raise _HttpError(404, "RepoNotFound", "Repository not found")
        return repo

    def _commit(self, repo: _Repo, revision: str) -> _Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise _HttpError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def _split_repo(self, segments: list[str]) -> tuple[str, list[str]]:
        """``org/name/rest...`` -> (repo id, rest): two segments unless a one-segment repo (``gpt2``) is known."""
        if len(segments) >= 2 and f"{segments[0]}/{segments[1]}" in self._repos:
            return f"{segments[0]}/{segments[1]}", segments[2:]
        if segments and segments[0] in self._repos:
            return segments[0], segments[1:]
        return "/".join(segments[:2]), segments[2:]


def _tree_entry(f: _File) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "file", "oid": f.oid, "size": len(f.data), "path": f.path}
    if f.lfs:
        entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": f.pointer_size}
    return entry


def _folder_entry(path: str, commit: _Commit) -> dict[str, Any]:
    # a stand-in for git's tree id: stable per folder content
    oid = hashlib.sha1(
        "\n".join(f"{p}\0{f.oid}" for p, f in sorted(commit.files.items()) if p.startswith(path + "/")).encode()
    ).hexdigest()
    return {"type": "directory", "oid": oid, "size": 0, "path": path}


def _model_info(repo: _Repo, commit: _Commit, query: dict[str, list[str]]) -> dict[str, Any]:
    blobs = query.get("blobs", ["false"])[-1].lower() == "true"
    siblings = []
    for f in sorted(commit.files.values(), key=lambda f: f.path):
        sibling: dict[str, Any] = {"rfilename": f.path}
        if blobs:
            sibling.update(size=len(f.data), blobId=f.oid)
            if f.lfs:
                sibling["lfs"] = {"sha256": f.sha256, "size": len(f.data), "pointerSize": f.pointer_size}
        siblings.append(sibling)
    author = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
    info: dict[str, Any] = {
        "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
        "id": repo.repo_id,
        "modelId": repo.repo_id,
        "author": author,
        "sha": commit.sha,
        "lastModified": commit.date,
        "createdAt": repo.created,
        "private": repo.private,
        "gated": repo.gated,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "siblings": siblings,
        "spaces": [],
        "usedStorage": sum(len(f.data) for c in repo.commits.values() for f in c.files.values()),
    }
    expand = query.get("expand")
    if expand:  # the hub returns only the properties asked for (plus the ids)
        info = {k: v for k, v in info.items() if k in ("_id", "id") or k in expand}
    return info


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``Range: bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` -> [start, end); None when absent or malformed."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, _, last = header[len("bytes=") :].strip().partition("-")
    try:
        if first == "":
            n = int(last)
            return max(size - n, 0), size
        start = int(first)
        end = int(last) + 1 if last else size
    except ValueError:
        return None
    return start, min(end, size)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"  # one request per connection: nothing idles in keep-alive when the server stops
    timeout = 10  # a stalled client cannot hold a handler thread (and stop()) forever

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: no access log on stderr

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_GET(self) -> None:
        self._dispatch()

    # -- plumbing -----------------------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        hub = self.server.hub
        hub._log(self.command, self.path)
        try:
            if self.server.role == "cdn":
                self._cdn()
            else:
                self._hub()
        except _HttpError as e:
            body = json.dumps({"error": e.message}).encode()
            headers = {"Content-Type": "application/json; charset=utf-8", "X-Error-Message": e.message, **e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._send(e.status, headers, body)

    def _send(self, status: int, headers: Mapping[str, str], body: bytes, *, length: int | None = None) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, data: Any) -> None:
        self._send(200, {"Content-Type": "application/json; charset=utf-8"}, json.dumps(data).encode())

    # -- the hub ------------------------------------------------------------------------------------------------------

    def _hub(self) -> None:
        hub = self.server.hub
        split = urlsplit(self.path)
        query = parse_qs(split.query)
        # split before unquoting: a revision or folder may be sent with its "/" encoded as %2F
        segments = split.path.strip("/").split("/")
        auth = self.headers.get("Authorization")
        with hub._lock:  # repos may change between requests, never during one
            if segments[:2] == ["api", "models"]:
                repo_id, rest = hub._split_repo(segments[2:])
                repo = hub._repo(repo_id)
                hub._access(repo, auth, files=False)
                if not rest:
                    return self._json(_model_info(repo, hub._commit(repo, _default_branch(repo)), query))
                if rest[0] == "revision" and len(rest) == 2:
                    return self._json(_model_info(repo, hub._commit(repo, unquote(rest[1])), query))
                if rest[0] == "tree" and len(rest) >= 2:
                    commit = hub._commit(repo, unquote(rest[1]))
                    folder = unquote("/".join(rest[2:])).strip("/")
                    recursive = query.get("recursive", ["false"])[-1].lower() in ("true", "1")
                    return self._json(self._tree(commit, folder, recursive))
                if rest == ["refs"]:
                    return self._json(_refs(repo))
                raise _HttpError(404, None, "Sorry, we can't find the page you are looking for.")
            if "resolve" not in segments[1:3]:
                raise _HttpError(404, None, "Sorry, we can't find the page you are looking for.")
            at = segments.index("resolve", 1)
            repo = hub._repo("/".join(segments[:at]))
            if len(segments) < at + 3:
                raise _HttpError(404, None, "Sorry, we can't find the page you are looking for.")
            hub._access(repo, auth, files=True)
            commit = hub._commit(repo, unquote(segments[at + 1]))
            path = unquote("/".join(segments[at + 2 :]))
            f = commit.files.get(path)
            if f is None:
                raise _HttpError(
                    404, "EntryNotFound", f'{path} does not exist on "{commit.sha}"', {"X-Repo-Commit": commit.sha}
                )
        # outside the lock: sending a file may take a while
        self._resolve(repo.repo_id, commit, f)

    def _tree(self, commit: _Commit, folder: str, recursive: bool) -> list[dict[str, Any]]:
        prefix = folder + "/" if folder else ""
        paths = [p for p in commit.files if p.startswith(prefix)]
        if folder and not paths:
            raise _HttpError(404, "EntryNotFound", f'{folder} does not exist on "{commit.sha}"')
        folders: set[str] = set()
        out: list[dict[str, Any]] = []
        for p in sorted(paths):
            parts = p[len(prefix) :].split("/")
            # every folder between ``folder`` and the file (only the first level unless recursive)
            for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
                folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                out.append(_tree_entry(commit.files[p]))
        out += [_folder_entry(d, commit) for d in sorted(folders)]
        return sorted(out, key=lambda e: (e["type"] != "directory", e["path"]))

    def _resolve(self, repo_id: str, commit: _Commit, f: _File) -> None:
        name = f.path.rsplit("/", 1)[-1]
        headers = {
            "X-Repo-Commit": commit.sha,
            "Accept-Ranges": "bytes",
            "Content-Disposition": f"inline; filename*=UTF-8''{quote(name)}; filename=\"{name}\";",
        }
        if f.lfs:
            # as the hub for LFS (non-Xet) files: a redirect to the CDN, the file's metadata on the redirect itself
            location = f"{self.server.hub.cdn_url}/repos/{quote(repo_id)}/{f.sha256}/{quote(f.path)}"
            body = f"Found. Redirecting to {location}".encode()
            headers.update(
                {
                    "Location": location,
                    "ETag": f'"{f.oid}"',
                    "X-Linked-Etag": f'"{f.etag}"',
                    "X-Linked-Size": str(len(f.data)),
                    "Content-Type": "text/plain; charset=utf-8",
                }
            )
            return self._send(302, headers, body)
        headers.update({"ETag": f'"{f.etag}"', "Content-Type": "application/octet-stream"})
        self._content(f"{repo_id}/{f.path}", f.path, f.data, headers)

    # -- the CDN ------------------------------------------------------------------------------------------------------

    def _cdn(self) -> None:
        hub = self.server.hub
        # /repos/<repo id>/<sha256>/<path in repo>: content-addressed, "signed", so no token is needed
        segments = urlsplit(self.path).path.strip("/").split("/")
        data = None
        if segments[0] == "repos" and len(segments) >= 4:
            for i in range(2, len(segments) - 1):
                with hub._lock:
                    data = hub._lfs.get(segments[i])
                if data is not None:
                    repo_id, sha, path = "/".join(segments[1:i]), segments[i], unquote("/".join(segments[i + 1 :]))
                    break
        if data is None:
            raise _HttpError(403, None, "AccessDenied")
        headers = {
            "ETag": f'"{sha}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f"attachment; filename*=UTF-8''{quote(path.rsplit('/', 1)[-1])};",
        }
        self._content(f"{unquote(repo_id)}/{path}", path, data, headers)

    # -- file bodies --------------------------------------------------------------------------------------------------

    def _content(self, name: str, path: str, data: bytes, headers: dict[str, str]) -> None:
        """Send ``data`` (or the part a ``Range`` asks for); cut it at the middle if ``path`` is interrupted."""
        hub = self.server.hub
        size = len(data)
        start, end, status = 0, size, 200
        asked = _byte_range(self.headers.get("Range"), size)
        if self.headers.get("Range") is not None:
            if asked is None or asked[0] >= size or asked[0] >= asked[1]:
                raise _HttpError(416, None, "Range Not Satisfiable", {"Content-Range": f"bytes */{size}"})
            start, end = asked
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{size}"}
        if self.command == "HEAD":
            return self._send(status, headers, b"", length=end - start)
        with hub._lock:
            hub.downloaded.append(name)
            cut = path in hub.interrupt
        if cut:
            # the full Content-Length, then only the bytes before the middle of the file; the connection then closes
            # (HTTP/1.0), so the client sees a body shorter than announced
            body = data[start : max(start, min(end, size // 2))]
            self.close_connection = True
            return self._send(status, headers, body, length=end - start)
        self._send(status, headers, data[start:end])


def _default_branch(repo: _Repo) -> str:
    """The default branch: ``main`` if it exists, else the first branch created."""
    return "main" if "main" in repo.branches else next(iter(repo.branches))


def _refs(repo: _Repo) -> dict[str, Any]:
    return {
        "branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s} for b, s in repo.branches.items()],
        "tags": [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": s} for t, s in repo.tags.items()],
        "converts": [],
    }
