"""Inputs longer than one forward, and spans shorter than one input: the windows behind ``long_inputs="chunk"`` and
late chunking (``Engine.embed_chunks``).

Both start from a text's **body** (its tokens without special tokens, with character offsets) framed by a **prefix**
(the tokenizer's leading specials, then the instruction's tokens) and a **suffix** (trailing specials, the appended
EOS): a window is ``prefix + body[s : s + room] + suffix`` with ``room = max_length - len(prefix) - len(suffix)``.

- ``long_inputs="chunk"`` (``split_long``): an input past ``max_length`` becomes consecutive windows (no overlap),
  each pooled by the model's method; the input's vector is their average weighted by each window's tokens (its
  length, less the instruction's tokens when those are not pooled), then the embedding head (matryoshka, normalize)
  runs on it, as vLLM's chunked processing weighs chunks by their token counts. For ``mean`` pooling a window's
  weight is the number of tokens it pooled, so the average is the mean over the input's tokens; for ``cls`` /
  ``lasttoken`` (one pooled token per window) the weight is still the window's length, so that a short last window
  counts for its share of the text rather than as much as a full one. Inputs that fit run exactly as before.
- Late chunking (``plan_chunks`` / ``pool_chunks``): a document's body is cut into chunks of ``chunk_tokens``
  tokens (``chunk_spans`` gives each its characters: the spans tile the document); one forward over the whole document
  (or, past ``max_length``, over **macro-windows** that overlap by at least one chunk) yields every token's final
  state, and each chunk's vector is the model's pooling over its own span, taken from the window that holds the chunk
  with the most context on its narrower side.

``dense_pass`` is the one place the knob is read: every call kind that embeds texts into dense vectors (``embed``,
``encode`` / ``encode_query`` / ``encode_document``, ``score`` / ``rerank`` in ``bi-encoder`` mode) runs the pass it
builds, so they all split a long input the same way.

The instruction is tokenized on its own here (in the packed path it is tokenized together with the text, which can
merge one token across the boundary); its tokens are attended to in every window and never pooled in a chunk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from lab.engine import passes
from lab.engine.call import Pass
from lab.engine.framing import kernel_pooling
from lab.engine.inputs import InputProcessor, Request
from lab.engine.knobs import plain_scalar
from lab.kernels.reference import segment_pool
from lab.outputs.heads import EmbeddingHead, Head, Pooler, TokensHead
from lab.outputs.pooling import pooling_method


@dataclass(frozen=True)
class Frame:
    """How every window of a call is framed: ``prefix`` ids (leading specials + instruction), ``suffix`` ids
    (trailing specials, EOS), ``pool_start`` (prefix tokens not pooled: the instruction unless it is pooled)."""

    prefix: list[int]
    suffix: list[int]
    pool_start: int

    def room(self, max_length: int) -> int:
        room = max_length - len(self.prefix) - len(self.suffix)
        if room < 1:
            raise ValueError(
                f"max_length={max_length} leaves no room for text after the instruction and special "
                f"tokens ({len(self.prefix) + len(self.suffix)} tokens); raise max_length or shorten "
                "the instruction"
            )
        return room

    def window(self, body: list[int], index: int) -> Request:
        return Request(
            index=index,
            ids=np.asarray(self.prefix + body + self.suffix, dtype=np.int64),
            pool_start=min(self.pool_start, len(self.prefix) + len(body) + len(self.suffix) - 1),
        )


def frame(proc: InputProcessor, instruction: str | None, include_instruction: bool) -> Frame:
    """The frame ``proc`` puts around a text (its tokenizer's specials, ``append_eos``), with ``instruction``."""
    n_pre, n_suf = proc.special_layout() or (proc.prefix_specials(), 0)
    empty = proc.tokenizer("", add_special_tokens=True)["input_ids"]
    prefix, suffix = list(empty[:n_pre]), list(empty[len(empty) - n_suf :] if n_suf else [])
    if proc.append_eos and (not suffix or suffix[-1] != proc.tokenizer.eos_token_id):
        suffix.append(proc.tokenizer.eos_token_id)
    instr = proc.tokenizer(instruction, add_special_tokens=False)["input_ids"] if instruction else []
    return Frame(
        prefix + list(instr), suffix, 0 if include_instruction or not instruction else len(prefix) + len(instr)
    )


def bodies(proc: InputProcessor, texts: list[str]) -> tuple[list[list[int]], list[np.ndarray]]:
    """Each text's tokens without specials, never truncated, and their ``(n, 2)`` character offsets."""
    enc = proc.tokenizer(
        texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False, verbose=False
    )
    return enc["input_ids"], [np.asarray(o, dtype=np.int64).reshape(-1, 2) for o in enc["offset_mapping"]]


# ----------------------------------------------------------------------------------------- long_inputs="chunk"
@dataclass
class Split:
    """``requests``: every window to run (numbered 0..); ``owner[j]``: the input window j belongs to; ``weight[j]``:
    its tokens, less an unpooled instruction's (whatever the pooling; see the module docstring); ``split``: how
    many inputs were split."""

    requests: list[Request]
    owner: np.ndarray
    weight: np.ndarray
    split: int

    def combine(self, rows: np.ndarray, n: int) -> torch.Tensor:
        """Per input, the windows' rows averaged with their weights: ``(n, H)`` float32."""
        out = np.zeros((n, rows.shape[1]), dtype=np.float64)
        np.add.at(out, self.owner, rows.astype(np.float64) * self.weight[:, None])
        totals = np.bincount(self.owner, weights=self.weight, minlength=n)
        return torch.from_numpy((out / np.maximum(totals, 1e-12)[:, None]).astype(np.float32))


def split_long(proc: InputProcessor, texts: list[str], requests: list[Request], fr: Frame) -> Split:
    """``requests`` (the texts tokenized as usual, truncated ones flagged) with each truncated input replaced by
    consecutive windows of its whole body."""
    room = fr.room(proc.max_length)
    long_ids = [r.index for r in requests if r.truncated]
    long_bodies = dict(zip(long_ids, bodies(proc, [texts[i] for i in long_ids])[0], strict=True)) if long_ids else {}
    out, owner, weight = [], [], []
    for r in requests:
        pieces = (
            [r]
            if not r.truncated
            else [fr.window(long_bodies[r.index][s : s + room], 0) for s in range(0, len(long_bodies[r.index]), room)]
        )
        for w in pieces:
            out.append(Request(index=len(out), ids=w.ids, token_type_ids=w.token_type_ids, pool_start=w.pool_start))
            owner.append(r.index)
            weight.append(w.length - w.pool_start)
    return Split(out, np.asarray(owner, dtype=np.int64), np.asarray(weight, dtype=np.float64), len(long_ids))


@dataclass(frozen=True)
class DensePass:
    """Dense embeddings of ``n`` texts as one pass of ``Engine.run_passes``: ``run`` is the pass, ``finish`` turns
    its rows into the ``(n, dim)`` embeddings and ``split`` counts the inputs cut into windows (``run_passes``'s
    ``split=``). Without windows the pass's own head already gave the embeddings; with them, ``run`` pools each
    window before any head and ``finish`` averages them per input (``Split.combine``), then applies ``head``."""

    run: Pass
    n: int
    head: Head | None = None
    windows: Split | None = None

    @property
    def split(self) -> int:
        return 0 if self.windows is None else self.windows.split

    def finish(self, rows: np.ndarray) -> np.ndarray:
        if self.windows is None:
            return rows
        return self.head(self.windows.combine(rows, self.n), None).numpy()  # averaged: no step's requests


def dense_pass(engine, texts: list[str], instruction: str | None, *, head: Head | None = None) -> DensePass:
    """The pass that embeds ``texts`` with ``instruction`` (a resolved text or ``None``) as ``Engine.embed`` does,
    under the engine's ``long_inputs`` knob: ``truncate`` runs ``engine.embed_pass`` as it is; ``chunk`` tokenizes
    every input first and replaces those past ``max_length`` with windows (``split_long``), pooled with no head, the
    head (``head``, default the engine's embedding head) applied to the averages by ``DensePass.finish``. Inputs
    that fit give the same vectors either way."""
    plain = engine.embed_pass(texts, instruction, head=head)
    if engine.knobs["long_inputs"] != "chunk":
        return DensePass(plain, len(texts))
    texts = engine.cut_documents(texts)  # llm2vec's cut (doc_max_length) first; the windows split what is left
    raw = engine.embed_pass(texts, instruction, head=EmbeddingHead(engine.model.hidden_size))
    r = engine.resolved
    proc = passes.processor(engine, r)  # embed_pass's
    split = split_long(proc, texts, raw.tokenize(texts, 0), frame(proc, instruction, r.include_instruction))
    windows = Pass(split.requests, lambda chunk, first: chunk, raw.pooler, shared_prefix=raw.shared_prefix)
    return DensePass(windows, len(texts), plain.pooler.head, split)


# ------------------------------------------------------------------------------------------------ late chunking
@dataclass
class ChunkPlan:
    """``windows``: the requests to run (numbered 0..); ``chunks``: the table (doc, chunk, char_start, char_end,
    n_tokens, text) plus where each chunk's rows are: ``window`` and ``row_start`` / ``row_end`` within it."""

    windows: list[Request]
    chunks: pd.DataFrame


def plan_chunks(
    proc: InputProcessor, docs: list[str], fr: Frame, chunk_tokens: int, overlap: int | None = None
) -> ChunkPlan:
    """Chunks of ``chunk_tokens`` body tokens per document, and the macro-windows they are pooled from (one per
    document that fits ``max_length``; else windows ``room`` tokens long that step by ``room - overlap``, overlap
    at least ``chunk_tokens`` (the default) so that every chunk lies whole in one of them). Each chunk's characters
    are ``chunk_spans``'s."""
    chunk_tokens, overlap = plain_scalar(chunk_tokens), plain_scalar(overlap)  # numpy ints from sweeps
    room = fr.room(proc.max_length)
    valid = (
        f"an int from 1 to {room - 1} (max_length={proc.max_length} less the {proc.max_length - room} special "
        "and instruction tokens, less one: windows overlap by at least chunk_tokens and must advance)"
    )
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or not 1 <= chunk_tokens < room:
        raise ValueError(f"chunk_tokens must be {valid}, got {chunk_tokens!r}")
    overlap = chunk_tokens if overlap is None else overlap
    if not isinstance(overlap, int) or isinstance(overlap, bool) or not chunk_tokens <= overlap < room:
        raise ValueError(
            f"overlap must be an int from chunk_tokens={chunk_tokens} to {room - 1} (so that every "
            f"chunk lies whole in a window that advances), or None (chunk_tokens), got {overlap!r}"
        )
    stride = room - overlap
    ids, offsets = bodies(proc, docs) if docs else ([], [])
    windows, rows = [], []
    for d, (body, offs) in enumerate(zip(ids, offsets, strict=True)):
        n = len(body)
        starts = list(range(0, max(n - room, 0) + 1, stride))
        if starts[-1] + room < n:
            starts.append(n - room)
        first = len(windows)
        windows += [fr.window(body[s : s + room], first + k) for k, s in enumerate(starts)]
        firsts = list(range(0, n, chunk_tokens))
        for c, (a, (cs, ce)) in enumerate(zip(firsts, chunk_spans(offs, firsts, len(docs[d])), strict=True)):
            b = min(a + chunk_tokens, n)
            holds = [(min(a - s, s + room - b), k) for k, s in enumerate(starts) if s <= a and b <= s + room]
            k = max(holds, key=lambda h: (h[0], -h[1]))[1]  # most context on the narrower side; first on ties
            rows.append(
                {
                    "doc": d,
                    "chunk": c,
                    "char_start": cs,
                    "char_end": ce,
                    "n_tokens": b - a,
                    "text": docs[d][cs:ce],
                    "window": first + k,
                    "row_start": len(fr.prefix) + a - starts[k],
                    "row_end": len(fr.prefix) + b - starts[k],
                }
            )
    cols = ["doc", "chunk", "char_start", "char_end", "n_tokens", "text", "window", "row_start", "row_end"]
    return ChunkPlan(windows, pd.DataFrame(rows, columns=cols))


def chunk_spans(offsets: np.ndarray, firsts: list[int], length: int) -> list[tuple[int, int]]:
    """The ``(char_start, char_end)`` of each chunk of a document ``length`` characters long whose body tokens have
    character ``offsets`` (``(n, 2)``), chunk ``c`` starting at token ``firsts[c]``.

    The spans tile the document: the first starts at 0, each ends where the next starts, the last ends at
    ``length``, so every character lies in exactly one chunk and the texts joined are the document. A chunk starts
    where its first token starts, so the characters no token covers (whitespace, an accent a normalizer strips)
    go with the chunk before them; but never inside a character an earlier token covers: a character whose bytes
    byte-level BPE splits between two chunks (an emoji, a CJK character, a combining mark) is all in the earlier
    one, and a chunk whose tokens all lie inside such a character has an empty span."""
    if not firsts:
        return []
    ends = np.maximum.accumulate(offsets[:, 1])  # the furthest character the tokens so far reach
    cuts = [0]
    for a in firsts[1:]:
        cuts.append(max(cuts[-1], int(offsets[a][0]), int(ends[a - 1])))
    return list(itertools.pairwise([*cuts, length]))


def pool_chunks(plan: ChunkPlan, token_rows: list[np.ndarray], method: str) -> torch.Tensor:
    """Each chunk's span of its window's token states pooled by ``method``: ``(M, H)`` float32 (before the head)."""
    if plan.chunks.empty:
        return torch.zeros((0, token_rows[0].shape[1] if token_rows else 0), dtype=torch.float32)
    spans = [token_rows[w][a:b] for w, a, b in plan.chunks[["window", "row_start", "row_end"]].itertuples(index=False)]
    cu = torch.tensor(np.concatenate([[0], np.cumsum([len(s) for s in spans])]), dtype=torch.int32)
    return segment_pool(torch.from_numpy(np.concatenate(spans)), cu, method)


def embed_chunks(
    engine,
    docs: list[str],
    chunk_tokens: int,
    *,
    late: bool,
    overlap: int | None,
    instruction: str | None,
    show_progress: bool | None,
) -> tuple[np.ndarray, pd.DataFrame]:
    """``Engine.embed_chunks`` over checked ``docs`` with ``instruction`` (a resolved text or ``None``): the chunks'
    vectors and their table (``plan_chunks``); ``late`` pools each chunk from its document's forward, else embeds
    each chunk's text alone."""
    r = engine.resolved
    if r.template is not None:
        raise ValueError(
            "embed_chunks embeds spans of a document, which a template cannot frame; set template=None for it"
        )
    proc = passes.processor(engine, r)  # embed_pass's
    plan = plan_chunks(proc, docs, frame(proc, instruction, True), chunk_tokens, overlap)
    table = plan.chunks[["doc", "chunk", "char_start", "char_end", "n_tokens", "text"]].copy()
    if table.empty:  # no documents, or only empty ones: no chunk to embed
        return np.zeros((0, engine.embedding_dim), dtype=np.float32), table
    if not late:
        return engine.embed(table["text"].tolist(), instruction=instruction, show_progress=show_progress), table
    p = Pass(plan.windows, lambda chunk, first: chunk, Pooler(pooling_method("tokens"), TokensHead()))
    rows = engine.run_passes([p], "embed_chunks", show_progress)[0]
    head = passes.embedding_head(engine, r)
    return head(pool_chunks(plan, rows, kernel_pooling(r.pooling)), None).numpy(), table
