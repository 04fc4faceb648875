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
LONG = (
    "The committee met on Tuesday to discuss the budget, the new library and the roads. " * 6,
    "Protein folding is one of the central problems of biology; " * 9,
)


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
        ids = [tok.cls_token_id, *body[s : s + room], tok.sep_token_id]
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
    each chunk from the window holding it with the most context on its narrower side (first on ties); character
    spans that tile the document."""
    tok = hf[0]
    enc = tok(doc, add_special_tokens=False, return_offsets_mapping=True)
    body, offs = enc["input_ids"], enc["offset_mapping"]
    room = max_length - 2
    stride = room - (overlap or chunk_tokens)
    starts = list(range(0, max(len(body) - room, 0) + 1, stride))
    if starts[-1] + room < len(body):
        starts.append(len(body) - room)
    states = [_states(hf, [tok.cls_token_id, *body[s : s + room], tok.sep_token_id]) for s in starts]
    vecs, cuts = [], []
    for a in range(0, len(body), chunk_tokens):
        b = min(a + chunk_tokens, len(body))
        best = max((min(a - s, s + room - b), -k) for k, s in enumerate(starts) if s <= a and b <= s + room)
        k = -best[1]
        vecs.append(states[k][1 + a - starts[k] : 1 + b - starts[k]].mean(0).numpy())
        cuts.append(offs[a][0] if a else 0)  # WordPiece tokens never share a character: a chunk starts at its token
    spans = list(zip(cuts, [*cuts[1:], len(doc)]))  # ... and runs to the next chunk (the last to the end)
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
        assert mine.text.tolist() == [doc[a:b] for a, b in spans] and "".join(mine.text) == doc
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
    room = eng.resolved.max_length - 2  # [CLS] ... [SEP]
    for kwargs, words in [
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"chunk_tokens": 400}, "chunk_tokens"),
        ({"chunk_tokens": room}, f"chunk_tokens must be an int from 1 to {room - 1} "),
        ({"chunk_tokens": 8, "overlap": 4}, "overlap"),
        ({"chunk_tokens": True}, "chunk_tokens"),
        ({"chunk_tokens": 1, "overlap": True}, "overlap must be an int"),
    ]:
        with pytest.raises(ValueError, match=words):
            eng.embed_chunks(["some document text"], **kwargs)
    with pytest.raises(ValueError, match="long_inputs"):
        eng.configure(long_inputs="window")
    with pytest.raises(TypeError, match="docs"):
        eng.embed_chunks("a single string")
    assert (dict(eng.knobs), eng.stats) == before


def test_no_documents_give_no_chunks(minilm_engine):
    for docs in ([], ["", ""]):
        for late in (True, False):
            emb, chunks = minilm_engine.embed_chunks(docs, late=late)
            assert emb.shape == (0, 384) and emb.dtype == np.float32
            assert chunks.empty and list(chunks.columns) == [
                "doc",
                "chunk",
                "char_start",
                "char_end",
                "n_tokens",
                "text",
            ]


def test_long_inputs_chunk_with_cls_weighs_windows_by_length(minilm_path, hf):
    """cls pools one token per window; the windows are still weighted by their lengths (the module docstring)."""
    from lab import Engine

    tok, max_length = hf[0], 32
    eng = Engine(minilm_path, max_length=max_length, pooling="cls", long_inputs="chunk")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = eng.embed(list(LONG))
    for text, row in zip(LONG, ours, strict=True):
        body = tok(text, add_special_tokens=False)["input_ids"]
        wins = [
            [tok.cls_token_id, *body[s : s + max_length - 2], tok.sep_token_id]
            for s in range(0, len(body), max_length - 2)
        ]
        assert len(wins) > 2 and len(wins[-1]) < max_length  # a short last window, so the weighting shows
        vecs = np.stack([_states(hf, w)[0].numpy() for w in wins])
        assert cosine_rows(row[None], _unit(np.average(vecs, axis=0, weights=[len(w) for w in wins]))[None]) >= COS
        assert cosine_rows(row[None], _unit(vecs.mean(0))[None]) < COS  # not the plain average of the windows


# texts byte-level BPE splits inside characters: a ZWJ emoji family, combining acute accents, CJK, a flag
HARD = [
    "👩\u200d👩\u200d👧 family",
    "cafe\u0301 and re\u0301sume\u0301 e\u0301\u0301",
    "漢字とカタカナ、한국어 텍스트。",
    "  padded 🇫🇷 flag  ",
    "👩" * 5,
    "x",
]


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory):
    from lab import Engine
    from tests.tiny_models import tiny_llama

    return Engine(tiny_llama(tmp_path_factory.mktemp("bpe"), "llama"))


@pytest.mark.parametrize("which", ["byte_bpe", "minilm_engine"])
@pytest.mark.parametrize("chunk_tokens", [1, 2, 3, 5])
def test_chunk_spans_tile_the_document(request, which, chunk_tokens):
    """Each character in exactly one chunk, spans in order, the texts joined = the document; with byte-level BPE
    (the bytes of one emoji / CJK character / accent in several tokens) and with WordPiece (which strips accents)."""
    eng = request.getfixturevalue(which)
    emb, chunks = eng.embed_chunks(HARD, chunk_tokens=chunk_tokens)
    assert len(emb) == len(chunks) and np.isfinite(emb).all()
    tok = eng.tokenizer
    for d, doc in enumerate(HARD):
        mine = chunks[chunks.doc == d]
        starts, ends = mine.char_start.to_numpy(), mine.char_end.to_numpy()
        assert starts[0] == 0 and ends[-1] == len(doc) and (starts[1:] == ends[:-1]).all() and (starts <= ends).all()
        assert mine.text.tolist() == [doc[a:b] for a, b in zip(starts, ends, strict=True)]
        assert "".join(mine.text) == doc
        assert mine.n_tokens.sum() == len(tok(doc, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("kind", ["Pooling", "SpladePooling"])
def test_pooling_module_outside_the_model_folder_is_refused(minilm_path, tmp_path, kind):
    """modules.json's Pooling config sets the pooling every window and chunk uses; a path leading out of the folder
    is refused as ColBERT module paths are, not read."""
    import json
    from pathlib import Path

    from lab.models.folder import read_folder

    model = tmp_path / "model"
    model.mkdir()
    for f in Path(minilm_path).iterdir():
        if f.name != "modules.json":
            (model / f.name).symlink_to(f)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "../elsewhere", "type": f"sentence_transformers.models.{kind}"},
    ]
    (model / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"modules.json: module path '../elsewhere' is outside the model folder"):
        read_folder(model)
    modules[1]["path"] = "1_Pooling"  # a link to a folder elsewhere, made inside the model folder: followed
    (model / "modules.json").write_text(json.dumps(modules))
    assert (model / "1_Pooling").is_symlink() and read_folder(model).pooling == ("mean" if kind == "Pooling" else None)
