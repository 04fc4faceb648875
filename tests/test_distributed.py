"""lab.distributed on a local Ray cluster (2 CPUs, started and stopped by this module; no other address is ever
contacted): RayEngine against a local Engine, knobs on every actor, stats, the mteb encoder, embed_dataset from each
kind of source, an actor killed mid-run, interrupt and resume, bad rows and a model that cannot load.

The actors run all-MiniLM-L6-v2 on one thread each; texts are a few hundred STSBenchmark sentences plus edge cases.
The file took 1.5 to 2.5 minutes on 2 cores that other work kept busy (load average ~5); no timings are asserted.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from conftest import cosine_rows

from lab import Engine
from lab._repo import import_evals
from lab.distributed import RayEngine, embed_dataset, split_by_tokens
from lab.distributed.shards import MANIFEST, model_digest, read_embeddings
from lab.engine.call import Stats

import_evals()
from evals.data_io import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
COS = 0.99999


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """A fresh local cluster with 2 CPUs: ``address="local"`` never joins a cluster found on the machine."""
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """253 texts, shuffled: STSBenchmark sentences, a 1-token text, an empty one and one past max_length."""
    rows = read_jsonl(ROOT / "evals" / "data" / "stsbenchmark" / "test.jsonl.gz")
    sentences = list(dict.fromkeys(r["sentence1"] for r in rows))[:250]
    out = [*sentences, "a", "", "The quick brown fox jumps over the lazy dog. " * 40]
    random.Random(0).shuffle(out)
    return out


@pytest.fixture(scope="module")
def local(minilm_path):
    """A local Engine of our own (its knobs change here)."""
    return Engine(minilm_path)


@pytest.fixture(scope="module")
def reference(local, texts) -> np.ndarray:
    local.configure(pooling=None)
    return local.embed(texts)


@pytest.fixture(scope="module")
def reference_cls(local, texts) -> np.ndarray:
    try:
        return local.configure(pooling="cls").embed(texts)
    finally:
        local.configure(pooling=None)


@pytest.fixture(scope="class")
def reng(minilm_path):
    """Two actors x 1 thread: the whole 2-CPU cluster, so tests that start their own actors run after this class."""
    r = RayEngine(minilm_path, num_actors=2, threads_per_actor=1, load_timeout=300)
    yield r
    r.close()


def by_id(out_dir) -> dict:
    ids, emb = read_embeddings(out_dir)
    assert len(ids) == len(set(ids)), "an id was written twice"
    return dict(zip(ids, emb))


def check_rows(got: dict, ids: list, expected: np.ndarray) -> None:
    """Every id exactly once, each row matching ``expected`` (in ``ids`` order)."""
    assert sorted(got, key=str) == sorted(ids, key=str)
    assert cosine_rows(np.stack([got[i] for i in ids]), expected).min() >= COS


class TestRayEngine:
    def test_embed_equals_engine_in_input_order(self, reng, texts, reference):
        emb = reng.embed(texts)
        assert emb.shape == reference.shape == (253, 384) and emb.dtype == np.float32
        assert cosine_rows(emb, reference).min() >= COS
        assert (reng.stats.per_actor.sequences > 0).all()  # both actors had a share
        rev = reng.embed(texts[::-1])
        assert cosine_rows(rev, reference[::-1]).min() >= COS

    def test_texts_are_split_by_tokens_not_by_count(self, reng, local):
        long = [f"{i} " + "many words in a long text " * 30 for i in range(40)]
        short = [f"w{i}" for i in range(200)]
        texts = long + short  # by count, actor 0 would get the 40 long texts and 80 short ones: ~5x the tokens
        lengths = np.array([r.length for r in local.tokenize(texts)])
        reng.embed(texts)
        per = reng.stats.per_actor
        assert per.tokens.sum() == lengths.sum()
        assert (abs(per.tokens - lengths.sum() / 2) <= lengths.max()).all(), per
        assert per.sequences.min() < 60 < per.sequences.max()  # so the text counts are far apart

    def test_stats_sum_the_actors(self, reng, texts, local):
        local.configure(pooling=None).embed(texts)
        reng.embed(texts)
        s = reng.stats
        assert isinstance(s, Stats) and s.actors == 2
        assert s.sequences == 253 and s.tokens == local.stats.tokens and s.truncated == local.stats.truncated == 1
        per = s.per_actor
        assert list(per.actor) == [0, 1] and {"pid", "node", "calls", "tokens", "seconds", "tokens_per_s"} <= set(per)
        assert per.tokens.sum() == s.tokens and per.sequences.sum() == s.sequences and per.batches.sum() == s.batches
        assert s.seconds > 0 and "2 Ray actor(s)" in str(s)

    def test_configure_reaches_every_actor(self, reng, texts, reference, reference_cls):
        try:
            assert reng.configure(pooling="cls") is reng
            assert reng.knobs["pooling"] == "cls" and reng.resolved["pooling"] == "cls"
            emb = reng.embed(texts)
            assert (reng.stats.per_actor.sequences > 0).all()
            assert cosine_rows(emb, reference_cls).min() >= COS  # every actor's rows are cls-pooled
            assert cosine_rows(emb, reference).min() < 0.99  # and cls differs from the mean pooling before
            with pytest.raises(ValueError, match="pooling"):
                reng.configure(pooling="bogus")
            with pytest.raises(ValueError, match="truncate_dim=1000 exceeds"):  # checked by an actor's Engine
                reng.configure(truncate_dim=1000)
            assert reng.knobs["pooling"] == "cls" and reng.knobs["truncate_dim"] is None  # nothing changed
            assert reng.embed(texts[:7]).shape == (7, 384)
        finally:
            reng.configure(pooling=None)
        assert cosine_rows(reng.embed(texts), reference).min() >= COS

    def test_instruction_per_call(self, reng, local, texts, reference):
        instruction = "Represent this sentence for searching relevant passages: "
        emb = reng.embed(texts[:40], instruction=instruction)
        local.configure(pooling=None)
        assert cosine_rows(emb, local.embed(texts[:40], instruction=instruction)).min() >= COS
        assert cosine_rows(emb, reference[:40]).min() < 0.99  # the instruction was attended to
        lengths = reng.token_lengths(texts[:40], instruction=instruction)
        assert list(lengths) == [r.length for r in local.tokenize(texts[:40], instruction=instruction)]

    def test_a_full_cluster_fails_at_once(self, reng, minilm_path, tmp_path):
        """reng holds both CPUs: more actors are refused before load_timeout (600 s), naming who holds them."""
        t0 = time.monotonic()
        words = (
            r"1 Ray actor\(s\) asking for 1 CPU\(s\) and 0 GPU\(s\) each need 1 CPU\(s\), but the cluster has "
            r"0 of its 2 CPU\(s\) free; held in this process by RayEngine\(.*, 2 actors x 1 thread"
        )
        with pytest.raises(RuntimeError, match=words):
            RayEngine(minilm_path, num_actors=1, load_timeout=600)
        with pytest.raises(RuntimeError, match=words):
            embed_dataset(minilm_path, ["a", "b"], tmp_path, num_actors=1, show_progress=False)
        assert time.monotonic() - t0 < 60
        assert reng.model_digest() == model_digest(minilm_path)  # the actors hash the files as the driver does

    def test_empty_and_bad_input(self, reng):
        assert reng.embed([]).shape == (0, 384)
        with pytest.raises(TypeError, match="single str"):
            reng.embed("a text")
        with pytest.raises(TypeError, match=r"texts\[1\] is int"):
            reng.embed(["a", 1])

    def test_as_mteb_model_encodes_across_the_actors(self, reng, local, texts, reference):
        pytest.importorskip("mteb")
        from mteb.models.models_protocols import EncoderProtocol

        from evals.tasks import get_task

        meta = get_task("STSBenchmark").metadata
        model = reng.as_mteb_model()
        assert isinstance(model, EncoderProtocol)
        loader = [{"text": texts[i : min(i + 16, 101)]} for i in range(0, 101, 16)]
        emb = model.encode(loader, task_metadata=meta, hf_split="test", hf_subset="default")
        assert cosine_rows(emb, reference[:101]).min() >= COS
        assert (reng.stats.per_actor.sequences > 0).all() and reng.stats.sequences == 101
        local.configure(pooling=None)
        mine, theirs = model.mteb_model_meta, local.as_mteb_model().mteb_model_meta
        assert (mine.name, mine.revision, mine.embed_dim) == (theirs.name, theirs.revision, theirs.embed_dim)
        assert mine.experiment_kwargs == theirs.experiment_kwargs  # one variant, one results folder

    def test_actor_killed_mid_run_is_restarted_with_its_knobs(self, reng, texts, reference_cls, tmp_path):
        """ray.kill(no_restart=False) after the first shard: the killed actor had its next shard in flight; Ray
        restarts it (its Engine starts with mean pooling again) and retries the call, which brings cls back."""
        killed = []

        def kill(row):
            if not killed:
                killed.append(row["pid"])
                ray.kill(reng.actors[row["actor"]], no_restart=False)

        try:
            reng.configure(pooling="cls")
            summary = embed_dataset(reng, texts, tmp_path, shard_texts=20, on_shard=kill, show_progress=False)
        finally:
            reng.configure(pooling=None)
        assert killed and list(summary.shard) == list(range(13)) and summary.rows.sum() == 253
        assert summary.computed.all()
        assert len(set(summary.pid)) == 3  # two actors, and the restarted one's new process did shards
        check_rows(by_id(tmp_path), list(range(253)), reference_cls)

    def test_actor_process_killed_mid_run(self, reng, texts, reference, tmp_path):
        """SIGKILL to the process of the actor that finished the first shard (its next shard is in flight)."""
        killed = []

        def kill(row):
            if not killed:
                killed.append(row["pid"])
                os.kill(row["pid"], signal.SIGKILL)

        summary = embed_dataset(reng, texts, tmp_path, shard_texts=20, on_shard=kill, show_progress=False)
        assert killed and summary.rows.sum() == 253 and list(summary.shard) == list(range(13))
        assert killed[0] in set(summary.pid) and len(set(summary.pid)) == 3
        check_rows(by_id(tmp_path), list(range(253)), reference)

    def test_interrupt_then_resume_skips_finished_shards(self, reng, texts, reference, tmp_path):
        out = tmp_path / "out"
        done = []

        def interrupt(row):
            done.append(row["shard"])
            if len(done) == 2:
                raise KeyboardInterrupt  # as Ctrl-C would, inside the job

        with pytest.raises(KeyboardInterrupt):
            embed_dataset(reng, texts, out, shard_texts=30, on_shard=interrupt, show_progress=False)
        manifest = json.loads((out / MANIFEST).read_text())
        assert sorted(int(k) for k in manifest["shards"]) == sorted(done)  # the finished shards, and only those
        redo, kept = done
        shutil.copy(out / f"shard-{kept:05d}.parquet", out / f"shard-{redo:05d}.parquet")  # right size, other ids
        stamps = {kept: (out / f"shard-{kept:05d}.parquet").stat().st_mtime_ns}
        left = next(k for k in range(9) if k not in done)
        (out / f".shard-{left:05d}.parquet.999.tmp").write_bytes(b"half a shard")  # a crash mid-write
        (out / f"shard-{left:05d}.parquet").write_bytes(b"not listed in the manifest")  # renamed, not recorded

        again = []
        summary = embed_dataset(
            reng, texts, out, shard_texts=30, on_shard=lambda r: again.append(r["shard"]), show_progress=False
        )
        assert sorted(again) == sorted(set(range(9)) - {kept})  # the rest and the replaced one, each once
        assert list(summary.shard) == list(range(9)) and summary.rows.sum() == 253
        assert list(summary.shard[~summary.computed]) == [kept]
        assert {kept: (out / f"shard-{kept:05d}.parquet").stat().st_mtime_ns} == stamps  # not rewritten
        assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))
        check_rows(by_id(out), list(range(253)), reference)

        third = embed_dataset(reng, texts, out, shard_texts=30, on_shard=again.append, show_progress=False)
        assert len(again) == 9 - 1 and not third.computed.any()  # nothing left to do
        with pytest.raises(ValueError, match="shard_texts: 30 there, 40 now"):
            embed_dataset(reng, texts, out, shard_texts=40, show_progress=False)
        with pytest.raises(ValueError, match="rows .* differ"):
            embed_dataset(reng, texts[::-1], out, shard_texts=30, show_progress=False)

    @pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "parquet"])
    def test_embed_dataset_from_files(self, reng, texts, reference, tmp_path, kind):
        ids = [f"doc-{i}" for i in range(len(texts))] if kind != "parquet" else [10 * i for i in range(len(texts))]
        path = tmp_path / f"corpus.{kind}"
        if kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": texts, "id": ids, "extra": range(len(texts))}), path)
        else:
            lines = "".join(json.dumps({"id": i, "text": t, "lang": "en"}) + "\n" for i, t in zip(ids, texts))
            path.write_bytes(gzip.compress(lines.encode()) if kind.endswith("gz") else lines.encode())
        out = tmp_path / "out"
        summary = embed_dataset(reng, path, out, shard_texts=64, show_progress=False)
        assert list(summary.columns[:6]) == ["shard", "actor", "pid", "rows", "tokens", "seconds"]
        assert list(summary.rows) == [64, 64, 64, 61] and (summary.tokens > 0).all() and (summary.seconds > 0).all()
        assert sorted(p.name for p in out.iterdir()) == [MANIFEST] + [f"shard-0000{k}.parquet" for k in range(4)]
        check_rows(by_id(out), ids, reference)


# ------------------------------------------------------------------------------------- jobs with their own actors
def test_embed_dataset_from_a_ray_dataset(minilm_path, texts, reference, tmp_path):
    import ray.data

    ds = ray.data.from_items([{"id": f"s{i}", "text": t} for i, t in enumerate(texts)])
    summary = embed_dataset(minilm_path, ds, tmp_path, num_actors=1, shard_texts=100, show_progress=False)
    assert list(summary.rows) == [100, 100, 53]
    ids, _ = read_embeddings(tmp_path)
    assert ids == [f"s{i}" for i in range(253)]  # the dataset's order, shard by shard
    check_rows(by_id(tmp_path), ids, reference)


def test_a_hub_id_loads_one_pinned_commit_in_every_actor(minilm_path, texts, reference, tmp_path, monkeypatch):
    """``RayEngine(id)`` and ``embed_dataset(id, ...)``: the driver pins the branch to its commit, every actor loads
    that snapshot from the Hugging Face cache (``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` forwarded to the actors)."""
    from hub_cache import write_hub_cache
    from huggingface_hub import constants

    cache, commit = tmp_path / "hf-cache", "c" * 40
    write_hub_cache(cache, "sentence-transformers/all-MiniLM-L6-v2", Path(minilm_path), commit=commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with RayEngine("sentence-transformers/all-MiniLM-L6-v2", num_actors=1) as reng:
        assert (reng.model_name, reng.revision, reng.knobs["revision"]) == (
            "sentence-transformers/all-MiniLM-L6-v2",
            commit,
            commit,
        )
        assert cosine_rows(reng.embed(texts[:40]), reference[:40]).min() >= COS
    out = tmp_path / "out"
    embed_dataset(
        "sentence-transformers/all-MiniLM-L6-v2", texts[:40], out, num_actors=1, shard_texts=25, show_progress=False
    )
    job = json.loads((out / MANIFEST).read_text())["job"]
    assert job["model"] == "sentence-transformers/all-MiniLM-L6-v2" and job["knobs"]["revision"] == commit
    assert job["model_files"] == model_digest(minilm_path)  # the snapshot's files are the folder's
    ids, emb = read_embeddings(out)
    assert ids == list(range(40)) and cosine_rows(emb, reference[:40]).min() >= COS


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


BAD_SOURCES = {
    "missing text": (
        lambda d: write_jsonl(d / "a.jsonl", [{"id": 1, "text": "x"}, {"id": 2, "title": "y"}]),
        r"line 2 \(row 1\) has no 'text'",
    ),
    "null text": (lambda d: write_jsonl(d / "a.jsonl", [{"id": 1, "text": None}]), "row 0 .* has no text"),
    "non-string text": (lambda d: ["fine", 3.5], "row 1 .* float text"),
    "duplicate ids": (
        lambda d: write_parquet(d / "a.parquet", {"id": [4, 5, 4], "text": ["a", "b", "c"]}),
        "id 4 appears twice",
    ),
    "no text column": (lambda d: write_parquet(d / "a.parquet", {"id": [1], "body": ["a"]}), "no 'text' column"),
    "mixed id types": (
        lambda d: write_jsonl(d / "a.jsonl", [{"id": 1, "text": "a"}, {"id": "2", "text": "b"}]),
        "use one type",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SOURCES))
def test_bad_rows_fail_before_any_actor_starts(tmp_path, case):
    """The model path does not exist: had an actor started, its load error would be raised instead."""
    make, message = BAD_SOURCES[case]
    with pytest.raises(ValueError, match=message):
        embed_dataset(tmp_path / "no-such-model", make(tmp_path), tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_bad_knobs_fail_before_any_actor_starts(tmp_path):
    with pytest.raises(ValueError, match="unknown pooling 'bogus'"):
        embed_dataset(tmp_path / "no-such-model", ["a"], tmp_path / "out", knobs={"pooling": "bogus"})
    with pytest.raises(TypeError, match="unknown knob"):
        RayEngine(tmp_path / "no-such-model", pooling_mode="cls")


def test_model_that_fails_to_load_fails_fast_with_the_actors_error(minilm_path, tmp_path):
    """Weights that cannot be read: the constructor raises the actors' own error well before ``load_timeout``
    (a hang would end in a TimeoutError, which does not match)."""
    bad = tmp_path / "model"
    bad.mkdir()
    for f in Path(minilm_path).iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).symlink_to(f)
    (bad / "model.safetensors").write_bytes(b"this is not a safetensors file" * 4)
    with pytest.raises(RuntimeError, match="could not start an Engine .* deserializing header"):
        RayEngine(bad, num_actors=2, load_timeout=240)
    with pytest.raises(RuntimeError, match="deserializing header"):
        embed_dataset(bad, ["a", "b"], tmp_path / "out", num_actors=1, show_progress=False)
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["shards"] == {}
    (bad / "model.safetensors").write_bytes(b"other weights at the same path" * 4)
    with pytest.raises(ValueError, match=r"holds another job \(the model's files differ"):  # before any actor
        embed_dataset(bad, ["a", "b"], tmp_path / "out", num_actors=1, show_progress=False)


def test_split_by_tokens_balances_contiguous_ranges():
    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths = rng.integers(1, rng.integers(2, 600), size=rng.integers(0, 60))
        parts = int(rng.integers(1, 6))
        ranges = split_by_tokens(lengths, parts)
        assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == len(lengths)
        assert all(a <= b == c for (a, b), (c, _) in itertools.pairwise(ranges))  # contiguous, in order
        if len(lengths):
            sums = np.array([lengths[a:b].sum() for a, b in ranges])
            assert (abs(sums - lengths.sum() / parts) <= lengths.max()).all(), (lengths, parts, ranges)
    assert split_by_tokens([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 11)]


def test_lab_does_not_need_ray(tmp_path):
    """``import lab`` (and the engine, and the package ``lab.distributed``, whose names load on first use) never
    import Ray; without Ray, asking for ``RayEngine`` says how to install it."""
    code = (
        "import sys; sys.modules['ray'] = None\n"  # as if Ray were not installed
        "import lab, lab.engine, lab.distributed, lab.distributed.shards\n"
        "try:\n    from lab.distributed import RayEngine\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert 'pip install -e ".[ray]"' in out.stdout
