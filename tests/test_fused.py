"""The oneDNN-fused FFN paths compute the same function as the plain torch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lab.models.fused import fusable, gated_mlp, linear_act


@pytest.mark.parametrize("act_name,act", [("gelu", F.gelu), ("gelu_new", lambda x: F.gelu(x, approximate="tanh")),
                                          ("relu", F.relu), ("silu", F.silu)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_linear_act_matches_plain(act_name, act, dtype, tol):
    x, w, b = torch.randn(37, 24, dtype=dtype), torch.randn(40, 24, dtype=dtype) * 0.2, torch.randn(40, dtype=dtype)
    want = act(F.linear(x.float(), w.float(), b.float()))
    torch.testing.assert_close(linear_act(x, w, b, act_name, act).float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_matches_plain(dtype, tol, bias):
    x = torch.randn(9, 16, dtype=dtype)
    wg, wu = torch.randn(32, 16, dtype=dtype) * 0.2, torch.randn(32, 16, dtype=dtype) * 0.2
    bg, bu = (torch.randn(32, dtype=dtype), torch.randn(32, dtype=dtype)) if bias else (None, None)
    want = F.silu(F.linear(x.float(), wg.float(), None if bg is None else bg.float())) * F.linear(
        x.float(), wu.float(), None if bu is None else bu.float())
    got = gated_mlp(x, wg, wu, "silu", F.silu, bg, bu)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_fusable_only_for_cpu_float32_bfloat16_and_known_activations():
    assert not fusable(torch.zeros(2, 2, dtype=torch.float16), "gelu")
    assert not fusable(torch.zeros(2, 2), "unknown_act")
