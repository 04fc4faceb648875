"""Every pooling over packed tokens equals a plain padded torch computation on transformers' hidden states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lab import Engine
from lab.ops.batch import AttnMeta
from lab.outputs.heads import EmbeddingHead, Head, Pooler
from lab.outputs.pooling import PoolingMethod, pooling_method, register


def pool(hidden, meta, method, pool_start=None):
    return pooling_method(method)(hidden, meta, pool_start)


def padded_pool(hidden: torch.Tensor, mask: torch.Tensor, method: str) -> torch.Tensor:
    """The textbook padded version: hidden (B, L, H), mask (B, L) of 0/1."""
    m = mask.float()[..., None]
    if method == "cls":
        return hidden[:, 0]
    if method == "lasttoken":
        return hidden[torch.arange(len(hidden)), mask.sum(1) - 1]
    if method == "max":
        return hidden.masked_fill(m == 0, -1e9).max(1).values
    if method == "mean":
        return (hidden * m).sum(1) / m.sum(1)
    w = torch.arange(1, hidden.shape[1] + 1, dtype=torch.float32)[None, :, None] * m  # weightedmean
    return (hidden * w).sum(1) / w.sum(1)


@pytest.fixture(scope="module")
def hf_reference(minilm_path, sentences):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path).eval()
    enc = tok(sentences, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    return hidden, enc["attention_mask"]


@pytest.mark.parametrize("method", ["cls", "mean", "max", "lasttoken", "weightedmean"])
def test_engine_pooling_matches_padded_reference(minilm_path, sentences, hf_reference, method):
    hidden, mask = hf_reference
    ref = padded_pool(hidden, mask, method).numpy()
    eng = Engine(minilm_path, pooling=method, normalize=False, max_batch_tokens=200)
    got = eng.embed(sentences)
    np.testing.assert_allclose(got, ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["cls", "mean", "max", "lasttoken", "weightedmean"])
def test_pool_with_instruction_offset_and_length_one(method):
    lengths = [5, 1, 3, 1, 7]
    meta = AttnMeta.from_lengths(lengths, causal=False)
    hidden = torch.randn(sum(lengths), 6)
    start = torch.tensor([2, 0, 1, 0, 6])
    got = pool(hidden, meta, method, pool_start=start)
    rows, s = [], 0
    for n, p in zip(lengths, start.tolist()):
        seg = hidden[s + p : s + n]
        w = torch.arange(1, len(seg) + 1, dtype=torch.float32)[:, None]
        rows.append(
            {
                "cls": seg[0],
                "lasttoken": seg[-1],
                "max": seg.max(0).values,
                "mean": seg.mean(0),
                "weightedmean": (seg * w).sum(0) / w.sum(),
            }[method]
        )
        s += n
    torch.testing.assert_close(got, torch.stack(rows), atol=1e-6, rtol=1e-6)


def test_mean_accumulates_in_float32():
    meta = AttnMeta.from_lengths([4000], causal=False)
    hidden = (torch.randn(4000, 8) + 100).bfloat16()
    got = pool(hidden, meta, "mean")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got[0], hidden.float().mean(0), atol=1e-4, rtol=0)


def test_embedding_head_truncates_before_normalizing():
    x = torch.randn(3, 16)
    out = EmbeddingHead(16, truncate_dim=4, normalize=True)(x, None)
    torch.testing.assert_close(out, torch.nn.functional.normalize(x[:, :4], dim=-1))
    with pytest.raises(ValueError, match="exceeds"):
        EmbeddingHead(16, truncate_dim=32, normalize=False)


def _all_heads(cls=Head) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in (sub, *_all_heads(sub))}


def test_every_head_follows_the_one_protocol():
    """Every head (``lab.outputs.heads``, ``kinds``, ``multivector``) is a ``Head`` called ``head(pooled,
    requests)`` with a ``shape``; a ``Pooler`` refuses anything else, naming the protocol."""
    import inspect

    import lab.outputs.kinds
    import lab.outputs.multivector  # defines ColbertRows

    heads = _all_heads()
    assert {
        "EmbeddingHead",
        "TokensHead",
        "ClassifierHead",
        "YesNoHead",
        "SpladeHead",
        "LexicalHead",
        "ColbertHead",
        "ColbertRows",
        "OutputHeads",
    } <= {h.__name__ for h in heads}
    for h in heads:
        assert list(inspect.signature(h.__call__).parameters)[2:] == ["requests"], h
        assert hasattr(h, "shape"), h
    with pytest.raises(TypeError, match="must be a lab.outputs.heads.Head"):
        Pooler(pooling_method("mean"), lambda pooled: pooled)
    pooler = Pooler(pooling_method("mean"), lab.outputs.kinds.ColbertHead())
    x = [torch.randn(3, 4), torch.randn(2, 4)]
    requests = [type("R", (), {"pool_start": 0})(), type("R", (), {"pool_start": 1})()]
    out = pooler.outputs(x, requests)  # the executor's call: the head gets the step's requests
    torch.testing.assert_close(out[0], x[0][1:])
    torch.testing.assert_close(out[1], x[1])


def test_all_tokens_are_the_rows_mean_averages():
    """``tokens``: each sequence's pooled rows (after its instruction), whose mean is the ``mean`` pooling."""
    lengths = [5, 1, 3, 1, 7]
    meta = AttnMeta.from_lengths(lengths, causal=False)
    hidden = torch.randn(sum(lengths), 6).bfloat16()
    start = torch.tensor([2, 0, 1, 0, 6])
    rows = pool(hidden, meta, "tokens", pool_start=start)
    assert [len(r) for r in rows] == [3, 1, 2, 1, 1] and all(r.dtype == torch.float32 for r in rows)
    torch.testing.assert_close(torch.stack([r.mean(0) for r in rows]), pool(hidden, meta, "mean", start))


class _FirstTwo(PoolingMethod):
    """A toy method: the mean of each sequence's first two pooled rows."""

    name = "first_two"

    def __call__(self, hidden, meta, pool_start):
        rows = pooling_method("tokens")(hidden, meta, pool_start)
        return torch.stack([r[:2].mean(0) for r in rows])


def test_a_registered_pooling_method_is_offered_by_the_knob_configure_and_the_panel(minilm_path, monkeypatch):
    """``register`` a toy method (in a scratch copy of the registry): ``Engine(pooling=...)``, ``configure`` and the
    panel's pooling choices take it, it runs, and the ``tokens`` method stays out of the knob's values."""
    pytest.importorskip("ipywidgets")
    from lab.eval.panel import build_panel
    from lab.outputs import pooling

    monkeypatch.setattr(pooling, "METHODS", dict(pooling.METHODS))
    assert "first_two" not in pooling.knob_values() and "tokens" not in pooling.knob_values()
    with pytest.raises(
        ValueError, match="unknown pooling 'first_two'; valid: cls, mean, max, lasttoken, weightedmean, eos_token"
    ):
        Engine(minilm_path, pooling="first_two")
    register("first_two", _FirstTwo())
    eng = Engine(minilm_path, pooling="first_two", normalize=False)
    texts = ["a man plays a guitar", "two dogs run in the snow"]
    got = eng.embed(texts)
    tokens = eng.embed(texts, output="tokens")
    np.testing.assert_allclose(got, np.stack([t[:2].mean(0) for t in tokens]), rtol=1e-6, atol=1e-6)
    eng.configure(pooling="mean").configure(pooling="first_two")
    assert ("first_two", "first_two") in build_panel(eng).pooling.options
    with pytest.raises(TypeError, match="PoolingMethod"):
        register("bad", object())
