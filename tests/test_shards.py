"""lab.distributed.shards without Ray: the job key (model content, rows), shards checked on resume and when read,
and the manifest entries refused.

A job is simulated: shards written with ``write_shard`` and recorded, as ``embed_dataset`` does after each actor's
result; nothing here needs a model (``model_digest`` hashes files, it does not load them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from lab.distributed.shards import (
    MANIFEST,
    Manifest,
    job_record,
    model_digest,
    read_embeddings,
    read_source,
    shard_name,
    write_shard,
)

ROWS, SHARD = 10, 4  # shards of 4, 4 and 2 rows


def fake_model(root: Path) -> Path:
    """A folder with the files a loader reads (bytes only: nothing here parses them) and some it does not."""
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "bert"}')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (root / "tokenizer.json").write_text('{"vocab": ["a", "b"]}')
    (root / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "x.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "x.Pooling"},
            ]
        )
    )
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (root / "README.md").write_text("a model card")
    return root


def fake_adapter(root: Path, scale: int = 1) -> Path:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2}')
    (root / "adapter_model.safetensors").write_bytes(bytes([scale]) * 512)
    return root


def test_model_digest_follows_the_content_not_the_path(tmp_path):
    model = fake_model(tmp_path / "m")
    base = model_digest(model)
    assert model_digest(shutil.copytree(model, tmp_path / "elsewhere")) == base  # a copy is the same model
    (model / "README.md").write_text("another card")
    assert model_digest(model) == base  # docs are not computed with
    for name in ("model.safetensors", "tokenizer.json", "config.json", "1_Pooling/config.json"):
        f = model / name
        keep = f.read_bytes()
        f.write_bytes(keep[:-1] + bytes([keep[-1] ^ 1]))  # same path, same size, one bit changed
        assert model_digest(model) != base, name
        f.write_bytes(keep)
        assert model_digest(model) == base
    a1, a2 = fake_adapter(tmp_path / "a1", 1), fake_adapter(tmp_path / "a2", 2)
    with_a1 = model_digest(model, [str(a1)])
    assert with_a1 != base and model_digest(model, [str(a1), str(a2)]) != model_digest(model, [str(a2), str(a1)])
    (a1 / "adapter_model.safetensors").write_bytes(bytes([9]) * 512)  # retrained at the same path
    assert model_digest(model, [str(a1)]) != with_a1
    with pytest.raises(FileNotFoundError, match="adapter 0 .* does not exist"):
        model_digest(model, [str(tmp_path / "gone")])


def make_job(out: Path, digest: str = "d" * 64, texts=None) -> tuple[Manifest, object, np.ndarray]:
    """A finished job of ``ROWS`` rows in shards of ``SHARD``: embeddings ``E`` (row i holds i, i + 0.5, ...)."""
    src = read_source(texts or [f"text {i}" for i in range(ROWS)])
    out.mkdir(parents=True, exist_ok=True)
    man = Manifest.open(out, job_record(src, shard_texts=SHARD, model="m", digest=digest, knobs={}))
    man.save()
    emb = (np.arange(len(src))[:, None] + np.arange(3)[None, :] / 2).astype(np.float32)
    for k in range(-(-len(src) // SHARD)):
        a, b = k * SHARD, min((k + 1) * SHARD, len(src))
        man.record(k, write_shard(out, k, src.ids[a:b], emb[a:b]))
    return man, src, emb


def reopen(out: Path, src, digest: str = "d" * 64) -> Manifest:
    return Manifest.open(out, job_record(src, shard_texts=SHARD, model="m", digest=digest, knobs={}))


def shard_ids(src, k: int) -> list:
    return src.ids[k * SHARD : (k + 1) * SHARD]


def test_a_finished_job_reads_back_and_resumes_with_nothing_to_do(tmp_path):
    _, src, emb = make_job(tmp_path)
    ids, got = read_embeddings(tmp_path)
    assert ids == list(range(ROWS)) and np.array_equal(got, emb)
    man = reopen(tmp_path, src)
    assert all(man.finished(k, shard_ids(src, k)) for k in range(3))
    assert not man.finished(1, shard_ids(src, 2))  # the rows of another shard are not these


def test_new_weights_at_the_same_path_are_another_job(tmp_path):
    _, src, _ = make_job(tmp_path, digest="a" * 64)
    with pytest.raises(ValueError, match=r"holds another job \(the model's files differ"):
        reopen(tmp_path, src, digest="b" * 64)


def flip_float(path: Path, value: float) -> None:
    """Change one float of a data page in place (the file still parses; only its checksum tells)."""
    data = bytearray(path.read_bytes())
    at = data.find(np.float32(value).tobytes())
    assert at >= 0
    data[at + 3] ^= 0x01
    path.write_bytes(bytes(data))


def copy_other_jobs_shard(out: Path) -> None:
    """Shard 1 replaced by a file of another job: the right row count, other ids."""
    other = out.parent / "other"
    other.mkdir()
    write_shard(other, 1, [100, 101, 102, 103], np.zeros((SHARD, 3), np.float32))
    shutil.copy(other / shard_name(1), out / shard_name(1))


def point_at_another_shard(out: Path) -> None:
    data = json.loads((out / MANIFEST).read_text())
    data["shards"]["1"] = {**data["shards"]["0"]}  # shard 1's entry names shard 0's file (and its checksum)
    (out / MANIFEST).write_text(json.dumps(data))


@pytest.mark.parametrize("damage", ["flipped float", "another job's file", "entry points at another shard"])
def test_a_damaged_shard_is_recomputed_on_resume_and_named_when_read(tmp_path, damage):
    _, src, _ = make_job(tmp_path)
    if damage == "flipped float":
        flip_float(tmp_path / shard_name(1), 5.5)  # row 5, column 1
    elif damage == "another job's file":
        copy_other_jobs_shard(tmp_path)
    else:
        point_at_another_shard(tmp_path)
    with pytest.raises(ValueError, match=r"shard-00001\.parquet|shard 1"):
        read_embeddings(tmp_path)
    man = reopen(tmp_path, src)
    assert [man.finished(k, shard_ids(src, k)) for k in range(3)] == [True, False, True]
    man.record(1, write_shard(tmp_path, 1, shard_ids(src, 1), np.ones((SHARD, 3), np.float32)))  # the resume
    assert reopen(tmp_path, src).finished(1, shard_ids(src, 1))
    assert read_embeddings(tmp_path)[0] == list(range(ROWS))


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d["shards"]["1"].update(file="../elsewhere.parquet"), "not a file name inside"),
        (lambda d: d["shards"]["1"].update(file="/tmp/shard-00001.parquet"), "not a file name inside"),
        (lambda d: d["shards"].update({"3": d["shards"]["2"]}), r"lists shard\(s\) \[3\], but its job has 3 shard"),
        (lambda d: d["shards"].update({"-1": d["shards"]["0"]}), r"lists shard\(s\) \[-1\]"),
        (lambda d: d["shards"]["0"].pop("sha256"), "not a manifest this version reads .*sha256"),
    ],
)
def test_manifest_entries_out_of_place_are_refused(tmp_path, edit, words):
    _, src, _ = make_job(tmp_path)
    data = json.loads((tmp_path / MANIFEST).read_text())
    edit(data)
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=words):
        reopen(tmp_path, src)
    with pytest.raises(ValueError, match=words):
        read_embeddings(tmp_path)


def test_the_source_fingerprint_is_unambiguous():
    """With NUL-separated fields, a text holding NUL could end its row and start the next one's."""
    a = read_source(["a\x001\x00b", "c"])
    b = read_source(["a", "b\x001\x00c"])
    assert a.ids == b.ids and a.fingerprint() != b.fingerprint()


