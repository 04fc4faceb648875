"""``instruction`` / ``include_instruction`` against sentence-transformers' ``encode(prompt=...)`` (the reference).

sentence-transformers prepends the prompt to every text and pools its tokens unless the model's Pooling config says
``include_prompt: false``; then its Pooling module zeroes the first ``prompt_length`` positions of the pooling mask
(``prompt_length``: the prompt tokenized alone, with the tokenizer's specials, less a trailing special token). The
engine reads the same config (``engine.resolved.include_instruction``) and keeps the ``include_instruction`` knob to
override it. Checked on all-MiniLM-L6-v2 (no ``include_prompt`` in its Pooling config: pooled), on a copy of it whose
Pooling config says ``include_prompt: false`` (same weights), and on a copy with no sentence-transformers files at
all.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import cosine_rows, link_copy

pytest.importorskip("sentence_transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*longer than max_length.*:UserWarning")

PROMPTS = [
    "query: ",
    "Represent this sentence for searching relevant passages: ",
    "Instruct: Given a question, retrieve passages that answer it\nQuery:",  # no trailing space, a newline
    "  ",  # tokenizes to nothing: only the [CLS] is the "prompt"
]
TEXTS = [
    "A man is playing a guitar.",
    "",
    "guitar",
    "Stocks fell sharply on Monday after the central bank raised interest rates by half a point.",
    "Café crème, naïve façade — 東京タワー и Москва.",
    "The quick brown fox jumps over the lazy dog. " * 8,  # past MAX_LENGTH with the prompt in front
    "?!",
]
COS = 0.99999
MAX_LENGTH = 64  # both sides (the model's 256 would only make the test slower): truncation with a prompt in front


def _texts() -> list[str]:
    """``TEXTS`` shuffled (a fixed order, so sentence-transformers' results can be reused across tests)."""
    texts = list(TEXTS)
    random.Random(7).shuffle(texts)
    assert texts != TEXTS
    return texts


def _pooling_dir(folder: Path) -> str:
    modules = json.loads((folder / "modules.json").read_text())
    return next(m["path"] for m in modules if m["type"].endswith("Pooling"))


@pytest.fixture(scope="module")
def folders(minilm_path, tmp_path_factory) -> dict[str, str]:
    src = Path(minilm_path)
    pool_dir = _pooling_dir(src)
    pool_cfg = json.loads((src / pool_dir / "config.json").read_text())
    assert "include_prompt" not in pool_cfg  # the original leaves it to sentence-transformers' default (True)
    root = tmp_path_factory.mktemp("prompt_models")

    excluded = link_copy(src, root / "exclude_prompt", skip={pool_dir})
    (excluded / pool_dir).mkdir()
    for entry in (src / pool_dir).iterdir():
        if entry.name != "config.json":
            shutil.copy(entry, excluded / pool_dir / entry.name)
    (excluded / pool_dir / "config.json").write_text(json.dumps({**pool_cfg, "include_prompt": False}, indent=2))

    # no modules.json / Pooling config: a plain transformers folder (both sides fall back to mean pooling)
    bare = link_copy(
        src,
        root / "bare",
        skip={pool_dir, "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"},
    )
    return {"original": str(src), "exclude_prompt": str(excluded), "bare": str(bare)}


@pytest.fixture(scope="module")
def engines(folders):
    from lab import Engine

    return {name: Engine(path, dtype="float32", device="cpu", max_length=MAX_LENGTH) for name, path in folders.items()}


@pytest.fixture(scope="module")
def st_models(folders):
    from sentence_transformers import SentenceTransformer

    models = {name: SentenceTransformer(path, device="cpu") for name, path in folders.items()}
    for m in models.values():
        m.max_seq_length = MAX_LENGTH
    return models


_ST_CACHE: dict = {}


def _st(model, texts, prompt) -> np.ndarray:
    key = (id(model), model[1].include_prompt, tuple(texts), prompt)
    if key not in _ST_CACHE:
        _ST_CACHE[key] = model.encode(texts, prompt=prompt, batch_size=4, convert_to_numpy=True)
    out = _ST_CACHE[key]
    assert out.dtype == np.float32
    return out


def _engine(engine, texts, prompt, include=None) -> np.ndarray:
    engine.configure(instruction=prompt, include_instruction=include)
    try:
        out = engine.embed(texts)
    finally:
        engine.configure(instruction=None, include_instruction=None)
    assert out.dtype == np.float32
    return out


def _assert_close(ours, ref, what: str):
    assert ours.shape == ref.shape, what
    cos = cosine_rows(ours, ref)
    assert cos.min() >= COS, f"{what}: per-row cosine {np.round(cos, 6).tolist()}"
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-4, err_msg=what)


