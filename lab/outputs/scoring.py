"""Scoring output vectors against each other: cosine matrices, ColBERT MaxSim, sparse dot products, bge-m3's
weighted pair scores.

- ``cosine_matrix``: every dense vector of one set against every one of another (``Engine.similarity``);
- ``maxsim``: one (query, document) pair of ColBERT / token matrices, FlagEmbedding's ``colbert_score``;
- ``maxsim_matrix``: every query against every document, ``(Q, D)``, documents scanned in blocks of token vectors;
- ``sparse_dot``: row-wise dot products of two ``csr_matrix`` of lexical weights (shared token ids);
- ``pair_scores``: the pairs of a score mode (``SCORE_OUTPUTS``: the outputs each mode reads): ``late-interaction``,
  ``sparse`` or ``m3`` (bge-m3's ``M3_WEIGHTS``).

``lab.engine.rerank`` scores pairs with these (``Engine.score(pairs, mode=...)``) and ``lab.eval.retrieval`` scores
whole query x corpus matrices.

    >>> out = eng.embed(texts, output=("dense", "sparse", "colbert"))
    >>> maxsim(out["colbert"][0], out["colbert"][1])                  # ColBERT late interaction of texts 0 and 1
    >>> maxsim_matrix(out["colbert"][:2], out["colbert"])              # (2, len(texts))
"""

from __future__ import annotations

import numpy as np

__all__ = ["M3_WEIGHTS", "SCORE_OUTPUTS", "maxsim", "maxsim_matrix", "pair_scores", "sparse_dot"]

M3_WEIGHTS = (1.0, 1.0, 1.0)  # dense, sparse, colbert: FlagEmbedding's M3Embedder.compute_score default
# the outputs each score mode reads
SCORE_OUTPUTS = {"late-interaction": ("colbert",), "sparse": ("sparse",), "m3": ("dense", "sparse", "colbert")}


def cosine_matrix(a, b=None) -> np.ndarray:
    """Cosine similarity matrix ``(n, m)`` float32 between two sets of embeddings ``(n, dim)`` and ``(m, dim)``
    (``b=None``: ``a`` with itself); a set that is not a 2-D array, or two sets of different widths, are refused."""
    a = np.asarray(a, dtype=np.float32)
    b = a if b is None else np.asarray(b, dtype=np.float32)
    for name, x in (("a", a), ("b", b)):
        if x.ndim != 2:
            hint = f"; for one vector pass {name}[None]" if x.ndim == 1 else ""
            raise ValueError(f"similarity: {name} must be a 2-D array (n, dim), got shape {x.shape}{hint}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"similarity: a has {a.shape[1]} dimensions and b has {b.shape[1]}; they must match")
    an = a / np.clip(np.linalg.norm(a, axis=1, keepdims=True), 1e-12, None)
    bn = b / np.clip(np.linalg.norm(b, axis=1, keepdims=True), 1e-12, None)
    return an @ bn.T


def maxsim(q: np.ndarray, d: np.ndarray) -> float:
    """ColBERT late interaction, as FlagEmbedding's ``colbert_score``: each query vector's largest dot product with
    a document vector, summed and divided by the number of query vectors (0 when either side has none)."""
    if not len(q) or not len(d):
        return 0.0
    return float((q @ d.T).max(axis=1).sum() / len(q))


def sparse_dot(a, b) -> np.ndarray:
    """Row-wise dot products of two csr matrices of equal shape (lexical matching on shared token ids)."""
    return np.asarray(a.multiply(b).sum(axis=1), dtype=np.float32).reshape(-1)


def maxsim_matrix(queries: list[np.ndarray], docs: list[np.ndarray], block: int = 1 << 16) -> np.ndarray:
    """``(Q, D)`` MaxSim: for each query vector its best dot product within a document, averaged over the query's
    vectors. Documents are scanned ``block`` token vectors at a time (memory ``Q_tokens x block``)."""
    lengths = np.array([len(d) for d in docs])
    owner = np.repeat(np.arange(len(docs)), lengths)
    qcat = np.concatenate(queries).astype(np.float32)
    qown = np.repeat(np.arange(len(queries)), [len(q) for q in queries])
    best = np.full((len(qcat), len(docs)), -np.inf, dtype=np.float32)
    flat = np.concatenate(docs).astype(np.float32) if len(docs) else np.zeros((0, qcat.shape[1]), np.float32)
    for s in range(0, len(flat), block):
        sims = qcat @ flat[s : s + block].T  # (query tokens, block)
        cols = owner[s : s + block]
        starts = np.flatnonzero(np.r_[True, cols[1:] != cols[:-1]])
        np.maximum.at(best.T, cols[starts], np.maximum.reduceat(sims, starts, axis=1).T)
    best[~np.isfinite(best)] = 0.0  # an empty document
    sums = np.zeros((len(queries), len(docs)), dtype=np.float64)
    np.add.at(sums, qown, best)
    return (sums / np.bincount(qown, minlength=len(queries))[:, None]).astype(np.float32)


def pair_scores(mode: str, q: dict, d: dict, qi: list[int], di: list[int]) -> np.ndarray:
    """Scores of pairs ``(q[qi[k]], d[di[k]])`` in ``mode``: ``late-interaction`` (``maxsim``), ``sparse``
    (``sparse_dot``) or ``m3`` (dense dot product, sparse and ColBERT scores weighted by ``M3_WEIGHTS`` and divided
    by their sum, as ``M3Embedder.compute_score``'s ``colbert+sparse+dense``). ``q`` / ``d``: dicts of outputs."""
    parts = {}
    if "colbert" in SCORE_OUTPUTS[mode]:
        parts["colbert"] = np.asarray(
            [maxsim(q["colbert"][i], d["colbert"][j]) for i, j in zip(qi, di)], dtype=np.float32
        )
    if "sparse" in SCORE_OUTPUTS[mode]:
        parts["sparse"] = sparse_dot(q["sparse"][qi], d["sparse"][di]) if qi else np.zeros(0, np.float32)
    if mode != "m3":
        return next(iter(parts.values()))
    parts["dense"] = (q["dense"][qi] * d["dense"][di]).sum(axis=1)
    w = dict(zip(("dense", "sparse", "colbert"), M3_WEIGHTS))
    return (sum(w[k] * parts[k] for k in w) / sum(M3_WEIGHTS)).astype(np.float32)
