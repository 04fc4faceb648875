"""The CPU attention path (lab.kernels.reference.varlen_attention: one zero-copy call per run of equal lengths)
equals the per-sequence explicit-softmax oracle on random ragged batches."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_utils import cu_from
from lab.kernels.reference import _runs, varlen_attention, varlen_attention_naive


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 2, 16), (3, 3, 8), (6, 1, 12)])
def test_ragged_batches_match_oracle(causal, heads):
    hq, hkv, d = heads
    for _ in range(25):
        lens = [random.choice([1, 2, 3, 5, 8, 9, 10, 30, 31, 33, 64]) for _ in range(random.randint(1, 10))]
        if random.random() < 0.7:
            lens.sort(reverse=True)  # the scheduler's order: equal lengths form runs
        t = sum(lens)
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
        cu = cu_from(lens)
        got = varlen_attention(q, k, v, cu, max(lens), causal=causal)
        torch.testing.assert_close(got, varlen_attention_naive(q, k, v, cu, causal=causal), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 1), (3, 3)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_prefix_matches_oracle(causal, hq, hkv, dtype, tol):
    """Causal steps with a prefix take the two-call log-sum-exp merge on CPU; a length-1 piece after a prefix too."""
    lens, plens = [4, 4, 1, 7, 1], [3, 3, 0, 5, 9]
    t, p = sum(lens), sum(plens)
    q, k, v = (torch.randn(t, h, 8, dtype=dtype) for h in (hq, hkv, hkv))
    kp, vp = torch.randn(p, hkv, 8, dtype=dtype), torch.randn(p, hkv, 8, dtype=dtype)
    cu, cu_prefix = cu_from(lens), cu_from(plens)
    got = varlen_attention(q, k, v, cu, 7, causal=causal, k_prefix=kp, v_prefix=vp, cu_prefix=cu_prefix)
    want = varlen_attention_naive(q, k, v, cu, causal=causal, k_prefix=kp, v_prefix=vp, cu_prefix=cu_prefix)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_runs_group_equal_lengths_and_prefixes():
    runs = _runs([30, 30, 29, 10, 10, 10, 1, 1, 200], [0, 0, 0, 4, 4, 0, 0, 0, 0])
    assert runs == [(0, 2, 30, 0), (2, 1, 29, 0), (3, 2, 10, 4), (5, 1, 10, 0), (6, 2, 1, 0), (8, 1, 200, 0)]


@pytest.mark.parametrize("hq,hkv", [(6, 2), (3, 3)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("lens", [[1, 192, 193, 250, 250, 64, 401], [260, 260], [193]])
def test_causal_blocks_match_oracle(hq, hkv, dtype, tol, lens):
    """``causal_block`` (a CPU probe's choice): causal sequences longer than three blocks run a block of queries at
    a time; the result is the oracle's at float32 rounding (bfloat16: within the dtype's tolerance, and as close to
    the float32 oracle as the one-call path), shuffled lengths around the three-block threshold, a length-1
    sequence, a step that is one run, and bidirectional steps (where the knob does nothing)."""
    lens = random.sample(lens, len(lens))
    t = sum(lens)
    q, k, v = (torch.randn(t, h, 16, dtype=dtype) for h in (hq, hkv, hkv))
    exact = varlen_attention_naive(q.float(), k.float(), v.float(), cu_from(lens), causal=True)
    got = varlen_attention(q, k, v, cu_from(lens), max(lens), causal=True, causal_block=64)
    whole = varlen_attention(q, k, v, cu_from(lens), max(lens), causal=True)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)
    assert (got.float() - exact).abs().max() <= 1.5 * (whole.float() - exact).abs().max() + 1e-6
    bidir = varlen_attention(q, k, v, cu_from(lens), max(lens), causal=False, causal_block=64)
    assert torch.equal(bidir, varlen_attention(q, k, v, cu_from(lens), max(lens), causal=False))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (3, 3), (4, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("budget", [300, 5000, 100_000])
def test_matmul_attention_matches_oracle(causal, hq, hkv, dtype, tol, budget):
    """``matmul_scores`` (a CPU probe's choice): runs as scores, softmax and weighted sum in groups of at most that
    many scores. Shuffled ragged lengths with runs of equal lengths, a length-1 sequence, groups cut inside a run and
    whole runs per group, sequences with more scores than the budget left to the fused kernel (bit for bit its
    result); the oracle's result at float32 rounding (bfloat16: within the dtype's tolerance, and a root-mean-square
    error within 2.5x the fused kernel's: scores and weights are rounded to bfloat16, 1.5-1.8x over 60 random draws).
    With ``causal_block`` beside it, a causal sequence longer than three blocks takes the blocks, even where its
    scores fit the budget (100 tokens)."""
    lens = [1, 9, 9, 9, 17, 17, 3, 40, 40, 2, 100, 200]
    random.shuffle(lens)
    lens[:8] = sorted(lens[:8], reverse=True)  # some runs of equal lengths, some lone lengths
    t = sum(lens)
    q, k, v = (torch.randn(t, h, 16, dtype=dtype) for h in (hq, hkv, hkv))
    exact = varlen_attention_naive(q.float(), k.float(), v.float(), cu_from(lens), causal=causal)
    got = varlen_attention(q, k, v, cu_from(lens), max(lens), causal=causal, matmul_scores=budget)
    fused = varlen_attention(q, k, v, cu_from(lens), max(lens), causal=causal)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)
    rms = [(x.float() - exact).pow(2).mean().sqrt() for x in (got, fused)]
    assert rms[0] <= 2.5 * rms[1] + 1e-7
    starts = [sum(lens[:i]) for i in range(len(lens))]
    over = [(s, n) for s, n in zip(starts, lens) if hq * n * n > budget]
    assert over  # every budget leaves the 200-token sequence to the fused kernel
    for s, n in over:
        assert torch.equal(got[s : s + n], fused[s : s + n])
    both = varlen_attention(q, k, v, cu_from(lens), max(lens), causal=causal, matmul_scores=budget, causal_block=32)
    torch.testing.assert_close(both.float(), exact, atol=tol, rtol=tol)
    if causal:
        s = starts[lens.index(100)]
        rows = slice(s, s + 100)
        blocks = varlen_attention(q[rows], k[rows], v[rows], cu_from([100]), 100, causal=True, causal_block=32)
        assert torch.equal(both[rows], blocks)


def test_matmul_attention_returns_the_packed_layout_for_one_run():
    """A step that is one run of equal lengths returns the (n, L, H, D) memory the kernel wrote, laid out as the
    packed ``(T, H, D)`` input, as the fused kernel's path does."""
    q, k, v = (torch.randn(3 * 5, 4, 8) for _ in range(3))
    got = varlen_attention(q, k, v, cu_from([5, 5, 5]), 5, causal=False, matmul_scores=1 << 20)
    assert got.shape == q.shape and got.is_contiguous()
    want = varlen_attention_naive(q, k, v, cu_from([5, 5, 5]), causal=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
