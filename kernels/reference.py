"""Torch references for every kernel in ``lab.kernels``: the test oracle and the CPU execution path.

Each function here has the same signature and semantics as its Triton twin (``attention.py``, ``pooling.py``,
``norms.py``, ``rotary.py``). They are written to be fast on CPU as well as obviously right:

- ``varlen_attention`` never builds a (total x total) mask. Packed sequences that share a length (and prefix
  length) form contiguous runs when the scheduler sorts by length; each run is a zero-copy view
  ``(n, L, H, D)`` handed to ``scaled_dot_product_attention`` without any mask.
- pooling works on segment ids (``cu_seqlens``) with ``index_add_`` in float32, no per-sequence Python for
  mean / weighted mean.

    >>> out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=True)   # q (T, Hq, D), k/v (T, Hkv, D)
    >>> emb = segment_pool(hidden, cu_seqlens, "mean", normalize=True)          # (B, H)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

POOLING_METHODS = ("cls", "mean", "max", "lasttoken", "weightedmean")


# --------------------------------------------------------------------------------------------------- attention
def _runs(seqlens: list[int], prefix_lens: list[int]) -> list[tuple[int, int, int, int]]:
    """Group consecutive sequences of equal (length, prefix length): (first_seq, n_seqs, length, prefix_len)."""
    runs: list[tuple[int, int, int, int]] = []
    i, b = 0, len(seqlens)
    while i < b:
        j = i + 1
        while j < b and seqlens[j] == seqlens[i] and prefix_lens[j] == prefix_lens[i]:
            j += 1
        runs.append((i, j - i, seqlens[i], prefix_lens[i]))
        i = j
    return runs


def _buckets(runs: list[tuple[int, int, int, int]], slack: int = 4, ratio: float = 1.125) -> list:
    """Merge consecutive runs of unequal but close lengths (``max <= ratio * min + slack``) into padded buckets,
    returned as ``(first_seq, -1, max_len, n_seqs)``; a run that stays alone keeps its zero-copy form. Few, larger
    attention calls beat many tiny ones (each call has a fixed cost), and the padding stays small."""
    out: list[tuple[int, int, int, int]] = []
    i = 0
    while i < len(runs):
        first, n, length, _ = runs[i]
        j, lo, hi, count = i + 1, length, length, n
        while j < len(runs) and runs[j][2] > 0:
            nl = runs[j][2]
            if max(hi, nl) > ratio * min(lo, nl) + slack:
                break
            lo, hi, count = min(lo, nl), max(hi, nl), count + runs[j][1]
            j += 1
        out.append(runs[i] if j == i + 1 else (first, -1, hi, count))
        i = j
    return out


def _causal_mask(q_len: int, prefix_len: int, device: torch.device) -> torch.Tensor:
    """Boolean (q_len, prefix_len + q_len) mask: query j sees every prefix key and its own keys 0..j."""
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(prefix_len + q_len, device=device)[None, :]
    return cols <= rows + prefix_len


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool,
    scale: float | None = None,
    k_prefix: torch.Tensor | None = None,
    v_prefix: torch.Tensor | None = None,
    cu_prefix: torch.Tensor | None = None,
    seqlens: list[int] | None = None,
    prefix_lens: list[int] | None = None,
) -> torch.Tensor:
    """Attention within each packed sequence (flash-attn ``varlen`` layout).

    Args:
        q: ``(total, Hq, D)``; k, v: ``(total, Hkv, D)`` with ``Hq % Hkv == 0`` (grouped-query attention).
        cu_seqlens: ``(B + 1,)`` int32, sequence ``i`` owns rows ``cu_seqlens[i]:cu_seqlens[i+1]``.
        max_seqlen: longest sequence (unused here; kept for signature parity with the kernel).
        causal: query ``j`` of a sequence sees its keys ``0..j`` (plus its whole prefix); else all its keys.
        scale: softmax scale, default ``D ** -0.5``.
        k_prefix, v_prefix: ``(total_prefix, Hkv, D)`` cached keys/values of earlier tokens of each sequence
            (chunked prefill, prefix cache), laid out by ``cu_prefix`` ``(B + 1,)`` int32. Always fully visible.
        seqlens, prefix_lens: host copies of the lengths, when the caller has them (saves a device sync).

    Returns:
        ``(total, Hq, D)`` in ``q.dtype``.
    """
    _, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if seqlens is None:
        seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    has_prefix = k_prefix is not None
    if has_prefix and prefix_lens is None:
        prefix_lens = (cu_prefix[1:] - cu_prefix[:-1]).tolist()
    if not has_prefix:
        prefix_lens = [0] * len(seqlens)
    scale = d**-0.5 if scale is None else scale
    gqa = hq != hkv
    out = torch.empty_like(q)
    starts = [0]
    for n in seqlens:
        starts.append(starts[-1] + n)
    pstarts = [0]
    for n in prefix_lens:
        pstarts.append(pstarts[-1] + n)
    runs = _runs(seqlens, prefix_lens) if has_prefix else _buckets(_runs(seqlens, prefix_lens))
    for first, n, length, plen in runs:
        if length == 0:
            continue
        if n == -1:  # a bucket of nearly equal lengths, padded for one call (see _buckets)
            _padded_bucket(q, k, v, out, starts, seqlens, first, plen, causal, scale, gqa)  # plen = count here
            continue
        s, e = starts[first], starts[first + n]
        qg = q[s:e].view(n, length, hq, d).transpose(1, 2)  # (n, Hq, L, D)
        kg = k[s:e].view(n, length, hkv, d).transpose(1, 2)  # (n, Hkv, L, D)
        vg = v[s:e].view(n, length, hkv, d).transpose(1, 2)
        mask, is_causal = None, causal
        if plen:
            ps, pe = pstarts[first], pstarts[first + n]
            kp = k_prefix[ps:pe].view(n, plen, hkv, d).transpose(1, 2)
            vp = v_prefix[ps:pe].view(n, plen, hkv, d).transpose(1, 2)
            if causal and _FLASH_CPU is not None and q.device.type == "cpu":
                o = _prefix_then_causal(qg, kp, vp, kg, vg, scale)
                out[s:e].view(n, length, hq, d).copy_(o.transpose(1, 2))
                continue
            kg, vg = torch.cat([kp, kg], dim=2), torch.cat([vp, vg], dim=2)  # (n, Hkv, P+L, D)
            if causal:
                mask, is_causal = _causal_mask(length, plen, q.device), False
        if length == 1 and not plen:
            is_causal = False  # one query, one key: identical either way, and the cheaper path
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        out[s:e].view(n, length, hq, d).copy_(o.transpose(1, 2))
    return out


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefix_then_causal(q, kp, vp, k, v, scale):
    """Causal attention over ``[prefix (fully visible), own keys (causal)]`` as two flash calls merged by their
    log-sum-exp (the flash-decoding merge): no ``(L, P + L)`` mask, and the prefix keys are read in place instead of
    being joined to the chunk's — a chunk's step allocates nothing that grows with the prefix.

    q ``(n, Hq, L, D)``; kp/vp ``(n, Hkv, P, D)``; k/v ``(n, Hkv, L, D)`` -> ``(n, Hq, L, D)``.
    """
    n, hq, length, d = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    # query heads sharing a K/V head, stacked along the query axis: legal for the prefix, which every query sees
    o1, l1 = _FLASH_CPU(q.reshape(n, hkv, rep * length, d), kp, vp, 0.0, False, scale=scale)
    if rep > 1:  # chunk-sized copies
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o2, l2 = _FLASH_CPU(q, k, v, 0.0, True, scale=scale)
    l1 = l1.reshape(n, hq, length)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp_()[..., None], (l2 - m).exp_()[..., None]
    o = o1.reshape(n, hq, length, d).float().mul_(w1).add_(o2.float().mul_(w2)).div_(w1 + w2)
    return o.to(q.dtype)


def _padded_bucket(q, k, v, out, starts, seqlens, first, count, causal, scale, gqa) -> None:
    """One attention call for ``count`` consecutive sequences of nearly equal length: gather them into a padded
    ``(n, Hq, Lmax, D)`` block (padding only here, never in the GEMMs), mask the padded keys, scatter back."""
    lens = seqlens[first : first + count]
    lmax = max(lens)
    dev = q.device
    lens_t = torch.tensor(lens, device=dev)[:, None]
    pos = torch.arange(lmax, device=dev)[None, :]
    valid = pos < lens_t  # (n, Lmax)
    base = torch.tensor(starts[first : first + count], device=dev)[:, None]
    idx = (base + torch.minimum(pos, lens_t - 1)).reshape(-1)  # padded slots read their sequence's last token
    n, hq, hkv, d = count, q.shape[1], k.shape[1], q.shape[2]
    qg = q.index_select(0, idx).view(n, lmax, hq, d).transpose(1, 2)
    kg = k.index_select(0, idx).view(n, lmax, hkv, d).transpose(1, 2)
    vg = v.index_select(0, idx).view(n, lmax, hkv, d).transpose(1, 2)
    # causal: padding sits after every real key, so the causal rule already hides it; else mask padded keys
    mask = None if causal else valid[:, None, None, :]
    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    s, e = starts[first], starts[first + count]
    out[s:e] = o.transpose(1, 2).reshape(n * lmax, hq, d)[valid.reshape(-1)]


def varlen_attention_naive(q, k, v, cu_seqlens, *, causal, scale=None, k_prefix=None, v_prefix=None, cu_prefix=None):
    """Per-sequence, explicit-softmax attention in float32: the slow, obvious oracle for the other two."""
    total, hq, d = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(total, hq, d, dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    cp = cu_prefix.tolist() if cu_prefix is not None else [0] * len(cu)
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        if e == s:
            continue
        qi = q[s:e].float().transpose(0, 1)  # (Hq, L, D)
        ki, vi = k[s:e].float(), v[s:e].float()
        plen = cp[i + 1] - cp[i]
        if plen:
            ki = torch.cat([k_prefix[cp[i] : cp[i + 1]].float(), ki])
            vi = torch.cat([v_prefix[cp[i] : cp[i + 1]].float(), vi])
        ki = ki.repeat_interleave(rep, dim=1).transpose(0, 1)  # (Hq, P+L, D)
        vi = vi.repeat_interleave(rep, dim=1).transpose(0, 1)
        scores = qi @ ki.transpose(1, 2) * scale  # (Hq, L, P+L)
        if causal:
            scores = scores.masked_fill(~_causal_mask(e - s, plen, q.device), float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vi).transpose(0, 1)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------------- pooling
def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) int64: the sequence index of every packed token."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


def segment_pool(
    hidden: torch.Tensor,
    cu_seqlens: torch.Tensor,
    method: str,
    *,
    normalize: bool = False,
    pool_start: torch.Tensor | None = None,
    weight_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool packed hidden states ``(total, H)`` per sequence into ``(B, H)`` float32.

    Args:
        method: one of ``cls``, ``mean``, ``max``, ``lasttoken``, ``weightedmean`` (sentence-transformers names;
            weighted mean weighs token ``t`` by its 1-based position, as SGPT).
        pool_start: ``(B,)`` int, tokens before this offset within a sequence are attended but not pooled
            (an instruction); ``cls`` then pools the first pooled token. Default 0.
        weight_offset: ``(B,)`` int added to the 1-based position weights (a chunk that continues earlier
            chunks); default 0.
        normalize: L2-normalize each pooled row.
    """
    if method not in POOLING_METHODS:
        raise ValueError(f"unknown pooling {method!r}; valid: {', '.join(POOLING_METHODS)}")
    total, _ = hidden.shape
    b = cu_seqlens.numel() - 1
    starts = cu_seqlens[:-1].long()
    ends = cu_seqlens[1:].long()
    if pool_start is not None:
        starts = torch.minimum(starts + pool_start.long(), ends)
    if method == "cls":
        pooled = hidden[starts.clamp(max=max(total - 1, 0))].float()
    elif method == "lasttoken":
        pooled = hidden[(ends - 1).clamp(min=0)].float()
    else:
        seg = segment_ids(cu_seqlens, total)
        keep = torch.arange(total, device=hidden.device) >= starts[seg]
        if method == "max":
            pooled = torch.full((b, hidden.shape[1]), float("-inf"), device=hidden.device)
            h = hidden.float().masked_fill(~keep[:, None], float("-inf"))
            pooled = pooled.scatter_reduce(0, seg[:, None].expand_as(h), h, reduce="amax")
        else:
            if method == "mean":
                w = keep.float()
            else:  # weightedmean: 1-based position within the pooled span (+ offset from earlier chunks)
                pos = torch.arange(total, device=hidden.device) - starts[seg] + 1
                if weight_offset is not None:
                    pos = pos + weight_offset.long()[seg]
                w = (pos * keep).float()
            pooled = torch.zeros(b, hidden.shape[1], dtype=torch.float32, device=hidden.device)
            pooled.index_add_(0, seg, hidden.float() * w[:, None])
            denom = torch.zeros(b, dtype=torch.float32, device=hidden.device).index_add_(0, seg, w)
            pooled = pooled / denom.clamp(min=1e-9)[:, None]
    if normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled


# ------------------------------------------------------------------------------------------------------- norms
def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """``LayerNorm(x + residual)`` (BERT's post-norm); ``residual=None`` means plain LayerNorm."""
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm step of Llama-style blocks: ``s = x + residual``; returns ``(RMSNorm(s) * weight, s)``.

    The norm is computed in float32 and cast back, as transformers' ``LlamaRMSNorm`` does.
    """
    s = x if residual is None else x + residual
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), s


# ------------------------------------------------------------------------------------------------------ rotary
def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, D/2)`` cos and sin of ``positions x inv_freq`` (computed in float32)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return (freqs.cos() * attention_scaling).to(dtype), (freqs.sin() * attention_scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, H, D)`` in place, NeoX / Llama layout (first half, second half); returns ``x``.

    ``cos``/``sin`` are ``(T, D/2)`` for each token's position.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    r1 = x1 * c - x2 * s
    r2 = x2 * c + x1 * s
    x1.copy_(r1)
    x2.copy_(r2)
    return x
