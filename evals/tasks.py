"""MTEB tasks over the local copies in ``evals/data/``, so evaluations run offline.

Each class subclasses mteb's own task class (so name, splits, main score, prompts and evaluator are the official
ones) and only replaces ``load_data``: rows come from ``evals/data/<folder>/`` (or ``$LAB_EVAL_DATA/<folder>``)
instead of the Hugging Face hub. Where the local copy differs from MTEB's (TwitterURLCorpus: test part only;
TwentyNewsgroupsClustering: different sampling) the task records a ``local-<hash>`` dataset revision, so mteb's
result cache never mixes its scores with hub-data scores. ``TwitterURLCorpusReranking`` is a custom task (the
reranking view of TwitterURLCorpus), not an official MTEB one.

    >>> from evals.tasks import get_tasks
    >>> tasks = get_tasks(["STSBenchmark", "SciFact"])   # local tasks; other names fall back to mteb.get_tasks
    >>> tiny = get_tasks(["STSBenchmark"], limit=100)    # 100 evenly spaced pairs, task named "STSBenchmark.n100"
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Iterable
from pathlib import Path

import mteb
from datasets import Dataset, DatasetDict
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.task_metadata import TaskMetadata

from evals.data_io import read_jsonl, spread
from lab import env

DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data"


def data_root() -> Path:
    """Root of the local data: ``$LAB_EVAL_DATA`` if set, else ``evals/data`` next to this file."""
    return env.path("LAB_EVAL_DATA", DEFAULT_DATA_DIR)


def _official(name: str) -> type:
    return type(mteb.get_task(name))


class LocalTask:
    """Mixin: data from local files. ``files`` are paths relative to ``<data_dir>/<folder>``.

    Args:
        data_dir: root folder holding ``<folder>/`` (default: :func:`data_root`).
        limit: keep only this many evaluation items (pairs, queries, test texts), evenly spaced; the task is then
            named ``<name>.n<limit>`` so its results never overwrite the full task's in a result cache.
    """

    folder: str
    files: tuple[str, ...]
    local_revision: bool = False  # True where the local copy is not MTEB's data: record a content hash instead

    def __init__(self, *, data_dir: str | Path | None = None, limit: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.data_root = Path(data_dir) if data_dir is not None else data_root()
        self.limit = limit
        updates = {}
        dataset = dict(self.metadata.dataset)
        if self.local_revision:
            dataset = {"path": f"local:evals/data/{self.folder}", "revision": "local-" + self._content_hash()}
        if limit is not None:
            if limit < 1:
                raise ValueError(f"limit must be a positive int, got {limit!r}")
            updates["name"] = f"{self.metadata.name}.n{limit}"
            dataset["revision"] = f"{dataset['revision']}-n{limit}"
        if dataset != self.metadata.dataset:
            updates["dataset"] = dataset
        if updates:
            self.metadata = self.metadata.model_copy(update=updates)

    def path(self, name: str) -> Path:
        """The data file ``name`` (its gzip-less twin is accepted too); FileNotFoundError names what was looked for."""
        p = self.data_root / self.folder / name
        if p.exists():
            return p
        if p.suffix == ".gz" and p.with_suffix("").exists():
            return p.with_suffix("")
        raise FileNotFoundError(
            f"{self.metadata.name}: data file not found: {p}. Local task data lives in {self.data_root} "
            f"(set LAB_EVAL_DATA or pass data_dir= to point elsewhere); see evals/data/README.md."
        )

    def check_data(self) -> None:
        for name in self.files:
            self.path(name)

    def _content_hash(self) -> str:
        h = hashlib.sha256()
        for name in self.files:
            try:
                h.update(self.path(name).read_bytes())
            except FileNotFoundError:
                h.update(b"missing:" + name.encode())
        return h.hexdigest()[:12]

    def load_data(self, num_proc: int | None = None, **kwargs) -> None:
        if self.data_loaded:
            return
        self.check_data()
        self.dataset = self._load_local()
        self.data_loaded = True

    def unload_data(self) -> None:
        # mteb drops instance-level metadata on unload (it assumes a filtered copy of the hub data); ours
        # describes what load_data will read again, so it stays
        metadata = self.__dict__.get("metadata")
        super().unload_data()
        if metadata is not None:
            self.metadata = metadata

    def _load_local(self):
        raise NotImplementedError


def _sts_rows(rows: list[dict], limit: int | None) -> Dataset:
    rows = [rows[i] for i in spread(len(rows), limit)]
    return Dataset.from_dict(
        {
            "sentence1": [r["sentence1"] for r in rows],
            "sentence2": [r["sentence2"] for r in rows],
            "score": [float(r["score"]) for r in rows],
        }
    )


class STSBenchmark(LocalTask, _official("STSBenchmark")):
    folder = "stsbenchmark"
    files = ("test.jsonl.gz",)

    def _load_local(self) -> DatasetDict:
        splits = {"test": _sts_rows(read_jsonl(self.path("test.jsonl.gz")), self.limit)}
        # the dev split is optional: only loaded when a caller asks for it via eval_splits
        if "validation" in self.eval_splits:
            splits["validation"] = _sts_rows(read_jsonl(self.path("validation.jsonl.gz")), self.limit)
        return DatasetDict(splits)


class SICKR(LocalTask, _official("SICK-R")):
    """MTEB's SICK-R ``test`` split is all 9,927 pairs: train + trial + test concatenated."""

    folder = "sickr"
    files = ("train.jsonl.gz", "trial.jsonl.gz", "test.jsonl.gz")

    def _load_local(self) -> DatasetDict:
        rows = [r for name in self.files for r in read_jsonl(self.path(name))]
        return DatasetDict({"test": _sts_rows(rows, self.limit)})


