"""Varlen flash attention in Triton: must match ``lab.kernels.reference.varlen_attention``.

FlashAttention-2 forward (Dao, 2023) over packed sequences: one program per (query block, query head, sequence),
an online softmax over key blocks in float32 (base-2 exponent, the scale folded into one multiply), never a
``T x T`` score matrix. Grouped-query attention maps query head ``h`` to key/value head ``h // (Hq // Hkv)``.
Head dims that are not powers of two (48, 80, 96, ...) pad the block to the next power of two under a mask.
An optional prefix (cached K/V of each sequence's earlier tokens, laid out by ``cu_prefix``) is visited first and
is fully visible to every query, causal or not.

    >>> out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal=True)   # q (T, Hq, D), k/v (T, Hkv, D)
    >>> out = varlen_attention(q, k, v, cu, n, causal=True, k_prefix=kp, v_prefix=vp, cu_prefix=cp)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_device

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@triton.jit
def _attend(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    lo,
    hi,
    n_keys,
    rows,
    offs_n,
    offs_d,
    head_dim,
    qk_scale,
    CAUSAL_MASK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold keys ``lo..hi`` (block-aligned, ``< n_keys`` enforced by mask) into the running softmax state."""
    d_mask = offs_d < head_dim
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key index within this key range
        kv_mask = (cols < n_keys)[:, None] & d_mask[None, :]
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        valid = (cols < n_keys)[None, :]
        if CAUSAL_MASK:
            valid = valid & (cols[None, :] <= rows[:, None])
        s = tl.where(valid, s, float("-inf"))
        # the first block always holds key 0, visible to every row, so m_new is finite from then on
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _varlen_attention_kernel(
    Q,
    K,
    V,
    O,
    KP,
    VP,
    CU,
    CU_P,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kpt,
    stride_kph,
    stride_vpt,
    stride_vph,
    head_dim,
    group,
    qk_scale,
    CAUSAL: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(CU + seq).to(tl.int64)
    seq_len = (tl.load(CU + seq + 1) - tl.load(CU + seq)).to(tl.int32)
    m_start = pid_m * BLOCK_M
    if m_start >= seq_len:  # grid is sized by the longest sequence
        return
    kv_head = head // group

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = m_start + offs_m  # (BLOCK_M,) query index within the sequence
    row_mask = rows < seq_len
    d_mask = offs_d < head_dim
    q_ptrs = Q + (start + rows[:, None].to(tl.int64)) * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    if HAS_PREFIX:  # earlier tokens of this sequence: every query sees all of them
        p_start = tl.load(CU_P + seq).to(tl.int64)
        p_len = (tl.load(CU_P + seq + 1) - tl.load(CU_P + seq)).to(tl.int32)
        kp_base = KP + p_start * stride_kpt + kv_head * stride_kph
        vp_base = VP + p_start * stride_vpt + kv_head * stride_vph
        acc, m_i, l_i = _attend(
            acc,
            m_i,
            l_i,
            q,
            kp_base,
            vp_base,
            stride_kpt,
            stride_vpt,
            0,
            p_len,
            p_len,
            rows,
            offs_n,
            offs_d,
            head_dim,
            qk_scale,
            False,
            BLOCK_N,
            DOT_PRECISION,
        )

    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh
    if CAUSAL:
        # keys before this query block are visible to all its rows (BLOCK_M is a multiple of BLOCK_N) ...
        acc, m_i, l_i = _attend(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            0,
            m_start,
            seq_len,
            rows,
            offs_n,
            offs_d,
            head_dim,
            qk_scale,
            False,
            BLOCK_N,
            DOT_PRECISION,
        )
        # ... and the diagonal blocks need the triangle mask
        hi = tl.minimum(m_start + BLOCK_M, seq_len)
        acc, m_i, l_i = _attend(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            m_start,
            hi,
            seq_len,
            rows,
            offs_n,
            offs_d,
            head_dim,
            qk_scale,
            True,
            BLOCK_N,
            DOT_PRECISION,
        )
    else:
        acc, m_i, l_i = _attend(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            0,
            seq_len,
            seq_len,
            rows,
            offs_n,
            offs_d,
            head_dim,
            qk_scale,
            False,
            BLOCK_N,
            DOT_PRECISION,
        )

    out = acc / l_i[:, None]
    o_ptrs = O + (start + rows[:, None].to(tl.int64)) * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _pick_blocks(max_seqlen: int, block_d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): short batches get small query blocks; fp32 halves the tiles."""
    if dtype == torch.float32:
        block_m, block_n, stages = 64, 32, 2
    else:
        block_m, block_n, stages = 128, 64, 3 if block_d <= 128 else 2
    block_m = max(16, min(block_m, triton.next_power_of_2(max(max_seqlen, 1))))
    block_n = min(block_n, block_m)  # BLOCK_M must stay a multiple of BLOCK_N (causal split)
    warps = 8 if block_m >= 128 and block_d >= 128 else 4
    return block_m, block_n, warps, stages


def _check(name: str, t: torch.Tensor, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    check_device(name, t)
    return t if ndim == 1 or t.stride(-1) == 1 else t.contiguous()


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
    """Attention within each packed sequence; same arguments and result as ``reference.varlen_attention``.

    ``max_seqlen`` must be at least the longest sequence (it sizes the grid). ``seqlens`` / ``prefix_lens``
    are host-side hints the kernel does not need. Returns ``(total, Hq, D)`` in ``q.dtype``.
    """
    q, k, v = _check("q", q, 3), _check("k", k, 3), _check("v", v, 3)
    total, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != v.shape or k.shape[0] != total or k.shape[2] != d:
        raise ValueError(f"k and v must be (total={total}, Hkv, D={d}); got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of {_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} not supported (1..{MAX_HEAD_DIM})")
    cu_seqlens = _check("cu_seqlens", cu_seqlens, 1)
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be a (B + 1,) int32 tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    has_prefix = k_prefix is not None
    if has_prefix:
        if v_prefix is None or cu_prefix is None:
            raise ValueError("k_prefix needs v_prefix and cu_prefix")
        k_prefix, v_prefix = _check("k_prefix", k_prefix, 3), _check("v_prefix", v_prefix, 3)
        cu_prefix = _check("cu_prefix", cu_prefix, 1)
        if k_prefix.shape != v_prefix.shape or k_prefix.shape[1:] != (hkv, d):
            raise ValueError(
                f"k_prefix/v_prefix must be (total_prefix, Hkv={hkv}, D={d}); got {tuple(k_prefix.shape)}, "
                f"{tuple(v_prefix.shape)}"
            )
        if k_prefix.dtype != q.dtype or v_prefix.dtype != q.dtype:
            raise ValueError(f"k_prefix/v_prefix must be {q.dtype}, got {k_prefix.dtype}, {v_prefix.dtype}")
        if cu_prefix.shape != cu_seqlens.shape or cu_prefix.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_prefix must be an int tensor shaped like cu_seqlens {tuple(cu_seqlens.shape)}")
    else:
        k_prefix, v_prefix, cu_prefix = k, v, cu_seqlens  # placeholders, never read (HAS_PREFIX=False)

    out = torch.empty((total, hq, d), dtype=q.dtype, device=q.device)
    batch = cu_seqlens.numel() - 1
    if total == 0 or batch == 0 or max_seqlen <= 0:
        return out
    scale = d**-0.5 if scale is None else float(scale)
    block_d = max(16, triton.next_power_of_2(d))
    block_m, block_n, warps, stages = _pick_blocks(int(max_seqlen), block_d, q.dtype)
    grid = (triton.cdiv(int(max_seqlen), block_m), hq, batch)
    _varlen_attention_kernel[grid](
        q,
        k,
        v,
        out,
        k_prefix,
        v_prefix,
        cu_seqlens,
        cu_prefix,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        k_prefix.stride(0),
        k_prefix.stride(1),
        v_prefix.stride(0),
        v_prefix.stride(1),
        d,
        hq // hkv,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        CAUSAL=bool(causal),
        HAS_PREFIX=has_prefix,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )
    return out
