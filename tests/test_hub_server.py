"""The test hub (tests/hub_server.py) and the hand-written hub cache (tests/hub_cache.py) against the real
huggingface_hub client: same cache layout, revisions, allow_patterns, offline use, errors, interrupted downloads.

The suite runs with HF_HUB_OFFLINE=1 (tests/conftest.py); tests that talk to the server flip
``huggingface_hub.constants.HF_HUB_OFFLINE`` with monkeypatch (``go_online``), see hub_server's docstring.
"""

from __future__ import annotations

import hashlib
import os
import random
import types
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from hub_cache import etag, write_hub_cache
from hub_server import HubServer, go_online
from huggingface_hub import (
    HfApi,
    constants,
    file_download,
    hf_hub_download,
    scan_cache_dir,
    snapshot_download,
    try_to_load_from_cache,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

REPO = "org/tiny-embedder"
WEIGHTS = random.Random(0).randbytes(1_500_000)  # over 1 MiB and .safetensors: an LFS file
FILES: dict[str, bytes] = {
    "config.json": b'{"hidden_size": 8}',
    "tokenizer_config.json": b'{"do_lower_case": true}',
    "modules.json": b'[{"idx": 0, "path": "", "type": "Transformer"}]',
    "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
    "model.safetensors": WEIGHTS,
}
FILES_V2: dict[str, bytes] = {**FILES, "config.json": b'{"hidden_size": 16}', "model.safetensors": WEIGHTS[::-1]}

# huggingface_hub's bookkeeping next to the layout a reader needs, left out of the comparisons: the tree listing
# snapshot_download caches (models--*/trees/<commit>.json), files known missing (models--*/.no_exist/), the download
# locks (<cache>/.locks/) and the backup tools' marker (<cache>/CACHEDIR.TAG)
BOOKKEEPING = ("trees", ".no_exist")


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A running hub: REPO with FILES at commit ``v1_sha`` (tag v1), then FILES_V2 on main; online for this test."""
    go_online(monkeypatch)
    server = HubServer()
    server.v1_sha = server.add_repo(REPO, FILES, tags=("v1",))  # type: ignore[attr-defined]
    server.v2_sha = server.add_commit(REPO, FILES_V2)  # type: ignore[attr-defined]
    with server:
        yield server
    assert not server.errors


def download(server: HubServer, cache: Path, **kwargs) -> Path:
    kwargs.setdefault("token", False)  # never a token from the machine running the tests
    return Path(snapshot_download(REPO, endpoint=server.url, cache_dir=cache, **kwargs))


def cache_tree(cache: Path) -> dict[str, tuple[str, str | bytes]]:
    """Every entry of the repo folders under ``cache`` -> ("link", target) / ("file", bytes) / ("dir", "")."""
    out: dict[str, tuple[str, str | bytes]] = {}
    for repo in sorted(cache.glob("models--*")):
        for p in sorted(repo.rglob("*")):
            rel = p.relative_to(cache)
            if rel.parts[1] in BOOKKEEPING:
                continue
            if p.is_symlink():
                out[rel.as_posix()] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel.as_posix()] = ("dir", "")
            else:
                out[rel.as_posix()] = ("file", p.read_bytes())
    return out


def fetched(server: HubServer) -> list[str]:
    """The files of REPO whose bytes the server sent, in repo paths."""
    return sorted(name[len(REPO) + 1 :] for name in server.downloaded)


def test_etag_is_the_hubs() -> None:
    # `printf 'hello\n' | git hash-object --stdin`: small files are named by their git blob sha1 ...
    assert etag(b"hello\n", "README.md") == "ce013625030ba8dba906f756967f9e9ca394464a"
    # ... LFS files (weights suffixes, or >= 1 MiB) by the sha256 of their content
    assert etag(b"hello\n", "model.safetensors") == hashlib.sha256(b"hello\n").hexdigest()
    assert etag(b"x" * (1 << 20), "vocab.txt") == hashlib.sha256(b"x" * (1 << 20)).hexdigest()


def test_snapshot_download_writes_what_write_hub_cache_writes(hub: HubServer, tmp_path: Path) -> None:
    folder = download(hub, tmp_path / "hf", revision="v1")
    mine = write_hub_cache(tmp_path / "mine", REPO, FILES, commit=hub.v1_sha, refs={"v1": hub.v1_sha})

    assert folder.relative_to(tmp_path / "hf") == mine.relative_to(tmp_path / "mine")
    theirs, ours = cache_tree(tmp_path / "hf"), cache_tree(tmp_path / "mine")
    assert theirs == ours
    # spelled out, so a bug shared by both writers still shows
    repo = "models--org--tiny-embedder"
    assert ours[f"{repo}/refs/v1"] == ("file", hub.v1_sha.encode())
    sha256 = hashlib.sha256(WEIGHTS).hexdigest()
    assert ours[f"{repo}/blobs/{sha256}"] == ("file", WEIGHTS)
    assert ours[f"{repo}/snapshots/{hub.v1_sha}/model.safetensors"] == ("link", f"../../blobs/{sha256}")
    pooling = etag(FILES["1_Pooling/config.json"], "1_Pooling/config.json")
    assert ours[f"{repo}/snapshots/{hub.v1_sha}/1_Pooling/config.json"] == ("link", f"../../../blobs/{pooling}")
    # what huggingface_hub 2.4.0 writes besides: the tree listing cache, the locks, the CACHEDIR.TAG marker
    assert (tmp_path / "hf" / repo / "trees" / f"{hub.v1_sha}.json").is_file()
    assert (tmp_path / "hf" / ".locks" / repo).is_dir() and (tmp_path / "hf" / "CACHEDIR.TAG").is_file()

    # huggingface_hub's own cache scanner reads the hand-written cache as one of its own
    report = scan_cache_dir(tmp_path / "mine")
    assert not report.warnings
    (info,) = report.repos
    (revision,) = info.revisions
    assert (info.repo_id, revision.commit_hash, revision.refs) == (REPO, hub.v1_sha, frozenset({"v1"}))
    assert {f.file_name for f in revision.files} == {
        "config.json",
        "tokenizer_config.json",
        "modules.json",
        "model.safetensors",
    }
    assert len(revision.files) == len(FILES)


def test_revisions_resolve_to_their_commits(hub: HubServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    by_branch = download(hub, cache)  # main
    by_tag = download(hub, cache, revision="v1")
    by_sha = download(hub, cache, revision=hub.v1_sha)
    assert by_branch.name == hub.v2_sha and by_tag.name == by_sha.name == hub.v1_sha
    assert (by_branch / "config.json").read_bytes() == FILES_V2["config.json"]
    assert (by_branch / "model.safetensors").read_bytes() == FILES_V2["model.safetensors"]
    assert (by_tag / "config.json").read_bytes() == FILES["config.json"]
    assert (by_sha / "model.safetensors").read_bytes() == WEIGHTS
    refs = cache / "models--org--tiny-embedder" / "refs"
    assert sorted(p.name for p in refs.iterdir()) == ["main", "v1"]  # a sha is never a ref
    assert (refs / "main").read_text() == hub.v2_sha and (refs / "v1").read_text() == hub.v1_sha
    # unchanged files share their blob across the two commits
    assert os.path.samefile(by_branch / "modules.json", by_tag / "modules.json")

    one = hf_hub_download(
        REPO, "config.json", revision="v1", endpoint=hub.url, cache_dir=tmp_path / "one", token=False
    )
    assert Path(one).read_bytes() == FILES["config.json"]

    api = HfApi(endpoint=hub.url, token=False)
    assert api.model_info(REPO).sha == hub.v2_sha
    assert api.model_info(REPO, revision="v1").sha == hub.v1_sha
    assert api.repo_info(REPO, revision=hub.v1_sha).sha == hub.v1_sha
    info = api.model_info(REPO, revision="main", files_metadata=True)
    assert {s.rfilename for s in info.siblings} == set(FILES)
    weights = next(s for s in info.siblings if s.rfilename == "model.safetensors")
    assert weights.size == len(WEIGHTS) and weights.lfs.sha256 == hashlib.sha256(WEIGHTS[::-1]).hexdigest()
    config = next(s for s in info.siblings if s.rfilename == "config.json")
    assert config.lfs is None and config.blob_id == etag(FILES_V2["config.json"], "config.json")
    assert sorted(api.list_repo_files(REPO, revision="v1")) == sorted(FILES)
    tree = {e.path: e for e in api.list_repo_tree(REPO, recursive=True)}
    assert set(tree) == set(FILES) | {"1_Pooling"}
    assert {e.path for e in api.list_repo_tree(REPO)} == (set(FILES) - {"1_Pooling/config.json"}) | {"1_Pooling"}
    assert {e.path for e in api.list_repo_tree(REPO, "1_Pooling")} == {"1_Pooling/config.json"}


def test_allow_patterns_fetch_only_the_allowed_files(hub: HubServer, tmp_path: Path) -> None:
    folder = download(hub, tmp_path, allow_patterns=["*.json"])
    assert fetched(hub) == sorted(p for p in FILES if p.endswith(".json"))
    assert not any("model.safetensors" in path for _, path in hub.requests)  # not even a HEAD
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == sorted(
        p for p in FILES if p.endswith(".json")
    )


def test_a_downloaded_snapshot_is_used_offline(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = download(hub, tmp_path)
    for revision in (None, "main", hub.v2_sha):
        assert download(hub, tmp_path, revision=revision, local_files_only=True) == folder
    served = len(hub.requests)
    # HF_HUB_OFFLINE=1 as conftest sets it: no request reaches the server, the cache answers
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert download(hub, tmp_path) == folder
    assert Path(hf_hub_download(REPO, "config.json", endpoint=hub.url, cache_dir=tmp_path)) == folder / "config.json"
    assert len(hub.requests) == served
    with pytest.raises(LocalEntryNotFoundError):
        download(hub, tmp_path, revision="v1")  # never downloaded


def test_a_written_cache_is_found_offline(tmp_path: Path) -> None:
    # no server: conftest's HF_HUB_OFFLINE=1 stays on, and local_files_only says it too
    old = write_hub_cache(tmp_path, REPO, FILES, commit="a" * 40, refs={"v1": "a" * 40})
    new = write_hub_cache(tmp_path, REPO, FILES_V2, commit="b" * 40)  # refs/main -> b...
    assert old.parent == new.parent
    for revision, folder, files in (("main", new, FILES_V2), ("v1", old, FILES), ("a" * 40, old, FILES)):
        found = snapshot_download(REPO, revision=revision, cache_dir=tmp_path, local_files_only=True)
        assert Path(found) == folder
        for name in ("config.json", "1_Pooling/config.json", "model.safetensors"):
            cached = try_to_load_from_cache(REPO, name, cache_dir=tmp_path, revision=revision)
            assert isinstance(cached, str) and Path(cached).read_bytes() == files[name]
    assert try_to_load_from_cache(REPO, "missing.json", cache_dir=tmp_path) is None
    assert try_to_load_from_cache(REPO, "config.json", cache_dir=tmp_path, revision="v2") is None
    assert Path(hf_hub_download(REPO, "modules.json", cache_dir=tmp_path, revision="v1")) == old / "modules.json"
    # a folder works as well as a dict, and blobs are shared with the commits already there
    src = tmp_path / "src"
    (src / "1_Pooling").mkdir(parents=True)
    for name in ("config.json", "1_Pooling/config.json"):
        (src / name).write_bytes(FILES[name])
    third = write_hub_cache(tmp_path, REPO, src, commit="c" * 40, refs={})
    assert sorted(p.relative_to(third).as_posix() for p in third.rglob("*") if p.is_file()) == sorted(
        ["config.json", "1_Pooling/config.json"]
    )
    assert os.path.samefile(third / "config.json", old / "config.json")
    assert len(list((new.parent.parent / "blobs").iterdir())) == len(set(FILES.values()) | set(FILES_V2.values()))


def test_errors_are_the_hubs(hub: HubServer, tmp_path: Path) -> None:
    def get(repo: str, name: str = "config.json", **kwargs) -> str:
        kwargs.setdefault("token", False)
        return hf_hub_download(repo, name, endpoint=hub.url, cache_dir=tmp_path, **kwargs)

    api = HfApi(endpoint=hub.url, token=False)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/missing", endpoint=hub.url, cache_dir=tmp_path, token=False)
    with pytest.raises(RepositoryNotFoundError):
        get("org/missing")

    with pytest.raises(RevisionNotFoundError):
        download(hub, tmp_path, revision="v9")
    with pytest.raises(RevisionNotFoundError):
        download(hub, tmp_path, revision="f" * 40)  # a sha skips model_info: the tree listing answers
    with pytest.raises(RevisionNotFoundError):
        get(REPO, revision="v9")

    with pytest.raises(EntryNotFoundError):
        get(REPO, "missing.json")
    # the 404 carries X-Repo-Commit, so huggingface_hub remembers the file is missing at that commit
    assert try_to_load_from_cache(REPO, "missing.json", cache_dir=tmp_path) is file_download._CACHED_NO_EXIST

    hub.token = "hf_secret"
    hub.add_repo("org/private", {"config.json": b"{}"}, private=True)
    hub.add_repo("org/gated", {"config.json": b"{}", "model.safetensors": b"weights"}, gated=True)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/private")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/private", endpoint=hub.url, cache_dir=tmp_path, token=False)
    with pytest.raises(RepositoryNotFoundError):
        get("org/private", token="hf_wrong")
    private = snapshot_download("org/private", endpoint=hub.url, cache_dir=tmp_path, token="hf_secret")
    assert (Path(private) / "config.json").read_bytes() == b"{}"

    assert api.model_info("org/gated").gated == "manual"  # a gated repo's card and file list are public
    with pytest.raises(GatedRepoError):
        get("org/gated")
    with pytest.raises(GatedRepoError):
        get("org/gated", token="hf_wrong")
    with pytest.raises(GatedRepoError):
        snapshot_download("org/gated", endpoint=hub.url, cache_dir=tmp_path, token=False)
    gated = snapshot_download("org/gated", endpoint=hub.url, cache_dir=tmp_path, token="hf_secret")
    assert (Path(gated) / "model.safetensors").read_bytes() == b"weights"


def test_an_interrupted_download_leaves_no_file(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # huggingface_hub sleeps 1 s before each of its 5 resumes; only the waiting is taken out
    sleeps: list[float] = []
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=sleeps.append))
    hub.interrupt = {"model.safetensors"}
    with pytest.raises(httpx2.RemoteProtocolError):
        download(hub, tmp_path)
    # one GET cut at the middle, then 5 retries; each a full GET again, as the half it got was still in httpx2's
    # 10 MB read buffer when the connection dropped, so huggingface_hub had no byte to resume from
    assert fetched(hub).count("model.safetensors") == 6 and sleeps == [1] * 5

    repo = tmp_path / "models--org--tiny-embedder"
    snapshot = repo / "snapshots" / hub.v2_sha
    assert not (snapshot / "model.safetensors").exists() and not (snapshot / "model.safetensors").is_symlink()
    blobs = {p.name for p in (repo / "blobs").iterdir()}
    assert hashlib.sha256(FILES_V2["model.safetensors"]).hexdigest() not in blobs
    assert not [b for b in blobs if b.endswith(".incomplete")]
    assert (snapshot / "config.json").read_bytes() == FILES_V2["config.json"]  # the other files made it
    # offline, the cached tree listing tells the snapshot is incomplete
    with pytest.raises(IncompleteSnapshotError):
        download(hub, tmp_path, local_files_only=True)

    hub.interrupt = set()
    hub.downloaded.clear()
    assert (download(hub, tmp_path) / "model.safetensors").read_bytes() == FILES_V2["model.safetensors"]
    assert fetched(hub) == ["model.safetensors"]  # the rest came from the cache
