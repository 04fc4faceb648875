"""What the runner hands a model: flat tokens plus attention metadata. Models never see the batch layout.

``AttnMeta`` mirrors flash-attn's varlen arguments (``cu_seqlens`` int32 ``(B+1,)``, ``max_seqlen``) plus the
``causal`` flag — the bidirectional toggle is data, not a model subclass. ``KVStep`` carries cached keys/values
of earlier tokens (chunked prefill, prefix cache) into one step and collects this step's keys/values out of it.

    >>> meta = AttnMeta.from_lengths([3, 1, 5], causal=False)
    >>> hidden = model(input_ids, positions, meta)          # (9, hidden)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class KVStep:
    """Per-layer K/V context for one forward step.

    ``prefix_k[layer]`` / ``prefix_v[layer]``: ``(total_prefix, Hkv, D)`` keys/values of tokens that precede each
    sequence of this step, laid out by ``cu_prefix`` (``prefix_lens[i]`` tokens for sequence ``i``, possibly 0);
    any object indexable by layer (built lazily by ``lab.engine.kv_path``, one layer at a time).
    ``capture(layer, k, v)``, when set, receives this step's ``(T, Hkv, D)`` keys/values of every layer as the
    attention call sees them (after RoPE); it must copy what it keeps, since they are views of the layer's buffers.
    """

    num_layers: int
    cu_prefix: torch.Tensor | None = None
    prefix_lens: list[int] | None = None
    prefix_k: Sequence[torch.Tensor] | None = None
    prefix_v: Sequence[torch.Tensor] | None = None
    capture: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    @property
    def has_prefix(self) -> bool:
        return self.prefix_k is not None and bool(self.prefix_lens) and any(self.prefix_lens)


@dataclass
class AttnMeta:
    """Attention metadata for one packed step.

    Attributes:
        cu_seqlens: ``(B + 1,)`` int32 cumulative sequence lengths on the model's device.
        max_seqlen: the longest sequence in the step.
        causal: causal (decoder) or bidirectional attention within each sequence.
        seqlens: host copy of the B lengths (grouping on CPU without a device sync).
        backend: ``"torch"`` or ``"triton"``: which kernels the layers call.
        kv: cached prefix keys/values and capture of this step's, or ``None`` for a plain prefill.
        key_lens: per sequence, how many of its leading tokens every token of it may attend to (``None``: all of
            them). ColBERT's query expansion without ``attend``: the appended ``[MASK]`` tokens are queries only,
            never keys (``lab.outputs.multivector``).
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    causal: bool
    seqlens: list[int]
    backend: str = "torch"
    kv: KVStep | None = None
    key_lens: list[int] | None = None

    @classmethod
    def from_lengths(
        cls,
        lengths: list[int],
        *,
        causal: bool,
        device: torch.device | str = "cpu",
        backend: str = "torch",
        kv: KVStep | None = None,
        key_lens: list[int] | None = None,
    ) -> AttnMeta:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return cls(
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            max_seqlen=max(lengths, default=0),
            causal=causal,
            seqlens=list(lengths),
            backend=backend,
            kv=kv,
            key_lens=None if key_lens is None or list(key_lens) == list(lengths) else list(key_lens),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens)

    @property
    def num_tokens(self) -> int:
        return sum(self.seqlens)


