"""prefill-lab's own CPU rotary embedding in the ``pairs`` layout (lab.kernels.cpu_rope, in the C library
lab.kernels.cpu_attention builds): torch's path (lab.models.rope.rotate_pairs_) in every build (this machine's,
AVX2-only, portable), float32 and bfloat16, one row to many, one head to twelve, strided heads (the q/k columns of a
fused projection), row subsets of the tables; bad input. Decoders with it in the plan against transformers:
tests/test_fused.py (test_decoder_rope_layouts_match_transformers)."""

from __future__ import annotations

import pytest
import torch
from lab.kernels import cpu_rope

from lab.models.rope import RopeTables, rotate_pairs_

pytestmark = pytest.mark.skipif(
    not cpu_rope.available(), reason=f"the C kernels did not build here: {cpu_rope.unavailable_reason()}"
)


def _case(t, h, d, dtype, seed, extra=5):
    """A fused projection's q/k columns (T, H, D) as a strided view, and random-position tables (T, D/2)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (h + extra) * d, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 4096, (t,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    return qkv, qkv[:, : h * d].view(t, h, d), RopeTables.at(positions, inv_freq, 1.0, "pairs", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,d", [(1, 1, 2), (7, 3, 16), (513, 12, 64), (33, 4, 128), (5, 2, 6)])
def test_matches_torch_in_every_build(c_builds, dtype, t, h, d):
    for name, lib in c_builds.items():
        qkv, x, tables = _case(t, h, d, dtype, seed=t * h * d)
        before = qkv.clone()
        want = rotate_pairs_(x.clone(), tables.cis)
        got = cpu_rope.rotate_pairs_(x, tables.cis, lib=lib)
        assert got is x and got.dtype == dtype
        assert torch.equal(qkv[:, h * d :], before[:, h * d :]), name  # the other columns untouched
        _close(got, want, name)


def _close(got, want, name):
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
        return
    # bfloat16: both round the same float32 rotation once; a float32 rounding difference may cross a bfloat16
    # rounding boundary, one step apart, rarely
    diff = (got.float() - want.float()).abs()
    step = want.float().abs().clamp_min(1e-30) * 2**-7
    assert bool((diff <= step).all()), name
    assert (diff > 0).float().mean().item() < 1e-3, name


def test_row_subsets_and_strided_tables(c_builds):
    """Queries of a few rows (``RopeTables.rows``, a gathered table) and a table that is a strided view."""
    _, x, tables = _case(40, 3, 32, torch.bfloat16, seed=3)
    rows = torch.tensor([39, 0, 17, 17, 5])
    sub = tables.rows(rows)
    q = x[rows].clone()
    want = rotate_pairs_(q.clone(), sub.cis)
    wide = torch.zeros(5, 32, dtype=torch.complex64)
    wide[:, ::2] = sub.cis  # a strided view of a wider table
    for name, lib in c_builds.items():
        _close(cpu_rope.rotate_pairs_(q.clone(), sub.cis, lib=lib), want, name)
        _close(cpu_rope.rotate_pairs_(q.clone(), wide[:, ::2], lib=lib), want, name)


def test_bad_input_is_refused():
    _, x, tables = _case(4, 2, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="D even"):
        cpu_rope.rotate_pairs_(torch.zeros(4, 2, 7), tables.cis)
    with pytest.raises(ValueError, match="complex64 cis"):
        cpu_rope.rotate_pairs_(x, tables.cis.to(torch.complex128))
    with pytest.raises(ValueError, match="cis"):
        cpu_rope.rotate_pairs_(x, tables.cis[:3])
    assert not cpu_rope.supports(x.half(), tables.cis)
