"""Triton ``add_layer_norm`` / ``add_rms_norm`` against ``reference``.

Runs on CPU in Triton's interpreter or on CUDA when present (see ``tests/kernel_utils.py``). Odd widths
(48, 123), strided rows, with/without residual and bias. fp32 within tolerance of the reference; fp16 error against
the float32 reference at most 2x the reference's own fp16 error, plus a small floor (both from
``lab.kernels.tolerances``).
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import SUBPROCESS_REASON, kernel_module, max_abs_err, run_module_in_subprocess
from lab.kernels import reference as ref
from lab.kernels.tolerances import error_bound, tolerance

kn, DEVICE = kernel_module("norms", __file__)
pytestmark = pytest.mark.interpreter
cases = pytest.mark.skipif(kn is None, reason=SUBPROCESS_REASON)
EPS = 1e-6
LN32, RMS32 = tolerance("add_layer_norm", torch.float32), tolerance("add_rms_norm", torch.float32)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.mark.skipif(kn is not None, reason="cases run in this process")
def test_interpreter_subprocess():
    run_module_in_subprocess(__file__)


def _inputs(rows, n, dtype, residual=True, strided=False):
    if strided:  # rows of a wider buffer: row stride != n
        x = torch.randn(rows, n + 7, dtype=dtype, device=DEVICE)[:, 2 : n + 2]
    else:
        x = torch.randn(rows, n, dtype=dtype, device=DEVICE)
    r = torch.randn(rows, n, dtype=dtype, device=DEVICE) if residual else None
    w = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype)
    b = (0.1 * torch.randn(n, device=DEVICE)).to(dtype)
    return x, r, w, b


def _f32(*ts):
    return [t.float() if t is not None else None for t in ts]


@cases
@pytest.mark.parametrize("n", [48, 123])
@pytest.mark.parametrize("residual,bias,strided", [(True, True, False), (False, True, True), (True, False, True)])
def test_layer_norm_fp32(n, residual, bias, strided):
    x, r, w, b = _inputs(5, n, torch.float32, residual, strided)
    b = b if bias else None
    got = kn.add_layer_norm(x, r, w, b, 1e-12)
    torch.testing.assert_close(got, ref.add_layer_norm(x, r, w, b, 1e-12), **LN32)


@cases
@pytest.mark.parametrize("n", [48, 123])
@pytest.mark.parametrize("residual,strided", [(True, False), (False, True), (True, True)])
def test_rms_norm_fp32(n, residual, strided):
    x, r, w, _ = _inputs(5, n, torch.float32, residual, strided)
    got, summed = kn.add_rms_norm(x, r, w, EPS)
    want, want_sum = ref.add_rms_norm(x, r, w, EPS)
    torch.testing.assert_close(got, want, **RMS32)
    torch.testing.assert_close(summed, want_sum, atol=0, rtol=0)  # exact, not a tolerance
    if not residual:
        assert summed is x


@cases
@pytest.mark.parametrize("n", [48, 123])
def test_fp16_error_within_twice_torch(n):
    x, r, w, b = _inputs(6, n, torch.float16)
    exact = ref.add_layer_norm(*_f32(x, r, w, b), EPS)
    torch_err = max_abs_err(ref.add_layer_norm(x, r, w, b, EPS), exact)
    got = kn.add_layer_norm(x, r, w, b, EPS)
    assert got.dtype == torch.float16
    assert max_abs_err(got, exact) <= error_bound("add_layer_norm", torch.float16, torch_err)

    exact, _ = ref.add_rms_norm(*_f32(x, r, w), EPS)
    want, want_sum = ref.add_rms_norm(x, r, w, EPS)
    got, summed = kn.add_rms_norm(x, r, w, EPS)
    assert got.dtype == torch.float16 and summed.dtype == torch.float16
    assert max_abs_err(got, exact) <= error_bound("add_rms_norm", torch.float16, max_abs_err(want, exact))
    torch.testing.assert_close(summed, want_sum, atol=0, rtol=0)  # the add rounds exactly like torch's


@cases
def test_rms_norm_fp32_weight_on_fp16_input():
    """transformers' LlamaRMSNorm: fp32 weight times the fp16-rounded normed value gives an fp32 result."""
    x, r, _, _ = _inputs(4, 64, torch.float16)
    w = 1 + 0.1 * torch.randn(64, device=DEVICE)
    got, _ = kn.add_rms_norm(x, r, w, EPS)
    want, _ = ref.add_rms_norm(x, r, w, EPS)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, **RMS32)  # a float32 result


@cases
def test_leading_dims_and_errors():
    x = torch.randn(2, 3, 40, device=DEVICE)
    w, b = torch.ones(40, device=DEVICE), torch.zeros(40, device=DEVICE)
    got = kn.add_layer_norm(x, x, w, b, 1e-5)
    assert got.shape == x.shape
    torch.testing.assert_close(got, ref.add_layer_norm(x, x, w, b, 1e-5), **LN32)
    with pytest.raises(ValueError, match="must match x"):
        kn.add_layer_norm(x, x[0], w, b, 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \(40,\)"):
        kn.add_rms_norm(x, None, w[:8], 1e-5)
    with pytest.raises(ValueError, match="must be one of"):
        kn.add_rms_norm(x.double(), None, w, 1e-5)
