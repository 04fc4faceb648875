"""The CPU attention path (lab.kernels.reference.varlen_attention: zero-copy equal-length runs and padded buckets of
close lengths) equals the per-sequence explicit-softmax oracle on random ragged batches."""

from __future__ import annotations

import random

import pytest
import torch

from lab.kernels.reference import _buckets, _runs, varlen_attention, varlen_attention_naive


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 2, 16), (3, 3, 8), (6, 1, 12)])
def test_ragged_batches_match_oracle(causal, heads):
    hq, hkv, d = heads
    for _ in range(25):
        lens = [random.choice([1, 2, 3, 5, 8, 9, 10, 30, 31, 33, 64]) for _ in range(random.randint(1, 10))]
        if random.random() < 0.7:
            lens.sort(reverse=True)  # the scheduler's order: buckets form
        t = sum(lens)
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
        got = varlen_attention(q, k, v, _cu(lens), max(lens), causal=causal)
        torch.testing.assert_close(got, varlen_attention_naive(q, k, v, _cu(lens), causal=causal), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_prefix_matches_oracle(causal):
    lens, plens = [4, 4, 1, 7], [3, 3, 0, 5]
    q, k, v = torch.randn(16, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    kp, vp = torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    got = varlen_attention(q, k, v, _cu(lens), 7, causal=causal, k_prefix=kp, v_prefix=vp, cu_prefix=_cu(plens))
    want = varlen_attention_naive(q, k, v, _cu(lens), causal=causal, k_prefix=kp, v_prefix=vp, cu_prefix=_cu(plens))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_buckets_merge_close_lengths_only():
    runs = _runs([30, 29, 28, 10, 10, 9, 1, 1, 200], [0] * 9)
    assert _buckets(runs) == [(0, -1, 30, 3), (3, -1, 10, 3), (6, 2, 1, 0), (8, 1, 200, 0)]