@dataclass
class OutputRows:
    """One row per sequence whose final hidden state a step needs (what ``cls`` / ``lasttoken`` pooling reads).

    A model's last layer then computes queries, attention, output projection and MLP for these rows alone; keys and
    values still come from every row. ``others`` are the rows each selected row attends to besides itself (earlier
    rows under causal attention, every other row of its sequence under bidirectional attention), laid out per
    sequence by ``cu_others``. Attention sees them as a fully visible prefix of a one-token sequence: exact, since
    attention does not depend on the order of its keys once RoPE has placed them.

        >>> sel = OutputRows.build(meta, rows=np.array([4, 9]))    # two sequences of 5 tokens, lasttoken
    """

    rows: torch.Tensor  # (B,) int64
    others: torch.Tensor  # (P,) int64
    cu_others: torch.Tensor  # (B + 1,) int32
    others_lens: list[int]

    @classmethod
    def build(cls, meta: AttnMeta, rows, device: torch.device | str = "cpu") -> OutputRows:
        """``rows``: ``(B,)`` integer array, the packed row each sequence of ``meta`` keeps."""
        import numpy as np

        rows = np.asarray(rows, dtype=np.int64)
        lengths = np.asarray(meta.seqlens, dtype=np.int64)
        seg = np.repeat(np.arange(len(lengths)), lengths)
        t = np.arange(len(seg), dtype=np.int64)
        keep = t < rows[seg] if meta.causal else t != rows[seg]
        lens = np.bincount(seg[keep], minlength=len(lengths))
        cu = np.concatenate([[0], np.cumsum(lens)])
        return cls(
            rows=torch.from_numpy(rows).to(device),
            others=torch.from_numpy(t[keep]).to(device),
            cu_others=torch.from_numpy(cu.astype(np.int32)).to(device),
            others_lens=lens.tolist(),
        )

    def step_meta(self, meta: AttnMeta, layer: int, k: torch.Tensor, v: torch.Tensor) -> AttnMeta:
        """The selected rows' attention at ``layer``: one query per sequence, ``others``' keys/values (rows of the
        layer's ``(T, Hkv, D)`` ``k`` / ``v``) as its prefix."""
        kv = KVStep(
            num_layers=layer + 1,
            cu_prefix=self.cu_others,
            prefix_lens=self.others_lens,
            prefix_k={layer: k[self.others]},
            prefix_v={layer: v[self.others]},
        )
        return AttnMeta.from_lengths(
            [1] * len(self.others_lens), causal=meta.causal, device=self.rows.device, backend=meta.backend, kv=kv
        )


@dataclass
class PackedBatch:
    """Flat model inputs for one step: every sequence's tokens back to back, no padding."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, position of each token within its sequence (+ its offset)
    token_type_ids: torch.Tensor | None  # (T,) int64 or None when all zero
    meta: AttnMeta
    pool_start: torch.Tensor | None  # (B,) int64 tokens excluded from pooling at each sequence's front
    pool_end: list[int] | None = None  # per sequence, where its pooled span ends (None: every span runs to the end)

    @classmethod
    def build(
        cls,
        ids: list,
        *,
        causal: bool,
        device: torch.device,
        backend: str = "torch",
        token_type_ids=None,
        pool_start: list[int] | None = None,
        position_offsets: list[int] | None = None,
        kv: KVStep | None = None,
        key_lens: list[int | None] | None = None,
        pool_end: list[int | None] | None = None,
    ) -> PackedBatch:
        """Pack per-sequence arrays of token ids (numpy int64) into flat tensors with their metadata (``key_lens``:
        ``AttnMeta``'s, ``None`` entries meaning the whole sequence; ``pool_end``: where each pooled span ends within
        its sequence, ``None`` entries meaning its end)."""
        import numpy as np

        lengths = [len(x) for x in ids]
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        starts = np.cumsum([0] + lengths[:-1])
        offsets = np.zeros(len(lengths), dtype=np.int64) if position_offsets is None else np.asarray(position_offsets)
        # position of token t = t - start(seq) + offset(seq), without a Python loop over tokens
        pos = np.arange(len(flat), dtype=np.int64) - np.repeat(starts - offsets, lengths)
        types = None
        if token_type_ids is not None and any(t is not None and t.any() for t in token_type_ids):
            types = torch.from_numpy(np.concatenate(token_type_ids)).to(device)
        ps = None
        if pool_start is not None and any(pool_start):
            ps = torch.tensor(pool_start, dtype=torch.int64, device=device)
        return cls(
            input_ids=torch.from_numpy(flat).to(device),
            positions=torch.from_numpy(pos).to(device),
            token_type_ids=types,
            meta=AttnMeta.from_lengths(
                lengths,
                causal=causal,
                device=device,
                backend=backend,
                kv=kv,
                key_lens=None if key_lens is None else [n if k is None else k for n, k in zip(lengths, key_lens)],
            ),
            pool_start=ps,
            pool_end=None
            if pool_end is None or all(e is None for e in pool_end)
            else [n if e is None else e for n, e in zip(lengths, pool_end)],
        )