class _SemEvalSTS(LocalTask):
    """A SemEval STS year's English test pairs with the organizers' untokenized text (MTEB's copy is a tokenized
    variant of the same pairs and scores, so scores here are close to, not exactly, the leaderboard's)."""

    files = ("test.jsonl.gz",)
    local_revision = True

    def _load_local(self) -> DatasetDict:
        return DatasetDict({"test": _sts_rows(read_jsonl(self.path("test.jsonl.gz")), self.limit)})


class STS12(_SemEvalSTS, _official("STS12")):
    folder = "sts12"


class STS14(_SemEvalSTS, _official("STS14")):
    folder = "sts14"


class STS16(_SemEvalSTS, _official("STS16")):
    folder = "sts16"


class SciFact(LocalTask, _official("SciFact")):
    """BEIR layout. With ``limit``: that many queries, and a corpus of their relevant documents plus evenly spaced
    others, ``10 * limit`` documents in all (a smoke test, not a comparable score)."""

    folder = "scifact"
    files = ("corpus.jsonl.gz", "queries.test.jsonl", "qrels/test.tsv")

    def _load_local(self) -> dict:
        qrels: dict[str, dict[str, int]] = {}
        with self.path("qrels/test.tsv").open(encoding="utf-8") as f:
            for row in csv.DictReader(f, delimiter="\t"):
                qrels.setdefault(row["query-id"], {})[row["corpus-id"]] = int(row["score"])
        queries = [q for q in read_jsonl(self.path("queries.test.jsonl")) if q["_id"] in qrels]
        corpus = read_jsonl(self.path("corpus.jsonl.gz"))
        if self.limit is not None:
            queries = [queries[i] for i in spread(len(queries), self.limit)]
            qrels = {q["_id"]: qrels[q["_id"]] for q in queries}
            keep = {d for rel in qrels.values() for d in rel}
            others = [d for d in corpus if d["_id"] not in keep]
            keep |= {others[i]["_id"] for i in spread(len(others), max(10 * self.limit - len(keep), 0))}
            corpus = [d for d in corpus if d["_id"] in keep]
        split = {
            "corpus": Dataset.from_dict(
                {
                    "id": [d["_id"] for d in corpus],
                    "title": [d.get("title") or "" for d in corpus],
                    "text": [d["text"] for d in corpus],
                }
            ),
            "queries": Dataset.from_dict({"id": [q["_id"] for q in queries], "text": [q["text"] for q in queries]}),
            "relevant_docs": qrels,
            "top_ranked": None,
        }
        return {"default": {"test": split}}


class Banking77Classification(LocalTask, _official("Banking77Classification")):
    folder = "banking77"
    files = ("train.jsonl.gz", "test.jsonl.gz")

    def _load_local(self) -> DatasetDict:
        out = {}
        for split in ("train", "test"):
            rows = read_jsonl(self.path(f"{split}.jsonl.gz"))
            if split == "test":
                rows = [rows[i] for i in spread(len(rows), self.limit)]
            out[split] = Dataset.from_dict({"text": [r["text"] for r in rows], "label": [r["label"] for r in rows]})
        return DatasetDict(out)


class TwentyNewsgroupsClustering(LocalTask, _official("TwentyNewsgroupsClustering")):
    """One cluster set: the subjects of all 7,532 test posts (MTEB's copy is 10 random sets of ~6k subjects from
    the whole corpus, which cannot be rebuilt offline). k = 20 newsgroups, V-measure."""

    folder = "twentynewsgroups"
    files = ("test.subjects.jsonl.gz",)
    local_revision = True

    def _load_local(self) -> DatasetDict:
        rows = read_jsonl(self.path("test.subjects.jsonl.gz"))
        rows = [rows[i] for i in spread(len(rows), self.limit)]
        one_set = {"sentences": [[r["text"] for r in rows]], "labels": [[int(r["label"]) for r in rows]]}
        return DatasetDict({"test": Dataset.from_dict(one_set)})


