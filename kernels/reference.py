"""Torch references for every kernel in ``lab.kernels``: the test oracle and the CPU execution path.

Each function here has the same signature and semantics as its Triton twin (``attention.py``, ``pooling.py``,
``norms.py``, ``rotary.py``). They are written to be fast on CPU as well as obviously right:

- ``varlen_attention`` never builds a (total x total) mask. Packed sequences that share a length (and prefix
  length) form contiguous runs when the scheduler sorts by length; each run is a zero-copy view
  ``(n, L, H, D)`` handed to ``scaled_dot_product_attention`` without any mask.
- pooling works on segment ids (``cu_seqlens``) with ``index_add_`` in float32, no per-sequence Python for
  mean / weighted mean.

    >>> out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=True)   # q (T, Hq, D), k/v (T, Hkv, D)
    >>> emb = segment_pool(hidden, cu_seqlens, "mean")                          # (B, H) float32
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# the segment reductions these kernels implement (their own operations; the pooling methods a user names, and what
# each runs, are lab.outputs.pooling.METHODS)
SEGMENT_REDUCTIONS = ("cls", "mean", "max", "lasttoken", "weightedmean")


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
    causal_block: int | None = None,
    matmul_scores: int | None = None,
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
        causal_block: CPU only, causal runs without a prefix: sequences longer than three such blocks are computed
            ``causal_block`` queries at a time (``_causal_blocks``), skipping the keys no query of a block sees;
            the same function. Shorter sequences ran no faster that way (measured: evals/README.md, "Measurements
            behind the code's choices"). ``None`` (the default) runs each run as one call.
        matmul_scores: runs without a prefix (and not taken by ``causal_block``) as three ops, scores, softmax and
            weighted sum (``_matmul_attention``), over groups of sequences holding at most this many scores, instead
            of torch's fused kernel; the same function (a CPU probe's choice). A sequence with more scores than this
            (``Hq * L * L``) takes the fused kernel, whose memory does not grow with the square of the length.
            ``None`` (the default): the fused kernel for every run.

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
    cpu_flash = _FLASH_CPU is not None and q.device.type == "cpu"  # the merge paths below need its log-sum-exp
    runs = _runs(seqlens, prefix_lens)
    # each run's output as packed rows (n * L, Hq, D): the kernels write (n, L, H, D) memory, so a view; joined by
    # one ``torch.cat`` at the end rather than one copy per run into a preallocated output (the per-run copies, each
    # a parallel region of a few KB, took a sizeable share of a bfloat16 MiniLM call's profile; measured:
    # evals/README.md, "Measurements behind the code's choices")
    parts: list[torch.Tensor] = []
    starts = [0]
    for n in seqlens:
        starts.append(starts[-1] + n)
    pstarts = [0]
    for n in prefix_lens:
        pstarts.append(pstarts[-1] + n)
    # One call per run of equal (length, prefix length). Padding nearly-equal lengths into one masked call instead
    # ran slower on CPU at every mix tried, on the attention alone and end to end (the gathers, the scatter back and
    # the masked kernel cost more than the calls they save; measured: evals/README.md, "Measurements behind the
    # code's choices").
    for first, n, length, plen in runs:
        if length == 0:
            continue
        s, e = starts[first], starts[first + n]
        qg = q[s:e].view(n, length, hq, d).transpose(1, 2)  # (n, Hq, L, D)
        kg = k[s:e].view(n, length, hkv, d).transpose(1, 2)  # (n, Hkv, L, D)
        vg = v[s:e].view(n, length, hkv, d).transpose(1, 2)
        o, mask, is_causal = None, None, causal
        if plen:
            ps, pe = pstarts[first], pstarts[first + n]
            kp = k_prefix[ps:pe].view(n, plen, hkv, d).transpose(1, 2)
            vp = v_prefix[ps:pe].view(n, plen, hkv, d).transpose(1, 2)
            if causal and cpu_flash:
                o = _prefix_then_causal(qg, kp, vp, kg, vg, scale)
            else:
                kg, vg = torch.cat([kp, kg], dim=2), torch.cat([vp, vg], dim=2)  # (n, Hkv, P+L, D)
                if causal:
                    mask, is_causal = _causal_mask(length, plen, q.device), False
        elif causal and causal_block and length > 3 * causal_block and cpu_flash:
            o = _causal_blocks(qg, kg, vg, scale, causal_block)
        elif matmul_scores and 1 < length and hq * length * length <= matmul_scores:
            o = _matmul_attention(qg, kg, vg, scale, causal, matmul_scores)
        if o is None:
            if length == 1 and not plen:
                is_causal = False  # one query, one key: identical either way, and the cheaper path
            o = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
            )
        parts.append(o.transpose(1, 2).reshape(n * length, hq, d))
    if len(parts) == 1 and parts[0].shape[0] == q.shape[0]:  # one run: the kernel's memory is the packed layout
        return parts[0]
    return torch.cat(parts) if parts else torch.empty_like(q)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _causal_blocks(q, k, v, scale, block):
    """Causal attention ``block`` queries at a time: queries ``s:e`` attend to keys ``0:s`` (all visible) and
    ``s:e`` (causal), merged by ``_prefix_then_causal``. torch's CPU flash kernel splits keys into blocks of 512
    and masks inside a block, so under ~512 tokens it computes every query against every key; here a block's
    queries read only the keys before its end, about half the work on long sequences, and less time (measured:
    evals/README.md, "Measurements behind the code's choices").

    q ``(n, Hq, L, D)``, k/v ``(n, Hkv, L, D)`` -> ``(n, Hq, L, D)``, a view of ``(n, L, Hq, D)`` memory as the
    flash kernel's own output is.
    """
    n, hq, length, d = q.shape
    out = q.new_empty(n, length, hq, d).transpose(1, 2)
    out[:, :, :block] = F.scaled_dot_product_attention(
        q[:, :, :block], k[:, :, :block], v[:, :, :block], is_causal=True, scale=scale, enable_gqa=hq != k.shape[1]
    )
    for s in range(block, length, block):
        e = min(length, s + block)
        out[:, :, s:e] = _prefix_then_causal(q[:, :, s:e], k[:, :, :s], v[:, :, :s], k[:, :, s:e], v[:, :, s:e], scale)
    return out


def _matmul_attention(q, k, v, scale, causal, max_scores):
    """Attention as three ops per group of sequences (scores ``q k^T``, softmax, weighted sum of ``v``), each group
    holding at most ``max_scores`` scores (at least one sequence): few calls, bounded memory. Query heads sharing a
    key/value head broadcast against it (no copy of the keys per query head).

    Where this beats the fused kernel: in bfloat16 the two products run as native bfloat16 GEMMs (the fused CPU
    kernel computes in float32); on a CPU with AVX512-BF16 it took less time than the fused kernel in bfloat16 at
    every length measured, more or less in float32 by length (measured: evals/README.md, "Measurements behind the
    code's choices"). Scores and weights are
    rounded to the inputs' dtype (bfloat16: MiniLM's sentence embeddings moved by a cosine of ~1e-5, the size of
    what bfloat16 weights themselves move them by; but a decoder LLM's large, sharp logits suffer: SmolLM2
    bidirectional, the worst of 48 embeddings went from a cosine of 0.981 to the float32 engine to 0.939, so only
    encoders are offered this path, ``lab.ops.probes.attention_probe``).

    q ``(n, Hq, L, D)``, k/v ``(n, Hkv, L, D)`` -> ``(n, Hq, L, D)``, a view of ``(n, L, Hq, D)`` memory as the
    flash kernel's own output is.
    """
    n, hq, length, d = q.shape
    hkv = k.shape[1]
    out = q.new_empty(n, length, hq, d).transpose(1, 2)
    mask = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1) if causal else None
    group = max(1, max_scores // (hq * length * length))
    for s in range(0, n, group):
        e = min(n, s + group)
        qs = (q[s:e] * scale).view(e - s, hkv, hq // hkv, length, d)
        scores = torch.matmul(qs, k[s:e, :, None].transpose(-1, -2))  # (g, Hkv, rep, L, L)
        if mask is not None:
            scores.masked_fill_(mask, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v[s:e, :, None])
        out[s:e] = o.view(e - s, hq, length, d)
    return out


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
    pool_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool packed hidden states ``(total, H)`` per sequence into ``(B, H)`` float32 (not normalized: the
    embedding head, ``lab.outputs.heads.EmbeddingHead``, truncates and L2-normalizes afterwards).

    Args:
        method: one of ``cls``, ``mean``, ``max``, ``lasttoken``, ``weightedmean`` (sentence-transformers names;
            weighted mean weighs token ``t`` by its 1-based position within the pooled span, as SGPT).
        pool_start: ``(B,)`` int, tokens before this offset within a sequence are attended but not pooled
            (an instruction); ``cls`` then pools the first pooled token. Default 0.
    """
    if method not in SEGMENT_REDUCTIONS:
        raise ValueError(f"unknown pooling {method!r}; valid: {', '.join(SEGMENT_REDUCTIONS)}")
    total, _ = hidden.shape
    b = cu_seqlens.numel() - 1
    starts = cu_seqlens[:-1].long()
    ends = cu_seqlens[1:].long()
    if pool_start is not None:
        starts = torch.minimum(starts + pool_start.long(), ends)
    if method == "cls":
        return hidden[starts.clamp(max=max(total - 1, 0))].float()
    if method == "lasttoken":
        return hidden[(ends - 1).clamp(min=0)].float()
    seg = segment_ids(cu_seqlens, total)
    keep = torch.arange(total, device=hidden.device) >= starts[seg]
    if method == "max":
        pooled = torch.full((b, hidden.shape[1]), float("-inf"), device=hidden.device)
        h = hidden.float().masked_fill(~keep[:, None], float("-inf"))
        return pooled.scatter_reduce(0, seg[:, None].expand_as(h), h, reduce="amax")
    if method == "mean":
        w = keep.float()
    else:  # weightedmean: 1-based position within the pooled span
        pos = torch.arange(total, device=hidden.device) - starts[seg] + 1
        w = (pos * keep).float()
    pooled = torch.zeros(b, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    pooled.index_add_(0, seg, hidden.float() * w[:, None])
    denom = torch.zeros(b, dtype=torch.float32, device=hidden.device).index_add_(0, seg, w)
    return pooled / denom.clamp(min=1e-9)[:, None]


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
    # mean of squares from one reading pass (the norm), then one scaling pass into a fresh tensor and the weight in
    # place: faster on CPU than pow / mean / mul / mul, which each write a (T, hidden) temporary (measured:
    # evals/README.md, "Measurements behind the code's choices")
    inv_rms = torch.linalg.vector_norm(h, dim=-1, keepdim=True).square_().div_(h.shape[-1]).add_(eps).rsqrt_()
    y = (h.mul_(inv_rms) if h is not s else h * inv_rms).to(x.dtype)  # h.mul_ only on the copy of a narrower s
    if weight.dtype != y.dtype:  # e.g. float32 weights over float16 activations: promote, as transformers does
        return weight * y, s
    return y.mul_(weight), s


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
    # r1 = x1 c - x2 s, r2 = x2 c + x1 s with two temporaries, the rest in place: the same roundings as computing
    # r1 and r2 apart and copying them back, at half the memory traffic (faster on CPU; measured: evals/README.md,
    # "Measurements behind the code's choices")
    x2_s, x1_s = x2 * s, x1 * s
    x1.mul_(c).sub_(x2_s)
    x2.mul_(c).add_(x1_s)
    return x
