"""Triton ``segment_pool`` against ``reference.segment_pool`` (both accumulate in float32).

Runs on CPU in Triton's interpreter or on CUDA when present (see ``tests/kernel_utils.py``). Ragged batches
include length-1 sequences and a hidden size that is not a power of two; spans longer than one token block;
instruction prefixes (``pool_start``) including a sequence that is all instruction. Tolerances come from
``lab.kernels.tolerances`` (keyed by the dtype of ``hidden``; the output is float32 either way).
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import SUBPROCESS_REASON, cu_from, kernel_module, ragged_lengths, run_module_in_subprocess
from lab.kernels import reference as ref
from lab.kernels.tolerances import tolerance

kp, DEVICE = kernel_module("pooling", __file__)
pytestmark = pytest.mark.interpreter
cases = pytest.mark.skipif(kp is None, reason=SUBPROCESS_REASON)
METHODS = ["cls", "mean", "max", "lasttoken", "weightedmean"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.mark.skipif(kp is not None, reason="cases run in this process")
def test_interpreter_subprocess():
    run_module_in_subprocess(__file__)


def _check(hidden, cu, method, **kw):
    got = kp.segment_pool(hidden, cu, method, **kw)
    want = ref.segment_pool(hidden, cu, method, **kw)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, **tolerance("segment_pool", hidden.dtype), equal_nan=True)
    return got


@cases
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(method, dtype):
    lengths = ragged_lengths(torch.default_generator, 5, 80)  # > one block of 32 tokens at H=40
    hidden = torch.randn(sum(lengths), 40, dtype=dtype, device=DEVICE)
    cu = cu_from(lengths, DEVICE)
    _check(hidden, cu, method)


@cases
@pytest.mark.parametrize("method", METHODS)
def test_pool_start(method):
    """Instruction tokens are attended but not pooled; the last two sequences are entirely instruction (the last
    one's ``pool_start`` past its end is clamped to it)."""
    lengths = [1, 7, 40, 3, 2]
    hidden = torch.randn(sum(lengths), 24, device=DEVICE)
    cu = cu_from(lengths, DEVICE)
    pool_start = torch.tensor([0, 3, 10, 3, 5], device=DEVICE)
    got = _check(hidden, cu, method, pool_start=pool_start)
    if method != "lasttoken":  # pool_start changes the answer (max: -inf for the all-instruction sequences)
        assert not torch.allclose(got, ref.segment_pool(hidden, cu, method))


@cases
@pytest.mark.parametrize("method", ["cls", "mean", "lasttoken", "weightedmean"])
def test_empty_sequences(method):
    lengths = [2, 0, 5, 0]
    hidden = torch.randn(sum(lengths), 16, device=DEVICE)
    _check(hidden, cu_from(lengths, DEVICE), method)


@cases
def test_strided_hidden_and_errors():
    big = torch.randn(9, 50, device=DEVICE)
    cu = cu_from([4, 5], DEVICE)
    _check(big[:, 3:40], cu, "mean")  # row stride 50, width 37
    with pytest.raises(ValueError, match="unknown pooling"):
        kp.segment_pool(big, cu, "median")
    with pytest.raises(ValueError, match="cu_seqlens"):
        kp.segment_pool(big, cu.float(), "mean")
    with pytest.raises(ValueError, match="pool_start"):
        kp.segment_pool(big, cu, "mean", pool_start=torch.zeros(3, dtype=torch.long, device=DEVICE))
