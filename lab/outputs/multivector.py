"""ColBERT folders of sentence-transformers (``MultiVectorEncoder``): ``embed(texts, output="colbert")`` as its
``encode_query`` / ``encode_document`` give them, from one packed forward.

Such a folder is a Transformer, a token-level ``Dense`` projection, a ``MultiVectorMask`` and a ``Normalize``
(``lab.models.spec.MultiVectorSpec``). The task of a call is its ``prompt_name`` when that is ``"query"`` or
``"document"`` (``None`` otherwise, which sentence-transformers treats as a document for the skiplist), and it
decides, as sentence-transformers' ``Transformer.preprocess`` and ``MultiVectorMask`` do:

- **length**: ``query_length`` / ``document_length`` cap the task's inputs (the engine's ``max_length`` knob, when
  set, wins; then the model's own limit);
- **query expansion** (queries only): ``strategy="fixed"`` truncates each query to ``length`` tokens and fills it up
  to ``length`` with the expansion token (the tokenizer's ``[MASK]`` unless the config names one); ``"min"`` only
  fills short queries up to ``length``. The filled tokens are scored. With ``attend=False`` (classic ColBERT) no
  token attends to them: they are queries, never keys (``AttnMeta.key_lens``); with ``attend=True`` they are
  ordinary tokens;
- **scored tokens**: every token, the prompt's and the special tokens included, except, for the skiplist's tasks,
  those whose id is a skiplist word;
- **vectors**: ``Dense`` (with its activation), then L2-normalized per token when the folder has ``Normalize``.

    >>> eng = Engine("path/to/colbert")                           # a MultiVectorEncoder folder
    >>> Q = eng.embed(queries, output="colbert", prompt_name="query")
    >>> D = eng.embed(docs, output="colbert", prompt_name="document")
    >>> lab.outputs.scoring.maxsim_matrix(Q, D)
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from lab._warn import warn
from lab.outputs.heads import Head

TASKS = ("query", "document")


def task_of(prompt_name: str | None) -> str | None:
    """The multi-vector task a call's ``prompt_name`` selects: ``"query"``, ``"document"`` or ``None``."""
    return prompt_name if prompt_name in TASKS else None


def max_length(mv, task: str | None, default: int, knob: int | None) -> int:
    """How many tokens an input of ``task`` keeps: the ``max_length`` knob, else the task's own length (for a
    query under ``fixed`` expansion: the expansion length; under ``min``: at least it), else ``default``."""
    if knob is not None:
        return knob
    qe = mv.query_expansion if task == "query" else None
    if qe is not None and qe["strategy"] == "fixed":
        return qe["length"]
    length = {"query": mv.query_length, "document": mv.document_length}.get(task) or default
    return max(length, qe["length"]) if qe is not None else length


def expansion_token_id(mv, tokenizer, *, causal: bool) -> int:
    """The id that fills expanded queries: the config's token, else ``[MASK]``, else EOS (sentence-transformers'
    order). Expansion without ``attend`` needs bidirectional attention (keys limited per sequence)."""
    if causal and not mv.query_expansion["attend"]:
        raise ValueError(
            "query expansion with attend=False needs bidirectional attention; this model runs causally "
            "(set bidirectional=True, or query_expansion['attend']=true in sentence_bert_config.json)"
        )
    token = mv.query_expansion["token"]
    tid = tokenizer.convert_tokens_to_ids(token) if token is not None else tokenizer.mask_token_id
    if tid is None and token is None:
        tid = tokenizer.eos_token_id
    if tid is None or (token is not None and tid == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(
            f"query expansion needs a token id: the config names {token!r}, and the tokenizer has "
            f"{'no such token' if token is not None else 'no mask or eos token'}; set "
            "query_expansion['token'] in sentence_bert_config.json to a token of the vocabulary"
        )
    return int(tid)


def expand(requests: list, mv, fill_id: int) -> list:
    """Queries filled up to the expansion length with ``fill_id`` (``fixed`` ones were cut to it by tokenization);
    under ``attend=False`` each request keeps only its own tokens as keys (``key_len``)."""
    qe, out = mv.query_expansion, []
    for r in requests:
        n = len(r.ids)
        extra = max(0, qe["length"] - n)
        ids = np.concatenate([r.ids, np.full(extra, fill_id, dtype=np.int64)]) if extra else r.ids
        types = r.token_type_ids
        if types is not None and extra:
            types = np.concatenate([types, np.zeros(extra, dtype=np.int64)])
        out.append(replace(r, ids=ids, token_type_ids=types, key_len=None if qe["attend"] or not extra else n))
    return out


def skip_ids(mv, tokenizer, task: str | None) -> np.ndarray:
    """Token ids ``MultiVectorMask`` leaves out of scoring for ``task`` (words that are not one vocabulary token
    are dropped with a warning, as sentence-transformers does, so they never exclude real ``[UNK]`` tokens)."""
    if (task or "document") not in mv.skiplist_tasks or not mv.skiplist_words:
        return np.zeros(0, dtype=np.int64)
    ids, unknown = [], []
    for word in mv.skiplist_words:
        tid = tokenizer.convert_tokens_to_ids(word)
        if tid == tokenizer.unk_token_id and word != tokenizer.unk_token:
            unknown.append(word)
        elif tid is not None:
            ids.append(tid)
    if unknown:
        warn(f"skiplist words {unknown} are not single tokens of this tokenizer; they are not skipped")
    return np.asarray(sorted(set(ids)), dtype=np.int64)


def token_fn(model, mv):
    """Per-token vectors before masking: the Dense projection (and its activation), or the hidden states."""

    def fn(h: torch.Tensor) -> torch.Tensor:
        x = model.token_head("colbert_linear", h) if mv.dense is not None else h
        x = x.float()
        return torch.tanh(x) if mv.activation == "tanh" else x

    return fn


class ColbertRows(Head):
    """The head: each request's scored rows (skiplist ids dropped), L2-normalized when the folder normalizes.
    Reads the requests' ids."""

    shape = None

    def __init__(self, skip: np.ndarray, normalize: bool):
        self.skip, self.normalize = skip, normalize

    def __call__(self, vectors: list[torch.Tensor], requests: list) -> list[torch.Tensor]:
        out = []
        for v, r in zip(vectors, requests):
            if len(self.skip):
                keep = torch.from_numpy(~np.isin(r.ids[r.pool_start :], self.skip))
                v = v[keep.to(v.device)]
            out.append(torch.nn.functional.normalize(v, dim=-1) if self.normalize else v)
        return out
