"""Local MTEB tasks over evals/data: official metadata, row counts, limits, fallbacks, missing-data errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lab._repo import import_evals

ROOT = Path(__file__).resolve().parents[1]
import_evals()  # the repository's evals/ package, without the repo root on sys.path

mteb = pytest.importorskip("mteb")
from evals import tasks as T

DATA = ROOT / "evals" / "data"
FOLDERS = ("stsbenchmark", "scifact", "banking77", "twentynewsgroups", "twitterurlcorpus", "sickr")
SAME_AS_MTEB = ("STSBenchmark", "SICK-R", "SciFact", "Banking77Classification")


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_data_folder_states_licence_and_source(folder):
    readme = (DATA / folder / "README.md").read_text(encoding="utf-8")
    assert "**License:**" in readme or "**Licence:" in readme
    assert "**Source:**" in readme


def test_data_stays_lean():
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total < 25 * 2**20, f"evals/data is {total / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", SAME_AS_MTEB)
def test_official_metadata_where_the_data_is_mtebs(name):
    task = T.get_task(name)
    assert isinstance(task, type(mteb.get_task(name)))  # subclass of mteb's own task class
    assert task.metadata == mteb.get_task(name).metadata


@pytest.mark.parametrize("name", ["TwitterURLCorpus", "TwentyNewsgroupsClustering"])
def test_different_data_gets_a_local_revision(name):
    task, official = T.get_task(name), mteb.get_task(name).metadata
    assert task.metadata.name == official.name and task.metadata.main_score == official.main_score
    assert task.metadata.revision.startswith("local-") and task.metadata.revision != official.revision


def _sizes(task) -> dict:
    task.load_data()
    d = task.dataset
    if "default" in d:  # retrieval layout
        s = d["default"]["test"]
        return {
            "queries": len(s["queries"]),
            "corpus": len(s["corpus"]),
            "qrels": sum(len(v) for v in s["relevant_docs"].values()),
        }
    return {split: len(ds) for split, ds in d.items()}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("STSBenchmark", {"test": 1379}),
        ("SICK-R", {"test": 9927}),
        ("SciFact", {"queries": 300, "corpus": 5183, "qrels": 339}),
        ("Banking77Classification", {"train": 10003, "test": 3080}),
        ("TwentyNewsgroupsClustering", {"test": 1}),  # one cluster set of 7,532 subjects
        ("TwitterURLCorpus", {"test": 9334}),
        ("TwitterURLCorpusReranking", {"queries": 567, "corpus": 6054, "qrels": 6054}),
    ],
)
def test_local_tasks_load_the_expected_rows(name, expected):
    assert _sizes(T.get_task(name)) == expected


def test_clustering_set_holds_every_test_subject_with_20_labels():
    task = T.get_task("TwentyNewsgroupsClustering")
    task.load_data()
    row = task.dataset["test"][0]
    assert len(row["sentences"]) == len(row["labels"]) == 7532 and len(set(row["labels"])) == 20


def test_sts_rows_keep_text_and_gold_score():
    task = T.get_task("STSBenchmark")
    task.load_data()
    first = task.dataset["test"][0]
    assert first == {
        "sentence1": "A girl is styling her hair.",
        "sentence2": "A girl is brushing her hair.",
        "score": 2.5,
    }


def test_limit_renames_the_task_and_keeps_evenly_spaced_rows():
    (sts,) = T.get_tasks(["STSBenchmark"], limit=100)
    assert sts.metadata.name == "STSBenchmark.n100" and sts.metadata.revision.endswith("-n100")
    assert _sizes(sts) == {"test": 100}
    scifact = T.get_task("SciFact", limit=10)
    sizes = _sizes(scifact)
    assert sizes["queries"] == 10 and sizes["corpus"] == 100
    split = scifact.dataset["default"]["test"]
    corpus_ids = set(split["corpus"]["id"])
    assert all(doc in corpus_ids for rel in split["relevant_docs"].values() for doc in rel)


def test_names_without_local_data_fall_back_to_mteb():
    local, remote = T.get_tasks(["STSBenchmark", "STS13"])
    assert isinstance(local, T.LocalTask)
    assert not isinstance(remote, T.LocalTask) and remote.metadata.name == "STS13"


def test_missing_data_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"scifact[/\\]corpus\.jsonl\.gz"):
        T.get_tasks(["SciFact"], data_dir=tmp_path)
    # partial copy: the first missing file is the one named
    shutil.copytree(DATA / "sickr", tmp_path / "sickr")
    (tmp_path / "sickr" / "trial.jsonl.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"trial\.jsonl\.gz"):
        T.get_task("SICK-R", data_dir=tmp_path)


def test_missing_data_is_also_caught_at_load_time(tmp_path, monkeypatch):
    task = T.SciFact(data_dir=tmp_path)  # constructing does not touch the files
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        task.load_data()
    monkeypatch.setenv("LAB_EVAL_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="LAB_EVAL_DATA"):
        T.get_task("STSBenchmark")