def test_configs_as_sentence_transformers_reads_them(engines, st_models):
    assert st_models["original"][1].include_prompt is True
    assert st_models["exclude_prompt"][1].include_prompt is False
    assert engines["original"].resolved.include_instruction is True
    assert engines["exclude_prompt"].resolved.include_instruction is False
    assert engines["original"].spec.include_prompt is True
    assert engines["exclude_prompt"].spec.include_prompt is False
    # the knob wins over the config, both ways; None gives the config back
    e = engines["original"]
    assert e.configure(include_instruction=False).resolved.include_instruction is False
    assert e.configure(include_instruction=None).resolved.include_instruction is True
    e = engines["exclude_prompt"]
    assert e.configure(include_instruction=True).resolved.include_instruction is True
    assert e.configure(include_instruction=None).resolved.include_instruction is False


@pytest.mark.parametrize("prompt", PROMPTS)
def test_pool_start_is_sentence_transformers_prompt_length(engines, st_models, prompt):
    """Same token ids as sentence-transformers, and ``pool_start`` = its ``prompt_length`` on every row."""
    texts = _texts()
    st = st_models["exclude_prompt"]
    feats = st.preprocess(texts, prompt=prompt)
    st_len = int(feats["prompt_length"])
    ids, mask = feats["input_ids"].numpy(), feats["attention_mask"].numpy().astype(bool)
    e = engines["exclude_prompt"]
    e.configure(instruction=prompt)
    try:
        reqs = e.tokenize(texts)
    finally:
        e.configure(instruction=None)
    assert len(reqs) == len(texts)
    for i, r in enumerate(reqs):
        assert r.ids.tolist() == ids[i][mask[i]].tolist(), texts[i][:40]
        assert r.pool_start == st_len, (texts[i][:40], r.pool_start, st_len)
    assert reqs[texts.index("")].length == st_len + 1  # prompt + "": only the [SEP] is pooled
    assert reqs[texts.index(TEXTS[5])].truncated  # the long text is cut after the prompt is put in front
    # the original (prompt pooled) starts pooling at the first token
    engines["original"].configure(instruction=prompt)
    try:
        assert all(r.pool_start == 0 for r in engines["original"].tokenize(texts))
    finally:
        engines["original"].configure(instruction=None)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("folder", ["original", "exclude_prompt"])
def test_instruction_matches_sentence_transformers_prompt(engines, st_models, folder, prompt):
    """The prompt pooled (the original's Pooling config) or not (``include_prompt: false``), as ST does."""
    texts = _texts()
    ref = _st(st_models[folder], texts, prompt)
    _assert_close(_engine(engines[folder], texts, prompt), ref, f"{folder}, prompt {prompt!r}")
    # not a tautology: pooling the prompt or not changes the embeddings, so the two configs can be told apart
    other = _st(st_models["exclude_prompt" if folder == "original" else "original"], texts, prompt)
    assert cosine_rows(ref, other).min() < 0.999


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_knob_overrides_the_config_both_ways(engines, st_models, prompt):
    """Same weights: the knob set against a folder's config gives what sentence-transformers gives on the other."""
    texts = _texts()
    ours = _engine(engines["original"], texts, prompt, include=False)
    _assert_close(ours, _st(st_models["exclude_prompt"], texts, prompt), "original + include_instruction=False")
    ours = _engine(engines["exclude_prompt"], texts, prompt, include=True)
    _assert_close(ours, _st(st_models["original"], texts, prompt), "exclude_prompt + include_instruction=True")


def test_instruction_given_to_the_constructor(folders, st_models):
    from lab import Engine

    prompt, texts = PROMPTS[1], _texts()
    e = Engine(folders["exclude_prompt"], instruction=prompt, dtype="float32", device="cpu", max_length=MAX_LENGTH)
    assert e.resolved.include_instruction is False
    _assert_close(e.embed(texts), _st(st_models["exclude_prompt"], texts, prompt), "Engine(..., instruction=)")
    # a per-call instruction overrides the engine's, None drops it
    _assert_close(e.embed(texts, instruction=None), _st(st_models["exclude_prompt"], texts, None), "instruction=None")


def test_no_pooling_config_does_not_pool_the_instruction(engines, st_models):
    """Without sentence-transformers files the engine mean-pools and leaves the instruction out (llm2vec-style);
    sentence-transformers' fallback Pooling pools the prompt, so it matches that only with include_prompt off."""
    e, st = engines["bare"], st_models["bare"]
    assert e.spec.include_prompt is None
    assert e.resolved.include_instruction is False
    assert e.resolved.pooling == "mean"
    assert st[1].pooling_mode == "mean"
    prompt, texts = PROMPTS[0], _texts()
    ours = _engine(e, texts, prompt)
    assert all(r.pool_start > 0 for r in e.configure(instruction=prompt).tokenize(texts))
    e.configure(instruction=None)
    # no Normalize module on either side: compare directions (and the norms, which a missing Normalize keeps)
    st[1].include_prompt = False
    try:
        _assert_close(ours, _st(st, texts, prompt), "bare folder vs sentence-transformers include_prompt=False")
    finally:
        st[1].include_prompt = True
    assert cosine_rows(ours, _st(st, texts, prompt)).min() < 0.999  # its default (prompt pooled) differs
    # the knob still pools it
    _assert_close(_engine(e, texts, prompt, include=True), _st(st, texts, prompt), "bare + include_instruction=True")
