"""The ``bmm`` CPU attention kernel (``lab.ops.attention.bmm_attention``: the two products as batched GEMMs over
groups of equal-length sequences) equals the per-sequence explicit-softmax oracle, runs where a layer asks for it,
and is a candidate of the ``attention_kernel`` probe for encoders, never for decoders."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_utils import cu_from
from lab.kernels.reference import varlen_attention, varlen_attention_naive

from lab.ops import attention as ops_attention
from lab.ops import probes
from lab.ops.attention import KERNELS, attention, bmm_attention
from lab.ops.batch import AttnMeta, KVStep


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (3, 3), (4, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("budget", [300, 5000, 1 << 20])
@pytest.mark.parametrize("d", [16, 32])
def test_matches_oracle(causal, hq, hkv, dtype, tol, budget, d):
    """Shuffled ragged lengths with runs of equal lengths, odd lengths, length-1 and empty sequences; budgets that
    cut groups inside a run, take whole runs, and leave long sequences to the fused kernel (bit for bit its result
    there). The oracle's result at float32 rounding; bfloat16 within the dtype's tolerance and a root-mean-square
    error within 2.5x the fused kernel's (the scores and weights are rounded to bfloat16; 1.0-1.7x seen)."""
    lens = [1, 9, 9, 9, 17, 17, 3, 40, 40, 2, 100, 200, 0, 1, 1, 7]
    random.shuffle(lens)
    lens[:8] = sorted(lens[:8], reverse=True)  # some runs of equal lengths, some lone lengths
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, dtype=dtype) for h in (hq, hkv, hkv))
    exact = varlen_attention_naive(q.float(), k.float(), v.float(), cu_from(lens), causal=causal)
    got = bmm_attention(q, k, v, lens, causal, max_scores=budget)
    fused = varlen_attention(q, k, v, cu_from(lens), max(lens), causal=causal)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)
    rms = [(x.float() - exact).pow(2).mean().sqrt() for x in (got, fused)]
    assert rms[0] <= 2.5 * rms[1] + 1e-7
    starts = [sum(lens[:i]) for i in range(len(lens))]
    over = [(s, n) for s, n in zip(starts, lens) if hq * n * n > budget]
    if budget < 1 << 20:
        assert over  # the 200-token sequence, at least, goes to the fused kernel
    for s, n in over:
        torch.testing.assert_close(got[s : s + n], fused[s : s + n], atol=0, rtol=0)


def test_strided_views_of_a_stacked_projection():
    """q/k/v as a layer hands them (views of one ``(T, 3, H, D)`` GEMM output, tokens 3 * H * D apart): the same
    result as on contiguous copies, and the inputs are left as they were."""
    lens = [5, 5, 3, 1, 12]
    qkv = torch.randn(sum(lens), 3, 4, 32, dtype=torch.bfloat16)
    before = qkv.clone()
    q, k, v = qkv.unbind(1)
    for causal in (False, True):
        got = bmm_attention(q, k, v, lens, causal)
        want = bmm_attention(q.contiguous(), k.contiguous(), v.contiguous(), lens, causal)
        assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(qkv, before)


def test_one_token_sequences_return_their_value():
    """A length-1 sequence attends to itself only: its output is its value row (each query head its key/value
    head's), causal or not."""
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    for causal in (False, True):
        got = bmm_attention(q, k, v, [1, 1, 1], causal)
        torch.testing.assert_close(got, v.repeat_interleave(2, dim=1), atol=1e-6, rtol=1e-6)


def test_long_causal_sequence_over_the_budget_takes_the_query_blocks():
    """A causal sequence with more scores than the budget runs ``lab.kernels.reference.varlen_attention`` with the
    layer's ``causal_block``: bit for bit its result."""
    lens = [100, 6, 6]
    q, k, v = (torch.randn(sum(lens), 2, 16) for _ in range(3))
    got = bmm_attention(q, k, v, lens, True, max_scores=1000, causal_block=16)
    blocks = varlen_attention(q[:100], k[:100], v[:100], cu_from([100]), 100, causal=True, causal_block=16)
    assert torch.equal(got[:100], blocks)
    exact = varlen_attention_naive(q, k, v, cu_from(lens), causal=True)
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_named():
    q, k = torch.randn(6, 3, 16), torch.randn(6, 2, 16)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        bmm_attention(q, k, k, [6], False)
    with pytest.raises(ValueError, match="seqlens add up to 5 tokens, but q holds 6"):
        bmm_attention(q, q, q, [2, 3], False)


def test_layers_reach_it_through_attention(monkeypatch):
    """``attention(..., kernel="bmm")`` runs ``bmm_attention`` on a plain step; a step with a cached prefix runs the
    torch path (the kernel takes no prefix), as with ``sdpa``."""
    calls, real = [], ops_attention.bmm_attention
    monkeypatch.setattr(ops_attention, "bmm_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    meta = AttnMeta.from_lengths([3, 9, 9, 1], causal=False)
    q, k, v = (torch.randn(22, 4, 32) for _ in range(3))
    got = attention(q, k, v, meta, 0, kernel="bmm")
    assert calls == [1] and "bmm" in KERNELS
    torch.testing.assert_close(got, attention(q, k, v, meta, 0, kernel="sdpa"), atol=1e-5, rtol=1e-5)
    kp, vp = torch.randn(4, 4, 32), torch.randn(4, 4, 32)
    kv = KVStep(num_layers=1, cu_prefix=cu_from([1, 1, 1, 1]), prefix_lens=[1, 1, 1, 1], prefix_k=[kp], prefix_v=[vp])
    pmeta = AttnMeta.from_lengths([3, 9, 9, 1], causal=False, kv=kv)
    assert torch.equal(attention(q, k, v, pmeta, 0, kernel="bmm"), attention(q, k, v, pmeta, 0, kernel="sdpa"))
    assert calls == [1]


def test_probe_offers_it_to_encoders_only():
    """The ``attention_kernel`` probe times ``bmm`` beside the other kernels by default (each candidate computing
    the same attention); decoders' probe (``kernels=("sdpa", "lab")``) leaves it out, and an engine can force it."""
    assert "bmm" in probes.CANDIDATES["attention_kernel"]
    probe = probes.attention_probe(torch.bfloat16, 4, 32, 1)
    assert "bmm" in probe.candidates and next(iter(probe.candidates)) == "sdpa"
    outs = {c: fn() for c, fn in probe.candidates.items()}
    for c, o in outs.items():
        torch.testing.assert_close(o.float(), outs["sdpa"].float(), atol=3e-2, rtol=3e-2, msg=c)
    assert (
        "bmm" not in probes.attention_probe(torch.bfloat16, 4, 32, 1, causal=True, kernels=("sdpa", "lab")).candidates
    )
    d = probes.decide(probe, forced={"attention_kernel": "bmm"})
    assert d.choice == "bmm" and d.source == "engine"
