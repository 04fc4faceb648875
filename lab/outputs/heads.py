"""Heads: what pooled rows become (the "head" half of a pooler; ``lab.outputs.pooling`` holds the methods).

One protocol for every head: a ``Head`` is called ``head(pooled, requests)`` and has a ``shape``.

- ``pooled``: what the pooling method gave for one packed step (``(B, H)`` float32, or a list of B per-token
  tensors, or a ``Several`` method's tuple of these);
- ``requests``: the step's ``Request`` objects, aligned with ``pooled``'s rows, which heads reading token ids use
  (bge-m3's lexical weights, ColBERT skiplists); ``None`` where the rows are no step's (the engine's embedding head
  over windows averaged per input or over late chunks), which only heads that read no ids accept;
- ``shape``: the per-row shape of the output (``OutputBuffer`` reads it), ``None`` for ragged per-token outputs, a
  ``SparseShape`` for sparse rows, a dict of these for several outputs.

Every head returns float32. The heads here:

- ``EmbeddingHead``: matryoshka truncation, then L2 normalize (so truncated vectors are unit length).
- ``ClassifierHead``: a model's sequence-classification head over the pooled (first-token) rows, then an
  activation: cross-encoder scores.
- ``YesNoHead``: ``logit(yes) - logit(no)`` of the LM head at the pooled (last-token) rows, then an activation
  (``sigmoid`` gives the yes probability, ``softmax`` over the two logits): LLM rerankers.
- ``TokensHead``: per-token rows as they are (``pooling="tokens"``).

Sparse lexical vectors and ColBERT vectors have their heads in ``lab.outputs.kinds`` (and
``lab.outputs.multivector``), where ``OutputHeads`` runs several heads over one forward's ``Several`` method.

A ``Pooler`` pairs a method with a head; the executor runs the method per packed step and the head on its output
(``Pooler.outputs``). Adding a head: subclass ``Head`` (``__call__(pooled, requests)`` and ``shape``) and pair it
with a method in a ``Pooler``.

    >>> pooler = Pooler(pooling_method("mean"), EmbeddingHead(dim=384, truncate_dim=128, normalize=True))
    >>> pooler.outputs(pooled, requests)                    # (B, 128) float32
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lab.outputs.pooling import PoolingMethod

ACTIVATIONS = ("sigmoid", "softmax", "tanh", None)


def activate(raw: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``raw`` float32 ``(N,)`` or ``(N, L)``; softmax runs over the last (label) axis."""
    if activation is None:
        return raw
    if activation == "sigmoid":
        return torch.sigmoid(raw)
    if activation == "tanh":
        return torch.tanh(raw)
    if activation == "softmax":
        if raw.ndim < 2 or raw.shape[-1] < 2:
            raise ValueError("activation='softmax' needs several scores per pair (a model with several labels)")
        return torch.softmax(raw, dim=-1)
    raise ValueError(f"unknown activation {activation!r}; valid: {', '.join(map(repr, ACTIVATIONS))}")


@dataclass(frozen=True)
class SparseShape:
    """The shape of a head whose rows are sparse: ``cols`` columns (a vocabulary), gathered into a
    ``scipy.sparse.csr_matrix`` ``(N, cols)``."""

    cols: int


class Head:
    """The one head protocol (module doc): ``head(pooled, requests)`` -> outputs, ``shape`` their per-row shape."""

    shape: tuple | SparseShape | dict | None = None

    def __call__(self, pooled, requests: list | None):
        raise NotImplementedError


class EmbeddingHead(Head):
    """``(B, H)`` -> ``(B, truncate_dim or H)`` float32: matryoshka slice, then L2 normalize."""

    def __init__(self, dim: int, *, truncate_dim: int | None = None, normalize: bool = False):
        if truncate_dim is not None and truncate_dim > dim:
            raise ValueError(f"truncate_dim={truncate_dim} exceeds the embedding size {dim}")
        self.truncate_dim, self.normalize = truncate_dim, normalize
        self.shape = (truncate_dim or dim,)

    def __call__(self, pooled: torch.Tensor, requests: list | None) -> torch.Tensor:
        if self.truncate_dim is not None:
            pooled = pooled[:, : self.truncate_dim]
        if self.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled


class TokensHead(Head):
    """Per-token outputs unchanged: a list of ``(L_i, H)`` float32 tensors."""

    shape = None

    def __call__(self, pooled: list[torch.Tensor], requests: list | None) -> list[torch.Tensor]:
        return pooled


class ClassifierHead(Head):
    """``classifier(pooled)`` -> ``(B, num_labels)`` float32 logits, then ``activation``."""

    def __init__(self, classifier: nn.Module, num_labels: int, activation: str | None = None):
        if activation == "softmax" and num_labels < 2:
            raise ValueError("activation='softmax' needs several scores per pair; this model has one label")
        self.classifier, self.activation = classifier, activation
        self.shape = (num_labels,)

    def __call__(self, pooled: torch.Tensor, requests: list | None) -> torch.Tensor:
        dtype = next(self.classifier.parameters()).dtype
        return activate(self.classifier(pooled.to(dtype)).float(), self.activation)


class YesNoHead(Head):
    """``lm_logits(pooled)[yes] - lm_logits(pooled)[no]`` -> ``(B,)`` float32, then ``activation`` (``sigmoid``:
    ``softmax(logit_yes, logit_no)[yes]``, as Qwen3-Reranker computes it)."""

    shape = ()

    def __init__(self, lm_logits, yes_id: int, no_id: int, activation: str | None = "sigmoid"):
        if activation == "softmax":
            raise ValueError(
                "activation='softmax' needs several scores per pair; the LLM yes/no score is one "
                "(use 'sigmoid' for P(yes))"
            )
        self.lm_logits, self.ids, self.activation = lm_logits, [yes_id, no_id], activation

    def __call__(self, pooled: torch.Tensor, requests: list | None) -> torch.Tensor:
        yes_no = self.lm_logits(pooled, self.ids).float()  # (B, 2)
        return activate(yes_no[:, 0] - yes_no[:, 1], self.activation)


@dataclass(frozen=True)
class Pooler:
    """Method x head: the method reduces each packed step's rows, the head turns the result into outputs."""

    method: PoolingMethod
    head: Head

    def __post_init__(self):
        if not isinstance(self.head, Head):
            raise TypeError(
                f"Pooler's head must be a lab.outputs.heads.Head (a subclass with __call__(pooled, "
                f"requests) and shape), got {type(self.head).__name__}; subclass Head"
            )

    @property
    def shape(self):
        """The per-row shape of the outputs (``OutputBuffer`` reads it): the head's."""
        return self.head.shape

    def outputs(self, pooled, requests: list) -> object:
        """The outputs of one step's ``pooled`` rows, aligned with ``requests`` (the step's ``Request`` objects)."""
        return self.head(pooled, requests)
