"""Retrieval beyond one dense vector per text, scored with nDCG@k on a task's own qrels.

mteb 2.x scores retrieval from one dense vector per text; sparse weights, ColBERT / token vectors and late-chunked
documents need their own scoring, done here over the same corpus, queries and qrels (``load_retrieval`` reads an
mteb retrieval task, e.g. the local SciFact). Each **mode** names how queries and documents are represented and
compared; every row of the result says which, so these variants never mix with mteb's dense scores. The modes are a
registry (``RETRIEVAL_MODES``, name -> ``RetrievalMode``: the outputs it needs, its score matrix); ``register_mode``
adds one, and ``evaluate_retrieval`` and ``lab.evaluate``'s ``retrieval_modes`` take its names:

- ``dense``: one vector per text, cosine similarity (what mteb scores);
- ``sparse``: lexical weights (``output="sparse"``: SPLADE / bge-m3), dot product;
- ``late-interaction``: bge-m3's ColBERT vectors, MaxSim (``lab.outputs.scoring.maxsim_matrix``);
- ``tokens-maxsim``: the final hidden states of every pooled token (``output="tokens"``, L2-normalized), MaxSim:
  multi-vector retrieval from any embedding model, without a ColBERT head;
- ``m3``: bge-m3's ``(dense + sparse + colbert) / 3``;
- ``late-chunking`` / ``chunks``: documents cut into chunks of ``chunk_tokens`` tokens and pooled late (one forward
  per document, ``Engine.embed_chunks``) or each chunk embedded alone; a document scores its best chunk's cosine.

nDCG follows trec_eval's ``ndcg_cut`` (what mteb reports): gain = the qrel's relevance, discount ``log2(rank + 1)``,
ideal from the query's qrels; a query without relevant documents is skipped.

    >>> corpus, queries, qrels = load_retrieval("SciFact")
    >>> df = evaluate_retrieval(eng, corpus, queries, qrels, modes=("dense", "tokens-maxsim", "late-chunking"))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from lab.eval.mteb_adapter import resolve_tasks
from lab.outputs.kinds import check_outputs
from lab.outputs.scoring import maxsim_matrix


def ndcg(
    scores: np.ndarray,
    doc_ids: Sequence[str],
    query_ids: Sequence[str],
    qrels: Mapping[str, Mapping[str, int]],
    k: int = 10,
) -> np.ndarray:
    """Per-query nDCG@k of the score matrix ``(Q, D)`` (NaN for a query without relevant documents)."""
    out = np.full(len(query_ids), np.nan)
    discount = 1.0 / np.log2(np.arange(2, k + 2))
    for i, q in enumerate(query_ids):
        rel = {d: r for d, r in qrels.get(q, {}).items() if r > 0}
        if not rel:
            continue
        top = np.argsort(-scores[i], kind="stable")[:k]
        dcg = sum(rel.get(doc_ids[j], 0) * discount[n] for n, j in enumerate(top))
        ideal = sorted(rel.values(), reverse=True)[:k]
        out[i] = dcg / sum(g * discount[n] for n, g in enumerate(ideal))
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _dense(engine, queries, docs, q_kw, chunk_tokens):
    return engine.similarity(engine.embed(queries, **q_kw), engine.embed(docs))


def _sparse(engine, queries, docs, q_kw, chunk_tokens):
    return (engine.embed(queries, output="sparse", **q_kw) @ engine.embed(docs, output="sparse").T).toarray()


def _late_interaction(engine, queries, docs, q_kw, chunk_tokens):
    # a ColBERT folder's queries and documents run as its tasks (lab.outputs.multivector)
    mv = engine.spec.multi_vector is not None
    d_kw = {"prompt_name": "document"} if mv else {}
    q_kw = q_kw or ({"prompt_name": "query"} if mv else {})
    return maxsim_matrix(engine.embed(queries, output="colbert", **q_kw), engine.embed(docs, output="colbert", **d_kw))


def _tokens_maxsim(engine, queries, docs, q_kw, chunk_tokens):
    q = [_unit(t) for t in engine.embed(queries, output="tokens", **q_kw)]
    return maxsim_matrix(q, [_unit(t) for t in engine.embed(docs, output="tokens")])


def _m3(engine, queries, docs, q_kw, chunk_tokens):
    out = ("dense", "sparse", "colbert")
    q, d = engine.embed(queries, output=out, **q_kw), engine.embed(docs, output=out)
    sparse = (q["sparse"] @ d["sparse"].T).toarray()
    return ((q["dense"] @ d["dense"].T) + sparse + maxsim_matrix(q["colbert"], d["colbert"])) / 3


def _best_chunk(late: bool):
    def scores(engine, queries, docs, q_kw, chunk_tokens):
        emb, chunks = engine.embed_chunks(docs, chunk_tokens=chunk_tokens, late=late)
        sims = engine.similarity(engine.embed(queries, **q_kw), emb)  # (Q, chunks)
        out = np.full((len(queries), len(docs)), -np.inf, dtype=np.float32)
        np.maximum.at(out.T, chunks["doc"].to_numpy(), sims.T)
        return out

    return scores


@dataclass(frozen=True)
class RetrievalMode:
    """One way to represent and compare queries and documents: ``scores(engine, queries, docs, query_kw,
    chunk_tokens)`` gives the ``(Q, D)`` score matrix (``query_kw``: ``embed``'s keyword arguments for the queries);
    ``outputs``: the ``embed`` outputs it needs beside ``dense`` (checked on the model before any work);
    ``chunked``: it cuts documents into chunks of ``chunk_tokens`` tokens (its rows' variant says how many)."""

    name: str
    scores: Callable[..., np.ndarray]
    outputs: tuple[str, ...] = ()
    chunked: bool = False


RETRIEVAL_MODES: dict[str, RetrievalMode] = {}  # name -> mode, in the order errors list them


def register_mode(mode: RetrievalMode) -> RetrievalMode:
    """Add ``mode`` to ``RETRIEVAL_MODES``: ``evaluate_retrieval(..., modes=(mode.name,))`` then scores it."""
    if not isinstance(mode, RetrievalMode):
        raise TypeError(f"a retrieval mode must be a lab.eval.retrieval.RetrievalMode, got {type(mode).__name__}")
    RETRIEVAL_MODES[mode.name] = mode
    return mode


for _mode in (
    RetrievalMode("dense", _dense),
    RetrievalMode("sparse", _sparse, ("sparse",)),
    RetrievalMode("late-interaction", _late_interaction, ("colbert",)),
    RetrievalMode("tokens-maxsim", _tokens_maxsim, ("tokens",)),
    RetrievalMode("m3", _m3, ("dense", "sparse", "colbert")),
    RetrievalMode("late-chunking", _best_chunk(late=True), chunked=True),
    RetrievalMode("chunks", _best_chunk(late=False), chunked=True),
):
    register_mode(_mode)


def check_modes(engine, modes: Iterable[str]) -> tuple[str, ...]:
    """``modes`` as a tuple, each a registered mode whose outputs ``engine``'s model gives; ``ValueError`` naming
    the first that is not (the valid names, or the heads the model lacks) before any work."""
    modes = tuple(modes)
    registry = RETRIEVAL_MODES
    for mode in modes:
        if mode not in registry:
            raise ValueError(f"unknown retrieval mode {mode!r}; valid: {', '.join(registry)}")
        check_outputs(registry[mode].outputs, engine.model, engine.spec, purpose=f"retrieval mode {mode!r}")
    return modes


def score_matrix(
    engine, mode: str, queries: list[str], docs: list[str], *, chunk_tokens: int = 128, query_instruction=None
) -> np.ndarray:
    """``(len(queries), len(docs))`` scores of ``mode`` (``RETRIEVAL_MODES``) with ``engine``'s current knobs."""
    check_modes(engine, (mode,))
    q_kw = {} if query_instruction is None else {"instruction": query_instruction}
    return RETRIEVAL_MODES[mode].scores(engine, queries, docs, q_kw, chunk_tokens)


def evaluate_retrieval(
    engine,
    corpus: Mapping[str, str],
    queries: Mapping[str, str],
    qrels: Mapping[str, Mapping[str, int]],
    *,
    modes: Sequence[str] = ("dense",),
    k: int = 10,
    chunk_tokens: int = 128,
    task: str = "retrieval",
    query_instruction=None,
) -> pd.DataFrame:
    """One tidy row per mode: ``model, variant, task, mode, metric (ndcg_at_k), score, queries, docs, seconds``.
    ``variant`` is the engine's knob values plus the mode, so rows of different modes never share a name."""
    modes = check_modes(engine, modes)
    doc_ids, query_ids = list(corpus), list(queries)
    docs, qs = [corpus[d] for d in doc_ids], [queries[q] for q in query_ids]
    knobs = ", ".join(f"{k_}={v}" for k_, v in engine.knobs.items() if v is not None and k_ not in ("device",))
    rows = []
    for mode in modes:
        t0 = time.perf_counter()
        scores = score_matrix(engine, mode, qs, docs, chunk_tokens=chunk_tokens, query_instruction=query_instruction)
        per_query = ndcg(scores, doc_ids, query_ids, qrels, k)
        extra = f", chunk_tokens={chunk_tokens}" if RETRIEVAL_MODES[mode].chunked else ""
        rows.append(
            {
                "model": engine.model_name,
                "variant": f"{knobs}; mode={mode}{extra}",
                "task": task,
                "mode": mode,
                "metric": f"ndcg_at_{k}",
                "score": float(np.nanmean(per_query)),
                "queries": int(np.isfinite(per_query).sum()),
                "docs": len(docs),
                "seconds": time.perf_counter() - t0,
            }
        )
    return pd.DataFrame(rows)


def load_retrieval(task, *, split: str = "test", max_docs: int | None = None, seed: int = 0):
    """``(corpus, queries, qrels)`` dicts of an mteb retrieval task (a task object, or a name: the local copy in
    ``evals/data`` first, e.g. SciFact, else mteb's). Corpus texts are ``title + " " + text``. ``max_docs``: keep every
    document a qrel names plus a seeded random sample of the others, up to ``max_docs`` (a smaller, easier corpus: say
    so)."""
    t = resolve_tasks([task])[0]
    t.load_data()
    data = t.dataset["default"][split] if "default" in t.dataset else t.dataset[split]
    corpus = {r["id"]: f"{r.get('title') or ''} {r['text']}".strip() for r in data["corpus"]}
    queries = {r["id"]: r["text"] for r in data["queries"]}
    qrels = {q: dict(d) for q, d in data["relevant_docs"].items() if q in queries}
    if max_docs is not None and max_docs < len(corpus):
        needed = {d for rel in qrels.values() for d in rel if d in corpus}
        rest = sorted(set(corpus) - needed)
        rng = np.random.default_rng(seed)
        keep = needed | set(rng.choice(rest, size=max(max_docs - len(needed), 0), replace=False).tolist())
        corpus = {d: corpus[d] for d in corpus if d in keep}
    return corpus, queries, qrels
