"""Outputs beyond one vector per text, all from one packed forward: ``Engine.embed(texts, output=...)``.

Each output is a pooling method x head pair (``lab.outputs.pooling`` / ``lab.outputs.heads``) over the same packed
hidden states:

- ``dense``: the engine's own pooler (its pooling method, then matryoshka + normalize);
- ``tokens``: every pooled token's final hidden state, a list of ``(L_i, hidden)`` float32 arrays: exactly the
  rows ``mean`` pooling averages (an unpooled instruction excluded), so ``tokens[i].mean(0)`` is the mean-pooled
  vector before normalize;
- ``sparse``: a ``scipy.sparse.csr_matrix`` ``(N, vocab_size)`` float32 of lexical weights.
  SPLADE (a ``*ForMaskedLM`` folder with sentence-transformers' ``SpladePooling``): per pooled token
  ``log(1 + relu(MLM logits))`` (``log1p`` twice for ``activation_function="log1p_relu"``), reduced over the
  tokens by max (or sum, ``pooling_strategy``), as ``SparseEncoder.encode``. bge-m3 (``sparse_linear.pt``): per
  token ``relu(sparse_linear(h))``, the largest weight of each token id, the tokenizer's cls / eos / pad / unk
  tokens dropped, as FlagEmbedding's ``M3Embedder`` lexical weights;
- ``colbert``: bge-m3's ColBERT vectors, ``colbert_linear(h)`` L2-normalized per token, a list of ``(L_i, d)``
  float32 arrays; the first token (CLS) is dropped, as FlagEmbedding does. From a sentence-transformers
  ``MultiVectorEncoder`` folder: its Dense, skiplist and Normalize, with the task's lengths and query expansion
  (``lab.outputs.multivector``).

The kinds are a registry (``KINDS``, name -> ``OutputKind``: whether a model has it, what it needs, how to build
its method and head): ``output=`` takes its names, errors list them, ``register`` adds one.

Several outputs (``output=("dense", "sparse", "colbert")``) make one ``Pooler``: its method (``Several``)
applies each output's method to the step's hidden states in turn, inside the CPU worker that ran the step, and its
head (``OutputHeads``) runs each output's head after; the call returns a dict. Every head here follows the one
protocol of ``lab.outputs.heads`` (``head(pooled, requests)``). The last-layer ``rows()`` shortcut is taken only
when every output reads the same one row per sequence.

Memory: the SPLADE method computes MLM logits ``LOGIT_BLOCK_BYTES`` (64 MiB of float32) at a time, never the whole
step's ``(tokens, vocab)`` logits (2 GB at the default 16,384-token budget and BERT's 30,522-token vocabulary); it
holds ``(sequences, vocab)`` float32 maxima per step (31 MB at 256 sequences).

    >>> out = eng.embed(texts, output=("dense", "sparse", "colbert"))     # one forward
    >>> out["sparse"]                                                      # csr_matrix (N, vocab_size)
    >>> lab.outputs.scoring.maxsim(out["colbert"][0], out["colbert"][1])   # ColBERT late interaction
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lab.ops.batch import AttnMeta
from lab.outputs import multivector
from lab.outputs.heads import Head, Pooler, SparseShape, TokensHead
from lab.outputs.pooling import PoolingMethod, pooling_method

LOGIT_BLOCK_BYTES = 64 << 20  # MLM logits computed this many bytes of float32 at a time (module doc)


# ------------------------------------------------------------------------------------------- what a model has
def parse_output(output) -> tuple[tuple[str, ...], bool]:
    """``output=`` -> (output names, whether several were asked for: a dict comes back)."""
    valid = ", ".join(map(repr, KINDS))
    if isinstance(output, str):
        names, several = (output,), False
    elif isinstance(output, (tuple, list)) and output and all(isinstance(o, str) for o in output):
        names, several = tuple(output), True
    else:
        raise TypeError(f"output must be one of {valid} or a tuple of them, got {output!r}")
    for name in names:
        if name not in KINDS:
            raise ValueError(f"unknown output {name!r}; valid: {valid} (or a tuple of them)")
    if len(set(names)) != len(names):
        raise ValueError(f"output={output!r} names an output twice")
    return names, several


def available_outputs(model, spec) -> tuple[str, ...]:
    """The outputs this model can give (each kind's ``has``): ``dense`` and ``tokens`` always; ``sparse`` with a
    SPLADE MLM head (and a SpladePooling module) or bge-m3's ``sparse_linear``; ``colbert`` with bge-m3's
    ``colbert_linear`` or a ColBERT folder's pipeline."""
    return tuple(name for name, kind in KINDS.items() if kind.has(model, spec))


def describe_heads(model, spec) -> str:
    """What the model has beyond its hidden states, in words (error messages)."""
    heads = model.token_heads
    has = []
    if "mlm" in heads:
        has.append(
            "a masked-LM head"
            + ("" if spec.splade is not None else " (no SpladePooling module in modules.json, so not a SPLADE model)")
        )
    elif spec.splade is not None:
        has.append("a SpladePooling module but no masked-LM head weights")
    if spec.multi_vector is not None:
        has.append("a sentence-transformers MultiVectorEncoder (ColBERT) pipeline")
    else:
        has += [f"bge-m3's {h} ({h}.pt)" for h in ("sparse_linear", "colbert_linear") if h in heads]
    outputs = ", ".join(available_outputs(model, spec))
    return (
        f"{spec.name} ({spec.architecture or 'unknown architecture'}) has "
        + (", ".join(has) if has else "no per-token heads")
        + f"; its outputs: {outputs}"
    )


def check_outputs(names: tuple[str, ...], model, spec, purpose: str | None = None) -> None:
    """Raise ``ValueError`` for an output the model cannot give, naming what it needs and what the model has."""
    have = available_outputs(model, spec)
    for name in names:
        if name not in have:
            what = purpose or f"output={name!r}"
            raise ValueError(f"{what} needs {KINDS[name].needs}; {describe_heads(model, spec)}")


# --------------------------------------------------------------------------------------------------- methods
class Several(PoolingMethod):
    """Several methods over one step's hidden states: a tuple of their outputs, in order."""

    name = "several"

    def __init__(self, methods: list[PoolingMethod]):
        self.methods = list(methods)

    def __call__(self, hidden: torch.Tensor, meta: AttnMeta, pool_start: torch.Tensor | None) -> tuple:
        return tuple(m(hidden, meta, pool_start) for m in self.methods)

    def rows(self, lengths: list[int], pool_start: list[int]) -> np.ndarray | None:
        """The one row per sequence every method reads, or ``None`` when any reads more (or they differ)."""
        rows = [m.rows(lengths, pool_start) for m in self.methods]
        if any(r is None for r in rows) or any(not np.array_equal(rows[0], r) for r in rows[1:]):
            return None
        return rows[0]

    def from_rows(self, selected: torch.Tensor) -> tuple:
        return tuple(m.from_rows(selected) for m in self.methods)


class PerToken(PoolingMethod):
    """``fn`` on every row, then each sequence's pooled rows: a list of ``(L_i - pool_start_i, k)`` float32."""

    name = "per-token"

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        self.fn = fn

    def __call__(self, hidden: torch.Tensor, meta: AttnMeta, pool_start: torch.Tensor | None) -> list[torch.Tensor]:
        return pooling_method("tokens")(self.fn(hidden), meta, pool_start)


class SpladePool(PoolingMethod):
    """SPLADE over each sequence's pooled rows: ``(B, vocab)`` float32 of ``max`` (or ``sum``) over tokens of
    ``log(1 + relu(logits))`` (``log1p`` once more for ``log1p_relu``), the logits computed in row blocks of
    ``LOGIT_BLOCK_BYTES`` (module doc)."""

    name = "splade"

    def __init__(self, logits: Callable[[torch.Tensor], torch.Tensor], vocab: int, strategy: str, activation: str):
        self.logits, self.vocab, self.strategy, self.activation = logits, vocab, strategy, activation
        self.block = max(1, LOGIT_BLOCK_BYTES // (4 * vocab))

    def __call__(self, hidden: torch.Tensor, meta: AttnMeta, pool_start: torch.Tensor | None) -> torch.Tensor:
        ps = [0] * meta.num_seqs if pool_start is None else pool_start.tolist()
        ends = np.cumsum(meta.seqlens).tolist()
        spans = [(e - n + min(p, n), e) for n, p, e in zip(meta.seqlens, ps, ends)]  # pooled rows of each sequence
        out = torch.zeros(meta.num_seqs, self.vocab, dtype=torch.float32, device=hidden.device)
        first = 0  # the first sequence that may still overlap the block
        for s in range(0, hidden.shape[0], self.block):
            e = min(s + self.block, hidden.shape[0])
            x = self.logits(hidden[s:e]).float().relu_().log1p_()  # (rows, vocab)
            if self.activation == "log1p_relu":
                x.log1p_()
            while first < len(spans) and spans[first][1] <= s:
                first += 1
            for i in range(first, len(spans)):
                if spans[i][0] >= e:
                    break
                a, b = max(spans[i][0], s), min(spans[i][1], e)
                if a < b:  # every value is >= 0, so the zero start is exact for max too
                    part = x[a - s : b - s]
                    out[i] = torch.maximum(out[i], part.amax(0)) if self.strategy == "max" else out[i] + part.sum(0)
        return out


# ------------------------------------------------------------------------------------------------------ heads
def sparse_rows(pooled: torch.Tensor):
    """``(B, vocab)`` weights -> ``csr_matrix`` float32 of their nonzeros."""
    from scipy import sparse

    return sparse.csr_matrix(pooled.cpu().numpy().astype(np.float32, copy=False))


class SpladeHead(Head):
    """SPLADE's ``(B, vocab)`` weights (``SpladePool``) -> ``csr_matrix`` ``(B, vocab)`` float32 (``sparse_rows``)."""

    def __init__(self, vocab: int):
        self.shape = SparseShape(vocab)

    def __call__(self, pooled: torch.Tensor, requests: list | None):
        return sparse_rows(pooled)


class LexicalHead(Head):
    """bge-m3's lexical weights: per sequence, the largest positive weight of each token id among its pooled tokens,
    the ``drop`` ids (special tokens) left out -> ``csr_matrix`` ``(B, vocab)`` float32. Reads the requests' ids."""

    def __init__(self, vocab: int, drop: set[int]):
        self.shape = SparseShape(vocab)
        self.drop = np.asarray(sorted(drop), dtype=np.int64)

    def __call__(self, weights: list[torch.Tensor], requests: list) -> object:
        from scipy import sparse

        indptr, indices, data = [0], [], []
        for w, r in zip(weights, requests):
            ids = r.ids[r.pool_start :]
            w = w.reshape(-1).cpu().numpy()
            keep = (w > 0) & ~np.isin(ids, self.drop)
            uniq, inv = np.unique(ids[keep], return_inverse=True)
            best = np.zeros(len(uniq), dtype=np.float32)
            np.maximum.at(best, inv, w[keep])
            indices.append(uniq)
            data.append(best)
            indptr.append(indptr[-1] + len(uniq))
        return sparse.csr_matrix(
            (
                np.concatenate(data) if data else np.zeros(0, np.float32),
                np.concatenate(indices) if indices else np.zeros(0, np.int64),
                indptr,
            ),
            shape=(len(requests), self.shape.cols),
            dtype=np.float32,
        )


class ColbertHead(Head):
    """bge-m3's ColBERT vectors: each sequence's without its first token (CLS) when its pooled rows start there.
    Reads the requests' ``pool_start``."""

    shape = None

    def __call__(self, vectors: list[torch.Tensor], requests: list) -> list[torch.Tensor]:
        return [v[1:] if r.pool_start == 0 else v for v, r in zip(vectors, requests)]


@dataclass(frozen=True)
class Output:
    """One named output: a pooling method and a head."""

    method: PoolingMethod
    head: Head


class OutputHeads(Head):
    """The heads of several outputs over a ``Several`` method's tuple: a dict by name (one output: its value)."""

    def __init__(self, names: tuple[str, ...], outputs: list[Output], several: bool):
        self.names, self.outputs, self.several = names, outputs, several

    @property
    def shape(self):
        shapes = {n: o.head.shape for n, o in zip(self.names, self.outputs)}
        return shapes if self.several else shapes[self.names[0]]

    def __call__(self, pooled: tuple, requests: list):
        out = {n: o.head(p, requests) for n, o, p in zip(self.names, self.outputs, pooled)}
        return out if self.several else out[self.names[0]]


def output_pooler(output, dense: Pooler, *, model, spec, tokenizer, task: str | None = None) -> Pooler:
    """The pooler ``embed(texts, output=...)`` runs: ``dense`` itself for ``"dense"``, else a ``Several`` method with
    ``OutputHeads`` (``task``: a multi-vector folder's, ``lab.outputs.multivector``). Every check runs here, before
    any model work."""
    names, several = parse_output(output)
    check_outputs(names, model, spec)
    if names == ("dense",) and not several:
        return dense
    outputs = [KINDS[name].build(dense, model, spec, tokenizer, task) for name in names]
    return Pooler(Several([o.method for o in outputs]), OutputHeads(names, outputs, several))


def _colbert(dense: Pooler, model, spec, tokenizer, task: str | None) -> Output:
    mv = spec.multi_vector
    if mv is not None:
        return Output(
            PerToken(multivector.token_fn(model, mv)),
            multivector.ColbertRows(multivector.skip_ids(mv, tokenizer, task), mv.normalize),
        )
    return Output(
        PerToken(lambda h: F.normalize(model.token_head("colbert_linear", h).float(), dim=-1)), ColbertHead()
    )


def _sparse(dense: Pooler, model, spec, tokenizer, task: str | None) -> Output:
    vocab = model.config["vocab_size"]  # the width of the MLM logits and of bge-m3's lexical vectors
    if spec.splade is not None and "mlm" in model.token_heads:
        method = SpladePool(
            lambda h: model.token_head("mlm", h),
            vocab,
            spec.splade["pooling_strategy"],
            spec.splade["activation_function"],
        )
        return Output(method, SpladeHead(vocab))
    drop = {
        tokenizer.convert_tokens_to_ids(t)
        for t in (tokenizer.cls_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token)
        if t is not None
    }
    return Output(
        PerToken(lambda h: torch.relu(model.token_head("sparse_linear", h).float())), LexicalHead(vocab, drop)
    )


# ------------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class OutputKind:
    """One output ``embed(output=...)`` gives: ``has(model, spec)`` whether a model can give it, ``needs`` what it
    takes (in words, for the error when a model cannot), ``build(dense, model, spec, tokenizer, task)`` its
    ``Output`` (``dense``: the engine's own pooler)."""

    name: str
    has: Callable[[object, object], bool]
    build: Callable[..., Output]
    needs: str = ""


KINDS: dict[str, OutputKind] = {}  # name -> kind: the values of ``output=``, in the order errors list them


def register(kind: OutputKind) -> OutputKind:
    """Add ``kind`` to ``KINDS``: ``embed(output=kind.name)`` then gives it on the models ``kind.has``. Returns it."""
    if not isinstance(kind, OutputKind):
        raise TypeError(f"an output kind must be a lab.outputs.kinds.OutputKind, got {type(kind).__name__}")
    KINDS[kind.name] = kind
    return kind


register(OutputKind("dense", lambda model, spec: True, lambda dense, *_: Output(dense.method, dense.head)))
register(OutputKind("tokens", lambda model, spec: True, lambda *_: Output(pooling_method("tokens"), TokensHead())))
register(
    OutputKind(
        "sparse",
        lambda model, spec: (
            (spec.splade is not None and "mlm" in model.token_heads) or "sparse_linear" in model.token_heads
        ),
        _sparse,
        needs=(
            "a sparse head: SPLADE (a *ForMaskedLM folder whose sentence-transformers modules include SpladePooling) "
            "or bge-m3 (sparse_linear.pt beside the weights)"
        ),
    )
)
register(
    OutputKind(
        "colbert",
        lambda model, spec: (
            "colbert_linear" in model.token_heads  # a ColBERT folder's Dense loads as one
            or (spec.multi_vector is not None and spec.multi_vector.dense is None)
        ),
        _colbert,
        needs="a ColBERT head: bge-m3's colbert_linear.pt beside the weights, or a sentence-transformers "
        "MultiVectorEncoder folder (a MultiVectorMask module in modules.json)",
    )
)