class TwitterURLCorpus(LocalTask, _official("TwitterURLCorpus")):
    """The authors' test split only (MTEB's ``test`` is their train + test)."""

    folder = "twitterurlcorpus"
    files = ("test.jsonl.gz",)
    local_revision = True

    def _load_local(self) -> DatasetDict:
        rows = read_jsonl(self.path("test.jsonl.gz"))
        rows = [rows[i] for i in spread(len(rows), self.limit)]
        return DatasetDict(
            {
                "test": Dataset.from_dict(
                    {
                        "sentence1": [r["sentence1"] for r in rows],
                        "sentence2": [r["sentence2"] for r in rows],
                        "labels": [int(r["label"]) for r in rows],
                    }
                )
            }
        )


class TwitterURLCorpusReranking(LocalTask, AbsTaskRetrieval):
    """Custom (not an official MTEB task): rerank each headline's candidate tweets, paraphrases first."""

    folder = "twitterurlcorpus"
    files = ("test.reranking.jsonl.gz",)
    metadata = TaskMetadata(
        name="TwitterURLCorpusReranking",
        description=(
            "Reranking view of the Twitter URL Corpus test split: for each news headline, rank the tweets linking "
            "to the same URL so that those judged paraphrases come first. Local custom task, not part of MTEB."
        ),
        reference="https://github.com/lanwuwei/Twitter-URL-Corpus",
        dataset={"path": "local:evals/data/twitterurlcorpus", "revision": "local-reranking-v1"},
        type="Reranking",
        category="t2t",
        modalities=["text"],
        eval_splits=["test"],
        eval_langs=["eng-Latn"],
        main_score="map_at_1000",
        date=("2017-01-01", "2017-12-31"),
        domains=["Social", "Written"],
        task_subtypes=[],
        license="cc-by-nc-sa-3.0",
        annotations_creators="human-annotated",
        dialect=[],
        sample_creation="found",
        bibtex_citation=r"""
@inproceedings{lan-etal-2017-continuously,
  author = {Lan, Wuwei and Qiu, Siyu and He, Hua and Xu, Wei},
  booktitle = {Proceedings of the 2017 Conference on Empirical Methods in Natural Language Processing},
  pages = {1224--1234},
  title = {A Continuously Growing Dataset of Sentential Paraphrases},
  year = {2017},
}
""",
        prompt={"query": "Retrieve tweets that paraphrase the given news headline"},
    )

    def _load_local(self) -> dict:
        rows = read_jsonl(self.path("test.reranking.jsonl.gz"))
        rows = [rows[i] for i in spread(len(rows), self.limit)]
        doc_ids, doc_texts, qrels, top_ranked = [], [], {}, {}
        for qi, r in enumerate(rows):
            qid = f"q{qi}"
            candidates = [(t, 1) for t in r["positive"]] + [(t, 0) for t in r["negative"]]
            qrels[qid], top_ranked[qid] = {}, []
            for di, (text, label) in enumerate(candidates):
                did = f"{qid}-d{di}"
                doc_ids.append(did)
                doc_texts.append(text)
                qrels[qid][did] = label
                top_ranked[qid].append(did)
        split = {
            "corpus": Dataset.from_dict({"id": doc_ids, "title": [""] * len(doc_ids), "text": doc_texts}),
            "queries": Dataset.from_dict({"id": list(qrels), "text": [r["query"] for r in rows]}),
            "relevant_docs": qrels,
            "top_ranked": top_ranked,
        }
        return {"default": {"test": split}}


LOCAL_TASKS: dict[str, type[LocalTask]] = {
    cls.metadata.name: cls
    for cls in (
        STSBenchmark,
        SICKR,
        STS12,
        STS14,
        STS16,
        SciFact,
        Banking77Classification,
        TwentyNewsgroupsClustering,
        TwitterURLCorpus,
        TwitterURLCorpusReranking,
    )
}


def get_task(name: str, **kwargs):
    """One task: the local one for a name in :data:`LOCAL_TASKS`, else ``mteb.get_task(name)``."""
    return get_tasks([name], **kwargs)[0]


def get_tasks(names: str | Iterable[str], *, data_dir: str | Path | None = None, limit: int | None = None) -> list:
    """Tasks for ``names``, in order: local tasks where we have the data, ``mteb.get_tasks`` for the others.

    Local tasks check their files up front, so a missing file raises ``FileNotFoundError`` naming it here rather
    than mid-evaluation. ``data_dir`` and ``limit`` apply to local tasks only (see :class:`LocalTask`).
    """
    names = [names] if isinstance(names, str) else list(names)
    remote = [n for n in names if n not in LOCAL_TASKS]
    by_name = {t.metadata.name: t for t in mteb.get_tasks(tasks=remote)} if remote else {}
    out = []
    for name in names:
        if name in LOCAL_TASKS:
            task = LOCAL_TASKS[name](data_dir=data_dir, limit=limit)
            task.check_data()
            out.append(task)
        else:
            out.append(by_name[name])
    return out
