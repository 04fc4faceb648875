"""``lab.eval.retrieval``: nDCG against hand-computed values, MaxSim against a plain loop, and each mode's scores
against the engine calls it is made of (all-MiniLM-L6-v2)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lab.eval.retrieval import evaluate_retrieval, ndcg, score_matrix
from lab.outputs.scoring import maxsim_matrix

DOCS = {
    "d1": "The central bank raised interest rates by half a point and stocks fell.",
    "d2": "A recipe for onion soup with thyme and croutons. " * 3,
    "d3": "Protein folding is predicted from sequence by deep networks. " * 20,  # long: several chunks
    "d4": "",
    "d5": "Guitarists practise scales every day.",
}
QUERIES = {"q1": "How do interest rates affect markets?", "q2": "protein structure prediction", "q3": "soup"}
QRELS = {"q1": {"d1": 1}, "q2": {"d3": 2, "d1": 0}, "q3": {"d2": 1}, "q4": {"d5": 1}}


def test_ndcg_by_hand():
    docs, queries = ["a", "b", "c"], ["x", "y", "z"]
    scores = np.array([[0.9, 0.5, 0.1], [0.1, 0.5, 0.9], [1, 2, 3]], dtype=np.float32)
    qrels = {"x": {"b": 1}, "y": {"a": 2, "c": 1}, "z": {"a": 0}}
    got = ndcg(scores, docs, queries, qrels, k=2)
    assert got[0] == pytest.approx(1 / math.log2(3))  # the relevant doc at rank 2
    assert got[1] == pytest.approx((1 / 1) / (2 / 1 + 1 / math.log2(3)))  # c (gain 1) first, a (gain 2) past k=2
    assert np.isnan(got[2])  # no relevant document: skipped


def test_maxsim_matrix_equals_a_loop():
    rng = np.random.default_rng(0)
    qs = [rng.standard_normal((n, 8)).astype(np.float32) for n in (1, 3, 5)]
    ds = [rng.standard_normal((n, 8)).astype(np.float32) for n in (4, 1, 7, 2)]
    want = np.array([[(q @ d.T).max(1).mean() for d in ds] for q in qs])
    for block in (1, 3, 1 << 16):  # blocks that cut documents apart
        np.testing.assert_allclose(maxsim_matrix(qs, ds, block=block), want, rtol=1e-5, atol=1e-6)


def test_modes_are_the_engine_calls_they_name(minilm_engine):
    eng = minilm_engine
    q, d = list(QUERIES.values()), list(DOCS.values())
    dense = score_matrix(eng, "dense", q, d)
    np.testing.assert_allclose(dense, eng.similarity(eng.embed(q), eng.embed(d)), atol=1e-6)
    emb, chunks = eng.embed_chunks(d, chunk_tokens=16)
    assert chunks.doc.value_counts()[2] > 3 and 3 not in set(chunks.doc)  # the long doc in chunks; "" has none
    late = score_matrix(eng, "late-chunking", q, d, chunk_tokens=16)
    sims = eng.similarity(eng.embed(q), emb)
    for j in range(len(d)):
        rows = np.flatnonzero(chunks.doc.to_numpy() == j)
        want = sims[:, rows].max(1) if len(rows) else np.full(len(q), -np.inf)
        np.testing.assert_allclose(late[:, j], want, atol=1e-6)
    toks = score_matrix(eng, "tokens-maxsim", q, d)
    unit = [t / np.linalg.norm(t, axis=1, keepdims=True) for t in eng.embed(q, output="tokens")]
    dunit = [t / np.linalg.norm(t, axis=1, keepdims=True) for t in eng.embed(d, output="tokens")]
    np.testing.assert_allclose(toks[0, 2], (unit[0] @ dunit[2].T).max(1).mean(), rtol=1e-5)
    df = evaluate_retrieval(eng, DOCS, QUERIES, QRELS, modes=("dense", "chunks"), chunk_tokens=16, task="toy")
    assert list(df["mode"]) == ["dense", "chunks"] and df.variant.nunique() == 2
    assert (df.queries == 3).all() and df.score.between(0, 1).all()  # q4 is not among the queries
    assert df.iloc[0].score == pytest.approx(np.nanmean(ndcg(dense, list(DOCS), list(QUERIES), QRELS)))
    with pytest.raises(ValueError, match="late-chunking"):
        evaluate_retrieval(eng, DOCS, QUERIES, QRELS, modes=("bm25",))
    with pytest.raises(ValueError, match="heads"):  # MiniLM has no sparse head: the engine says which it has
        score_matrix(eng, "sparse", q, d)


def test_evaluate_scores_retrieval_modes_apart(minilm_engine):
    from lab import evaluate
    from lab._repo import import_evals

    tasks = import_evals("tasks").get_tasks(["SciFact"], limit=12)
    before = minilm_engine.stats
    with pytest.raises(ValueError, match="sparse"):  # checked against the model's heads before any work
        evaluate(minilm_engine, tasks, retrieval_modes=("dense", "sparse"), cache=None, show_progress=False)
    assert minilm_engine.stats is before
    df = evaluate(
        minilm_engine,
        tasks,
        retrieval_modes=("dense", "tokens-maxsim", "late-chunking"),
        cache=None,
        show_progress=False,
    )
    main = df[df.main]
    assert set(main.variant) == {
        "default",
        "default,mode=dense",
        "default,mode=tokens-maxsim",
        "default,mode=late-chunking",
    }
    mteb_ndcg = main[main.variant == "default"].score.item()
    ours = main[main.variant == "default,mode=dense"]
    assert ours.metric.item() == "ndcg_at_10" and ours.score.item() == pytest.approx(mteb_ndcg, abs=1e-4)


def test_a_registered_retrieval_mode_is_scored_and_checked(minilm_engine, monkeypatch):
    """``register_mode`` a toy mode (in a scratch copy of ``RETRIEVAL_MODES``): ``evaluate_retrieval`` scores it,
    the errors list it, and a mode needing a head the model lacks is refused before any work."""
    from lab.eval import retrieval

    monkeypatch.setattr(retrieval, "RETRIEVAL_MODES", dict(retrieval.RETRIEVAL_MODES))

    def first_token(engine, queries, docs, query_kw, chunk_tokens):  # cosine of the first token's hidden states
        q = [t[0] for t in engine.embed(queries, output="tokens", **query_kw)]
        return engine.similarity(np.stack(q), np.stack([t[0] for t in engine.embed(docs, output="tokens")]))

    retrieval.register_mode(retrieval.RetrievalMode("first-token", first_token, ("tokens",)))
    retrieval.register_mode(retrieval.RetrievalMode("needs-sparse", first_token, ("sparse",)))
    docs = {k: v for k, v in DOCS.items() if v}  # a text with no tokens has no first token
    df = evaluate_retrieval(minilm_engine, docs, QUERIES, QRELS, modes=("dense", "first-token"), task="toy")
    assert list(df["mode"]) == ["dense", "first-token"] and df.score.between(0, 1).all()
    with pytest.raises(ValueError, match="valid: .*first-token"):
        evaluate_retrieval(minilm_engine, docs, QUERIES, QRELS, modes=("bm25",))
    before = minilm_engine.stats
    with pytest.raises(ValueError, match="needs-sparse"):
        evaluate_retrieval(minilm_engine, docs, QUERIES, QRELS, modes=("dense", "needs-sparse"))
    assert minilm_engine.stats is before  # refused before the dense mode ran
    with pytest.raises(TypeError, match="RetrievalMode"):
        retrieval.register_mode("first-token")
