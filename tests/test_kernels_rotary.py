"""Triton ``apply_rotary`` (in place, NeoX halves) against ``reference.apply_rotary``.

Runs on CPU in Triton's interpreter or on CUDA when present (see ``tests/kernel_utils.py``). Head dims 32, 48,
80, 128; strided views of a fused qkv tensor; fp32 within tolerance, fp16 within 2x torch's own fp16 error + a floor
(both from ``lab.kernels.tolerances``).
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import SUBPROCESS_REASON, kernel_module, max_abs_err, run_module_in_subprocess
from lab.kernels import reference as ref
from lab.kernels.tolerances import error_bound, tolerance

kr, DEVICE = kernel_module("rotary", __file__)
pytestmark = pytest.mark.interpreter
cases = pytest.mark.skipif(kr is None, reason=SUBPROCESS_REASON)
FP32 = tolerance("apply_rotary", torch.float32)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.mark.skipif(kr is not None, reason="cases run in this process")
def test_interpreter_subprocess():
    run_module_in_subprocess(__file__)


def _cos_sin(t, d, base=10000.0):
    positions = torch.randint(0, 4096, (t,), device=DEVICE)  # chunks and prefixes start mid-sequence
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, device=DEVICE).float() / d)
    return ref.rotary_cos_sin(positions, inv_freq)


@cases
@pytest.mark.parametrize("d", [32, 48, 80, 128])
@pytest.mark.parametrize("heads", [1, 5])
def test_fp32_matches_reference(d, heads):
    x = torch.randn(7, heads, d, device=DEVICE)
    cos, sin = _cos_sin(7, d)
    want = ref.apply_rotary(x.clone(), cos, sin)
    out = kr.apply_rotary(x, cos, sin)
    assert out is x  # in place
    torch.testing.assert_close(x, want, **FP32)


@cases
@pytest.mark.parametrize("d", [48, 64])
def test_fp16_error_within_twice_torch(d):
    x = torch.randn(9, 3, d, dtype=torch.float16, device=DEVICE)
    cos, sin = _cos_sin(9, d)
    exact = ref.apply_rotary(x.float(), cos, sin)
    torch_err = max_abs_err(ref.apply_rotary(x.clone(), cos, sin), exact)
    kr.apply_rotary(x, cos, sin)
    assert max_abs_err(x, exact) <= error_bound("apply_rotary", torch.float16, torch_err)


@cases
def test_strided_view_of_fused_qkv():
    """Rotating q and k as column slices of one (T, Hq + 2 Hkv, D) buffer must leave v untouched."""
    qkv = torch.randn(6, 4 + 2 + 2, 40, device=DEVICE)
    want = qkv.clone()
    cos, sin = _cos_sin(6, 40)
    ref.apply_rotary(want[:, :4], cos, sin)
    ref.apply_rotary(want[:, 4:6], cos, sin)
    kr.apply_rotary(qkv[:, :4], cos, sin)
    kr.apply_rotary(qkv[:, 4:6], cos, sin)
    torch.testing.assert_close(qkv, want, **FP32)


@cases
def test_errors():
    x = torch.randn(3, 2, 32, device=DEVICE)
    cos, sin = _cos_sin(3, 32)
    with pytest.raises(ValueError, match="even head dim"):
        kr.apply_rotary(torch.randn(3, 2, 31, device=DEVICE), cos, sin)
    with pytest.raises(ValueError, match="cos/sin must be"):
        kr.apply_rotary(x, cos[:2], sin[:2])
    with pytest.raises(ValueError, match="3-D"):
        kr.apply_rotary(x[0], cos, sin)
