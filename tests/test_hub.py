"""Models by hub id (``lab.models.hub``): ``Engine("org/name", revision=...)`` and adapters by ``org/name@rev``.

Offline, on a Hugging Face cache laid out as huggingface_hub writes it (``tests/hub_cache.py`` writes it without
huggingface_hub: blobs, relative snapshot links, refs); online, against a small hub on 127.0.0.1
(``tests/hub_server.py``) that the real huggingface_hub client talks to over a socket. References: the same folders
loaded by path, and sentence-transformers on the same cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import cosine_rows
from hub_cache import read_folder, repo_folder_name, write_hub_cache
from hub_server import HubServer, go_online
from tiny_models import tiny_llama

from lab import Engine
from lab.models import hub

TEXTS = [
    "A man is playing a guitar.",
    "a",
    "Someone plays an acoustic guitar on a stage, loudly and well.",
    "The stock market fell.",
    "Paris",
]
MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"
BASE_ID = "tiny-org/tiny-llama"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, made this process's (``HF_HUB_CACHE`` for child processes too), offline."""
    from huggingface_hub import constants

    folder = tmp_path / "hf-cache"
    folder.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    return folder


@pytest.fixture(scope="module")
def llamas(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny Llama checkpoints of one shape and tokenizer, other weights (two revisions of one repository)."""
    root = tmp_path_factory.mktemp("llamas")
    return tiny_llama(root / "v1", seed=0), tiny_llama(root / "v2", seed=1)


def embed(eng: Engine) -> np.ndarray:
    order = np.random.default_rng(0).permutation(len(TEXTS))  # shuffled in, compared in input order
    out = np.empty((len(TEXTS), eng.embedding_dim), dtype=np.float32)
    out[order] = eng.embed([TEXTS[i] for i in order])
    return out


# ---------------------------------------------------------------------------------------------- offline, cached
def test_an_id_in_the_cache_equals_sentence_transformers_on_that_cache(cache, minilm_path):
    from sentence_transformers import SentenceTransformer

    snap = write_hub_cache(cache, MINILM_ID, Path(minilm_path), commit=COMMIT_A)
    eng = Engine(MINILM_ID)
    assert Path(eng.model_path) == snap and eng.model_name == MINILM_ID and eng.revision == COMMIT_A
    assert eng.reference == f"https://huggingface.co/{MINILM_ID}"
    st = SentenceTransformer(MINILM_ID, device="cpu", cache_folder=str(cache), local_files_only=True)
    cos = cosine_rows(embed(eng), st.encode(TEXTS, convert_to_numpy=True))
    assert cos.min() >= 0.99999, cos
    assert f"Engine('{MINILM_ID}', revision='{COMMIT_A[:12]}'" in repr(eng)
    assert (eng.stats.model, eng.stats.revision) == (MINILM_ID, COMMIT_A) and MINILM_ID in str(eng.stats)
    # the snapshot folder given as a path: the same model, still known by its id and commit
    by_path = Engine(str(snap))
    assert (by_path.model_name, by_path.revision) == (MINILM_ID, COMMIT_A)
    np.testing.assert_array_equal(embed(by_path), embed(eng))


def test_revisions_by_branch_tag_and_commit_load_their_snapshot(cache, llamas):
    v1, v2 = llamas
    write_hub_cache(cache, BASE_ID, v1, commit=COMMIT_A, refs={"v1.0": COMMIT_A})
    write_hub_cache(cache, BASE_ID, v2, commit=COMMIT_B, refs={"main": COMMIT_B, "dev": COMMIT_B})
    want = {COMMIT_A: embed(Engine(str(v1))), COMMIT_B: embed(Engine(str(v2)))}
    assert not np.allclose(want[COMMIT_A], want[COMMIT_B])
    for revision, commit in [
        (None, COMMIT_B),
        ("main", COMMIT_B),
        ("dev", COMMIT_B),
        ("v1.0", COMMIT_A),
        (COMMIT_A, COMMIT_A),
    ]:
        eng = Engine(BASE_ID, revision=revision)
        assert eng.revision == commit and eng.knobs["revision"] == revision, revision
        np.testing.assert_array_equal(embed(eng), want[commit])
    np.testing.assert_array_equal(embed(Engine(f"{BASE_ID}@v1.0")), want[COMMIT_A])
    with pytest.raises(ValueError, match=r"names revision 'v1.0' but revision='main' was passed too"):
        Engine(f"{BASE_ID}@v1.0", revision="main")
    eng = Engine(BASE_ID)
    with pytest.raises(
        ValueError,
        match=r"revision cannot change live .*Engine\('tiny-org/tiny-llama', "
        r"revision='v1.0'\)",
    ):
        eng.configure(revision="v1.0")
    assert eng.revision == COMMIT_B


def test_a_local_path_wins_over_an_id_of_the_same_spelling(cache, llamas, tmp_path, monkeypatch):
    v1, v2 = llamas
    write_hub_cache(cache, BASE_ID, v2, commit=COMMIT_B)
    shutil.copytree(v1, tmp_path / "work" / BASE_ID)
    monkeypatch.chdir(tmp_path / "work")
    eng = Engine(BASE_ID)
    assert eng.model_name == "local/tiny-llama" and eng.revision.startswith("local-")
    np.testing.assert_array_equal(embed(eng), embed(Engine(str(v1))))
    with pytest.raises(ValueError, match=r"revision='main' applies to hub ids; 'tiny-org/tiny-llama' is a local path"):
        Engine(BASE_ID, revision="main")


def test_a_local_folder_has_a_content_revision(llamas, tmp_path):
    v1, v2 = llamas
    a, b = Engine(str(v1)), Engine(str(v2))
    assert a.model_name == "local/v1" or a.model_name.startswith("local/")
    assert a.revision.startswith("local-") and a.revision != b.revision
    copy = shutil.copytree(v1, tmp_path / "copy")
    assert Engine(str(copy)).revision == a.revision  # by content, not by place


def test_a_missing_id_offline_fails_fast_naming_the_id_the_cache_and_the_fix(cache):
    t0 = time.perf_counter()
    with pytest.raises(FileNotFoundError) as e:
        Engine("BAAI/bge-small-en-v1.5", revision="v2")
    assert time.perf_counter() - t0 < 1.0
    msg = str(e.value)
    for part in (
        "'BAAI/bge-small-en-v1.5' at revision 'v2'",
        "HF_HUB_OFFLINE is set",
        str(cache / "models--BAAI--bge-small-en-v1.5"),
        "hf download BAAI/bge-small-en-v1.5 --revision v2",
    ):
        assert part in msg, msg


def test_an_unknown_revision_of_a_cached_id_offline_is_named(cache, llamas):
    write_hub_cache(cache, BASE_ID, llamas[0], commit=COMMIT_A)
    with pytest.raises(
        FileNotFoundError,
        match=r"'tiny-org/tiny-llama' at revision 'nope' is not in the Hugging "
        r"Face cache",
    ):
        Engine(BASE_ID, revision="nope")


@pytest.mark.parametrize(
    "name, match",
    [
        ("org/na me", r"neither an existing local path nor a valid hub id"),
        ("a/b/c", r"does not exist \(and it is not a hub id such as 'org/name'\)"),
        ("org/name@", r"written 'org/name@revision'"),
        ("org--x/y", r"neither an existing local path nor a valid hub id"),
    ],
)
def test_malformed_names_are_refused_clearly(cache, name, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        Engine(name)


def test_adapters_by_id_and_revision_equal_the_same_folders_by_path(cache, llamas, tmp_path):
    from test_llm2vec_layouts import bare_adapter

    base = llamas[0]
    one = Path(bare_adapter(base, tmp_path / "one", seed=3, base_name=BASE_ID))
    two = Path(bare_adapter(base, tmp_path / "two", seed=4, base_name=BASE_ID))
    write_hub_cache(cache, BASE_ID, base, commit=COMMIT_A)
    write_hub_cache(cache, "tiny-org/adapter", one, commit=COMMIT_A, refs={"main": COMMIT_A})
    write_hub_cache(cache, "tiny-org/adapter", two, commit=COMMIT_B, refs={"v2": COMMIT_B})
    by_path = embed(Engine(str(base), adapters=[str(one), str(two)], pooling="mean"))
    eng = Engine(BASE_ID, adapters=["tiny-org/adapter", "tiny-org/adapter@v2"], pooling="mean")
    np.testing.assert_array_equal(embed(eng), by_path)
    assert eng.adapter_names == ["tiny-org/adapter", "tiny-org/adapter"]
    eng.configure(adapters=["tiny-org/adapter@" + COMMIT_B])  # live, by commit
    np.testing.assert_array_equal(embed(eng), embed(Engine(str(base), adapters=[str(two)], pooling="mean")))
    with pytest.raises(FileNotFoundError, match=r"adapter 'tiny-org/adapter' at revision 'v3' is not in the Hugging"):
        eng.configure(adapters=["tiny-org/adapter@v3"])
    # an adapter by id as the model: its base_model_name_or_path, an id too, from the cache
    alone = Engine("tiny-org/adapter", pooling="mean")
    assert alone.model_name == "tiny-org/adapter" and Path(alone.model_path) == hub.resolve(BASE_ID).folder
    np.testing.assert_array_equal(embed(alone), embed(Engine(str(base), adapters=[str(one)], pooling="mean")))


def test_the_published_llm2vec_layout_by_ids_needs_no_other_argument(cache, llamas, tmp_path):
    """``Engine(<-mntp id>, adapters=[<-supervised id>])``: the -mntp repository names its base by id, the
    supervised one names the -mntp repository; all three from the cache, equal to the folders by path."""
    from test_llm2vec_layouts import BASE_ID as LLAMA3
    from test_llm2vec_layouts import MNTP_ID, published_layout

    root = tmp_path / "published"
    base_dir, mntp_dir, sup_dir = published_layout(root, llamas[0])
    for repo, folder, commit in [
        (LLAMA3, base_dir, COMMIT_A),
        (MNTP_ID, mntp_dir, COMMIT_B),
        (MNTP_ID + "-supervised", sup_dir, "c" * 40),
    ]:
        write_hub_cache(cache, repo, folder, commit=commit)
    want = embed(Engine(str(mntp_dir), adapters=[str(sup_dir)]))  # the same folders by path, no knobs either
    eng = Engine(MNTP_ID, adapters=[MNTP_ID + "-supervised"])
    np.testing.assert_array_equal(embed(eng), want)
    weights = embed(
        Engine(
            str(base_dir),
            adapters=[str(mntp_dir), str(sup_dir)],
            bidirectional=True,
            pooling="mean",
            instruction_pooling="exact",
        )
    )
    # llm2vec's defaults, its weights
    np.testing.assert_array_equal(
        embed(Engine(MNTP_ID, adapters=[MNTP_ID + "-supervised"], instruction_pooling="exact")), weights
    )
    assert (eng.model_name, eng.revision) == (MNTP_ID, COMMIT_B)
    assert not list(cache.rglob("EXECUTED"))  # the -mntp repository's modeling code never ran


# ------------------------------------------------------------------------------------------------ online
@pytest.fixture
def online(cache, monkeypatch):
    """A hub on 127.0.0.1 that huggingface_hub in this process talks to (its endpoint and offline switch are read
    at import, so they are set on its constants), with an empty cache."""
    from huggingface_hub import constants

    server = HubServer()
    with server:
        go_online(monkeypatch)
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        yield server


def _with_extras(folder: Path) -> dict[str, bytes]:
    """A repository as the hub holds it: the folder's files and others the Engine never reads."""
    files = read_folder(folder)
    files.update(
        {
            "onnx/model.onnx": b"onnx" * 100,
            "pytorch_model.bin": b"pickle" * 100,
            "tf_model.h5": b"h5" * 100,
            "openvino/openvino_model.xml": b"<xml/>",
            ".gitattributes": b"*\n",
        }
    )
    return files


def test_download_fetches_only_what_the_engine_reads_then_works_offline(online, cache, llamas, monkeypatch):
    from huggingface_hub import constants

    v1, v2 = llamas
    sha1 = online.add_repo(BASE_ID, _with_extras(v1), tags=("v1.0",))
    sha2 = online.add_commit(BASE_ID, _with_extras(v2))
    eng = Engine(BASE_ID)
    assert eng.revision == sha2 and Path(eng.model_path) == cache / repo_folder_name(BASE_ID) / "snapshots" / sha2
    np.testing.assert_array_equal(embed(eng), embed(Engine(str(v2))))
    fetched = {p.split("/", 2)[2] for p in online.downloaded}
    assert fetched == {f.name for f in v2.iterdir()}, fetched  # no onnx, .bin, .h5, openvino, .gitattributes
    tagged = Engine(BASE_ID, revision="v1.0")
    assert tagged.revision == sha1
    np.testing.assert_array_equal(embed(tagged), embed(Engine(str(v1))))
    # offline afterwards: the same snapshots, nothing asked of the hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    asked = len(online.requests)
    assert Engine(BASE_ID).revision == sha2 and Engine(BASE_ID, revision="v1.0").revision == sha1
    assert len(online.requests) == asked


def test_hub_errors_are_named(online, cache, llamas):
    online.add_repo(BASE_ID, read_folder(llamas[0]))
    with pytest.raises(
        ValueError,
        match=r"'tiny-org/tiny-llama' has no revision 'nope' \(a branch, a tag or a "
        r"commit",
    ):
        Engine(BASE_ID, revision="nope")
    with pytest.raises(
        FileNotFoundError,
        match=r"'tiny-org/missing' is not a repository on the hub, or it is "
        r"private",
    ):
        Engine("tiny-org/missing")
    online.add_repo("tiny-org/docs-only", {"README.md": b"# nothing\n"})
    with pytest.raises(ValueError, match=r"holds no model: no config.json"):
        Engine("tiny-org/docs-only")
    online.add_repo("tiny-org/no-weights", {"config.json": (llamas[0] / "config.json").read_bytes()})
    with pytest.raises(ValueError, match=r"has a config.json but no weights the engine reads"):
        Engine("tiny-org/no-weights")
    assert not (cache / repo_folder_name("tiny-org/no-weights") / "snapshots").exists()  # nothing half-written


def test_private_and_gated_repositories_need_a_token(online, llamas, monkeypatch):
    online.token = "hf_test_token"
    online.add_repo("tiny-org/private", read_folder(llamas[0]), private=True)
    online.add_repo("tiny-org/gated", read_folder(llamas[0]), gated=True)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.utils._auth.get_token", lambda: None, raising=False)
    with pytest.raises(FileNotFoundError, match=r"private and no token with access was given"):
        Engine("tiny-org/private")
    with pytest.raises(PermissionError, match=r"'tiny-org/gated' at revision 'main' is gated: accept its conditions"):
        Engine("tiny-org/gated")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", "/nonexistent")  # the variable, not a saved login
    want = embed(Engine(str(llamas[0])))
    np.testing.assert_array_equal(embed(Engine("tiny-org/private")), want)
    np.testing.assert_array_equal(embed(Engine("tiny-org/gated")), want)


def test_an_interrupted_download_is_an_error_and_the_next_run_resumes(online, cache, llamas, monkeypatch):
    from huggingface_hub import file_download

    monkeypatch.setattr(file_download.time, "sleep", lambda s: None)  # huggingface_hub's retries, without waiting
    online.add_repo(BASE_ID, read_folder(llamas[0]))
    online.interrupt = {"model.safetensors"}
    with pytest.raises(
        ConnectionError,
        match=r"downloading model 'tiny-org/tiny-llama' at revision 'main' failed: "
        r".*run the same call again to resume",
    ):
        Engine(BASE_ID)
    snaps = cache / repo_folder_name(BASE_ID) / "snapshots"
    assert not list(snaps.rglob("model.safetensors"))  # no half file where the loader would look
    assert not list((cache / repo_folder_name(BASE_ID) / "blobs").glob("*.incomplete"))
    online.interrupt = set()
    np.testing.assert_array_equal(embed(Engine(BASE_ID)), embed(Engine(str(llamas[0]))))


def test_hf_endpoint_in_a_fresh_process(tmp_path, llamas):
    """The user's path end to end: ``HF_ENDPOINT`` and ``HF_HUB_CACHE`` set before Python starts, online."""
    server = HubServer()
    sha = server.add_repo(BASE_ID, read_folder(llamas[1]))
    code = (
        "from lab import Engine; e = Engine('tiny-org/tiny-llama'); import json; "
        "print(json.dumps([e.model_name, e.revision, e.embed(['a text']).tolist()]))"
    )
    with server:
        env = {
            **os.environ,
            "HF_ENDPOINT": server.url,
            "HF_HUB_CACHE": str(tmp_path / "c"),
            "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
        )
    assert out.returncode == 0, out.stderr[-2000:]
    name, revision, vec = json.loads(out.stdout.strip().splitlines()[-1])
    assert (name, revision) == (BASE_ID, sha)
    np.testing.assert_allclose(vec, Engine(str(llamas[1])).embed(["a text"]), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------- the file choice
@pytest.mark.parametrize(
    "files, want",
    [
        (
            [
                "config.json",
                "model.safetensors",
                "pytorch_model.bin",
                "tokenizer.json",
                "onnx/model.onnx",
                "README.md",
            ],
            ["README.md", "config.json", "model.safetensors", "tokenizer.json"],
        ),
        (
            [
                "config.json",
                "model.safetensors.index.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "pytorch_model.bin.index.json",
                "pytorch_model-00001-of-00002.bin",
            ],
            [
                "config.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "model.safetensors.index.json",
            ],
        ),
        (
            ["config.json", "pytorch_model.bin", "vocab.txt", "tf_model.h5", "flax_model.msgpack"],
            ["config.json", "pytorch_model.bin", "vocab.txt"],
        ),
        (
            [
                "modules.json",
                "config.json",
                "model.safetensors",
                "1_Pooling/config.json",
                "2_Dense/model.safetensors",
                "2_Dense/config.json",
                "onnx/model_O4.onnx",
                "openvino/openvino_model.bin",
            ],
            [
                "1_Pooling/config.json",
                "2_Dense/config.json",
                "2_Dense/model.safetensors",
                "config.json",
                "model.safetensors",
                "modules.json",
            ],
        ),
        (
            [
                "adapter_config.json",
                "adapter_model.safetensors",
                "adapter_model.bin",
                "llm2vec_config.json",
                "training_args.bin",
                "optimizer.pt",
            ],
            ["adapter_config.json", "adapter_model.safetensors", "llm2vec_config.json"],
        ),
        (
            ["config.json", "model.safetensors", "sparse_linear.pt", "colbert_linear.pt", "sentencepiece.bpe.model"],
            ["colbert_linear.pt", "config.json", "model.safetensors", "sentencepiece.bpe.model", "sparse_linear.pt"],
        ),
        (["README.md", "smollm2-q8_0.gguf", "smollm2-f16.gguf"], ["README.md", "smollm2-f16.gguf"]),
    ],
)
def test_files_to_fetch_takes_what_the_loader_reads(files, want):
    assert hub.files_to_fetch(files) == want


def test_snapshot_of_reads_the_cache_layout(tmp_path):
    snap = tmp_path / "models--org--na.me" / "snapshots" / COMMIT_A
    assert hub.snapshot_of(snap) == ("org/na.me", COMMIT_A)
    assert hub.snapshot_of(snap / "1_Pooling") == ("org/na.me", COMMIT_A)
    assert hub.snapshot_of(tmp_path / "snapshots" / COMMIT_A) is None
    assert hub.snapshot_of(tmp_path / "models--org--x" / "snapshots" / "abc") is None
