"""``long_inputs="chunk"`` and late chunking (``Engine.embed_chunks``) against plain references on transformers.

The references never use ``lab``: they tokenize with the model's tokenizer, build the windows as the docstrings of
``lab.engine.windows`` describe them, run transformers' ``AutoModel`` on each window (one at a time, unpadded) and pool
with torch. all-MiniLM-L6-v2 (mean pooling, Normalize) at a small ``max_length`` so that the windows are many.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from tests.conftest import cosine_rows

COS = 0.99999
LONG = ("The committee met on Tuesday to discuss the budget, the new library and the roads. " * 6,
        "Protein folding is one of the central problems of biology; " * 9)


@pytest.fixture(scope="module")
def hf(minilm_path):
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path), AutoModel.from_pretrained(minilm_path).eval()


def _states(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf[1](input_ids=torch.tensor([ids])).last_hidden_state[0].float()


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _ref_long(hf, text: str, max_length: int) -> np.ndarray:
    """Windows of max_length - 2 body tokens framed by [CLS] / [SEP], mean-pooled, averaged by length, unit."""
    tok = hf[0]
    body = tok(text, add_special_tokens=False)["input_ids"]
    room = max_length - 2
    vecs, weights = [], []
    for s in range(0, max(len(body), 1), room):
        ids = [tok.cls_token_id, *body[s:s + room], tok.sep_token_id]
        vecs.append(_states(hf, ids).mean(0).numpy())
        weights.append(len(ids))
    return _unit(np.average(np.stack(vecs), axis=0, weights=weights))


def _texts() -> list[str]:
    texts = ["A man is playing a guitar.", LONG[0], "a", "", LONG[1], "Stocks fell sharply on Monday.", LONG[0][:150]]
    random.Random(5).shuffle(texts)
    return texts


@pytest.mark.parametrize(("max_length", "workers", "budget"), [(32, 1, 16384), (48, 2, 64), (256, 1, 16384)])
def test_long_inputs_chunk_matches_reference(minilm_path, hf, max_length, workers, budget):
    from lab import Engine

    texts = _texts()
    eng = Engine(minilm_path, max_length=max_length, cpu_workers=workers, max_batch_tokens=budget)
    truncated = eng.embed(texts)
    n_long = eng.stats.truncated
    eng.configure(long_inputs="chunk")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = eng.embed(texts)
    assert eng.stats.split == n_long and eng.stats.truncated == 0 and eng.stats.padded_tokens == 0
    assert (n_long > 0) == (max_length < 256)
    assert any("split into windows" in str(w.message) for w in caught) == (n_long > 0)
    ref = np.stack([_ref_long(hf, t, max_length) for t in texts])
    cos = cosine_rows(ours, ref)
    assert cos.min() >= COS, cos
    fits = [i for i, r in enumerate(eng.tokenize(texts)) if not r.truncated]
    np.testing.assert_allclose(ours[fits], truncated[fits], atol=1e-6)  # inputs that fit run exactly as before
    if n_long:
        assert cosine_rows(ours, truncated).min() < 0.999  # not a tautology: the split inputs changed


def _ref_chunks(hf, doc: str, chunk_tokens: int, max_length: int, overlap: int | None = None):
    """Chunks of the body; macro-windows of room tokens stepping room - overlap (the last one flush with the end);
    each chunk from the window holding it with the most context on its narrower side (first on ties)."""
    tok = hf[0]
    enc = tok(doc, add_special_tokens=False, return_offsets_mapping=True)
    body, offs = enc["input_ids"], enc["offset_mapping"]
    room = max_length - 2
    stride = room - (overlap or chunk_tokens)
    starts = list(range(0, max(len(body) - room, 0) + 1, stride))
    if starts[-1] + room < len(body):
        starts.append(len(body) - room)
    states = [_states(hf, [tok.cls_token_id, *body[s:s + room], tok.sep_token_id]) for s in starts]
    vecs, spans = [], []
    for a in range(0, len(body), chunk_tokens):
        b = min(a + chunk_tokens, len(body))
        best = max((min(a - s, s + room - b), -k) for k, s in enumerate(starts) if s <= a and b <= s + room)
        k = -best[1]
        vecs.append(states[k][1 + a - starts[k]:1 + b - starts[k]].mean(0).numpy())
        spans.append((offs[a][0], offs[b - 1][1]))
    return _unit(np.stack(vecs)), spans


@pytest.mark.parametrize(("max_length", "chunk_tokens", "overlap"), [(256, 16, None), (40, 8, None), (40, 7, 12)])
def test_late_chunking_matches_reference(minilm_path, hf, max_length, chunk_tokens, overlap):
    from lab import Engine

    docs = [LONG[1], "One short document.", LONG[0] + LONG[1][:200], "x"]
    eng = Engine(minilm_path, max_length=max_length)
    emb, chunks = eng.embed_chunks(docs, chunk_tokens=chunk_tokens, overlap=overlap)
    assert list(chunks.columns) == ["doc", "chunk", "char_start", "char_end", "n_tokens", "text"]
    assert emb.dtype == np.float32 and emb.shape == (len(chunks), 384)
    assert eng.stats.padded_tokens == 0
    for d, doc in enumerate(docs):
        ref, spans = _ref_chunks(hf, doc, chunk_tokens, max_length, overlap)
        mine = chunks[chunks.doc == d]
        assert mine.chunk.tolist() == list(range(len(spans)))
        assert list(zip(mine.char_start, mine.char_end, strict=True)) == spans
        assert mine.text.tolist() == [doc[a:b] for a, b in spans]
        assert mine.n_tokens.sum() == len(hf[0](doc, add_special_tokens=False)["input_ids"])
        cos = cosine_rows(emb[mine.index], ref)
        assert cos.min() >= COS, (d, cos)
    # the baseline: each chunk's text embedded on its own, which is not the same thing
    alone, same = eng.embed_chunks(docs, chunk_tokens=chunk_tokens, overlap=overlap, late=False)
    assert same.equals(chunks)
    np.testing.assert_allclose(alone, eng.embed(chunks.text.tolist()), atol=1e-6)
    assert cosine_rows(alone, emb).min() < 0.99


def test_window_errors_leave_the_engine_as_it_was(minilm_engine):
    eng = minilm_engine
    before = (dict(eng.knobs), eng.stats)
    for kwargs, words in [({"chunk_tokens": 0}, "chunk_tokens"), ({"chunk_tokens": 400}, "chunk_tokens"),
                          ({"chunk_tokens": 8, "overlap": 4}, "overlap"), ({"chunk_tokens": True}, "chunk_tokens")]:
        with pytest.raises(ValueError, match=words):
            eng.embed_chunks(["some document text"], **kwargs)
    with pytest.raises(ValueError, match="long_inputs"):
        eng.configure(long_inputs="window")
    with pytest.raises(TypeError, match="docs"):
        eng.embed_chunks("a single string")
    assert (dict(eng.knobs), eng.stats) == before