def test_ids_parquet_cannot_store_are_refused_up_front(tmp_path):
    for bad, row in ((2**63, 1), (-(2**63) - 1, 1)):
        path = tmp_path / "src.jsonl"
        path.write_text(json.dumps({"id": 1, "text": "a"}) + "\n" + json.dumps({"id": bad, "text": "b"}) + "\n")
        with pytest.raises(ValueError, match=rf"row {row} has the id {bad}, outside the 64-bit range"):
            read_source(path)
    path.write_text(json.dumps({"id": 2**63 - 1, "text": "a"}) + "\n" + json.dumps({"id": -(2**63), "text": "b"}))
    src = read_source(path)
    (tmp_path / "out").mkdir()
    man = Manifest.open(tmp_path / "out", job_record(src, shard_texts=2, model="m", digest="d", knobs={}))
    man.record(0, write_shard(tmp_path / "out", 0, src.ids, np.zeros((2, 3), np.float32)))
    assert read_embeddings(tmp_path / "out")[0] == [2**63 - 1, -(2**63)]


def test_a_file_source_is_read_in_batches_and_cut_into_the_shards_a_list_gives(tmp_path, monkeypatch):
    """Batches of 4 rows (``BATCH_ROWS``) over 23 rows in shards of 5: the same shards, ids and fingerprint from a
    ``.jsonl``, a ``.jsonl.gz`` and a ``.parquet``; the rows are read again for each pass, never kept."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from lab.distributed import shards

    monkeypatch.setattr(shards, "BATCH_ROWS", 4)
    rows = [{"id": f"d{i}", "text": f"text number {i}"} for i in range(23)]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "c.jsonl").write_text(lines)
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(lines)
    pq.write_table(
        pa.table({"id": [r["id"] for r in rows], "text": [r["text"] for r in rows]}), tmp_path / "c.parquet"
    )
    want = [
        (k, [r["id"] for r in rows[5 * k : 5 * k + 5]], [r["text"] for r in rows[5 * k : 5 * k + 5]]) for k in range(5)
    ]
    sources = [read_source(tmp_path / name) for name in ("c.jsonl", "c.jsonl.gz", "c.parquet")]
    for src in sources:
        assert len(src) == 23 and list(src.shards(5)) == want
        assert [k for k, _, _ in src.shards(23)] == [0] and src.ids == [r["id"] for r in rows]
        assert all(len(ids) <= 4 for ids, _ in src.batches())
    assert len({src.fingerprint() for src in sources}) == 1
    listed = read_source([r["text"] for r in rows])
    assert [t for _, _, texts in listed.shards(5) for t in texts] == [r["text"] for r in rows]


def test_a_duplicate_id_across_batches_is_named_with_both_rows(tmp_path, monkeypatch):
    from lab.distributed import shards

    monkeypatch.setattr(shards, "BATCH_ROWS", 4)
    rows = [{"id": i, "text": "t"} for i in range(10)] + [{"id": 3, "text": "again"}, {"id": 7, "text": "again"}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"id 3 appears twice \(rows 3 and 10\)"):
        read_source(tmp_path / "c.jsonl")
