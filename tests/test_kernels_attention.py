"""Triton ``varlen_attention`` against the float32 oracle ``reference.varlen_attention_naive``.

Runs on CPU in Triton's interpreter (tiny shapes) or on CUDA when present; see ``tests/kernel_utils.py`` for how
``TRITON_INTERPRET`` is set. Ragged batches always include a length-1 sequence; head dims include 40, 48, 80, 96.
fp32 must be within the oracle's tolerance; fp16 may be off by at most 2x torch's own fp16 error (+ a small floor).
Both figures come from ``lab.kernels.tolerances``.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import (
    SUBPROCESS_REASON,
    cu_from,
    kernel_module,
    max_abs_err,
    ragged_lengths,
    run_module_in_subprocess,
)
from lab.kernels import reference as ref
from lab.kernels.tolerances import error_bound, tolerance

ka, DEVICE = kernel_module("attention", __file__)
pytestmark = pytest.mark.interpreter
cases = pytest.mark.skipif(ka is None, reason=SUBPROCESS_REASON)
FP32 = tolerance("varlen_attention", torch.float32)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.mark.skipif(ka is not None, reason="cases run in this process")
def test_interpreter_subprocess():
    run_module_in_subprocess(__file__)


def _batch(lengths, hq, hkv, d, dtype, prefix_lens=None, fused=False):
    """Random q/k/v (optionally strided views of one fused qkv tensor) and prefix K/V."""
    total = sum(lengths)
    if fused:  # model layout: q, k, v are column slices of one projection (non-unit token/head strides)
        qkv = torch.randn(total, hq + 2 * hkv, d, dtype=dtype, device=DEVICE)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    else:
        q = torch.randn(total, hq, d, dtype=dtype, device=DEVICE)
        k = torch.randn(total, hkv, d, dtype=dtype, device=DEVICE)
        v = torch.randn(total, hkv, d, dtype=dtype, device=DEVICE)
    kw = {}
    if prefix_lens is not None:
        n = sum(prefix_lens)
        kw = {
            "k_prefix": torch.randn(n, hkv, d, dtype=dtype, device=DEVICE),
            "v_prefix": torch.randn(n, hkv, d, dtype=dtype, device=DEVICE),
            "cu_prefix": cu_from(prefix_lens, DEVICE),
        }
    return q, k, v, cu_from(lengths, DEVICE), kw


def _f32(kw):
    return {k: (v.float() if v.is_floating_point() else v) for k, v in kw.items()}


@cases
@pytest.mark.parametrize(
    "causal,hq,hkv,d,prefix",
    [
        (False, 2, 2, 32, False),
        (True, 4, 2, 48, False),  # GQA
        (True, 4, 1, 80, True),  # MQA + cached prefix
        (False, 2, 1, 40, True),
        (True, 3, 3, 96, False),
        (False, 4, 2, 64, False),
    ],
)
def test_fp32_matches_naive(causal, hq, hkv, d, prefix):
    lengths = ragged_lengths(torch.default_generator, 4, 24)
    prefix_lens = [3, 0, 17, 1] if prefix else None
    q, k, v, cu, kw = _batch(lengths, hq, hkv, d, torch.float32, prefix_lens, fused=hq == 4)
    out = ka.varlen_attention(q, k, v, cu, max(lengths), causal=causal, seqlens=lengths, **kw)
    want = ref.varlen_attention_naive(q, k, v, cu, causal=causal, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, want, **FP32)
    if causal:  # the comparison can tell causal from bidirectional
        other = ref.varlen_attention_naive(q, k, v, cu, causal=False, **kw)
        assert max_abs_err(out, other) > 1e-2


@cases
@pytest.mark.parametrize("causal", [False, True])
def test_many_blocks(monkeypatch, causal):
    """Small tiles force several query blocks, several key blocks, and the causal full/diagonal split."""
    monkeypatch.setattr(ka, "_pick_blocks", lambda *a: (32, 16, 4, 1))
    lengths = [1, 45, 70, 16, 33]
    q, k, v, cu, kw = _batch(lengths, 2, 1, 48, torch.float32, prefix_lens=[20, 0, 37, 5, 1])
    out = ka.varlen_attention(q, k, v, cu, max(lengths), causal=causal, scale=0.2, **kw)
    want = ref.varlen_attention_naive(q, k, v, cu, causal=causal, scale=0.2, **kw)
    torch.testing.assert_close(out, want, **FP32)


@cases
@pytest.mark.parametrize("causal,hq,hkv,d,prefix", [(True, 4, 2, 80, True), (False, 2, 1, 48, False)])
def test_fp16_error_within_twice_torch(causal, hq, hkv, d, prefix):
    lengths = ragged_lengths(torch.default_generator, 4, 30)
    prefix_lens = [0, 9, 1, 4] if prefix else None
    q, k, v, cu, kw = _batch(lengths, hq, hkv, d, torch.float16, prefix_lens)
    exact = ref.varlen_attention_naive(q.float(), k.float(), v.float(), cu, causal=causal, **_f32(kw))
    torch_err = max_abs_err(ref.varlen_attention(q, k, v, cu, max(lengths), causal=causal, **kw), exact)
    out = ka.varlen_attention(q, k, v, cu, max(lengths), causal=causal, **kw)
    assert out.dtype == torch.float16
    assert max_abs_err(out, exact) <= error_bound("varlen_attention", torch.float16, torch_err)


@cases
@pytest.mark.parametrize("causal", [False, True])
def test_empty_sequences(causal):
    lengths = [0, 3, 0, 1, 2]
    q, k, v, cu, kw = _batch(lengths, 2, 2, 32, torch.float32, prefix_lens=[2, 0, 1, 0, 0])
    out = ka.varlen_attention(q, k, v, cu, max(lengths), causal=causal, **kw)
    torch.testing.assert_close(out, ref.varlen_attention_naive(q, k, v, cu, causal=causal, **kw), **FP32)
    empty = torch.empty(0, 2, 32, device=DEVICE)
    assert ka.varlen_attention(empty, empty, empty, cu_from([0, 0], DEVICE), 0, causal=causal).shape == (0, 2, 32)


@cases
def test_validation_errors():
    q = torch.randn(5, 4, 32, device=DEVICE)
    k = torch.randn(5, 3, 32, device=DEVICE)
    cu = cu_from([2, 3], DEVICE)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ka.varlen_attention(q, k, k, cu, 3, causal=True)
    with pytest.raises(ValueError, match="dims"):
        ka.varlen_attention(q[0], q, q, cu, 3, causal=True)
    with pytest.raises(ValueError, match="dtype"):
        ka.varlen_attention(q, q.half(), q.half(), cu, 3, causal=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ka.varlen_attention(q, q, q, cu.float(), 3, causal=True)
    with pytest.raises(ValueError, match="needs v_prefix and cu_prefix"):
        ka.varlen_attention(q, q, q, cu, 3, causal=True, k_prefix=q)
    with pytest.raises(ValueError, match="k_prefix/v_prefix"):
        ka.varlen_attention(q, q, q, cu, 3, causal=True, k_prefix=k, v_prefix=k, cu_prefix=cu)
