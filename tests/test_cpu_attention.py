"""prefill-lab's own CPU attention kernel (lab.kernels.cpu_attention, C compiled on this machine): the oracle's
result on shuffled ragged batches in every build (this machine's, AVX2-only, portable), both dtypes, causal and
bidirectional, grouped-query heads; strided inputs; bad input; a machine where it cannot be built."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from kernel_utils import cu_from
from lab.kernels import cpu_attention
from lab.kernels.reference import varlen_attention, varlen_attention_naive

from lab.ops.probes import cpu_info

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason=f"cpu_attention did not build here: {cpu_attention.unavailable_reason()}"
)

LENGTHS = [1, 2, 15, 16, 17, 31, 33, 4, 100, 257, 3]  # around the kernel's 16-key vectors and 4-query blocks


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,d", [(12, 12, 32), (9, 3, 64), (4, 1, 16), (2, 2, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_oracle_in_every_build(c_builds, causal, hq, hkv, d, dtype):
    """float32: the explicit-softmax oracle within 1e-5. bfloat16: within the dtype's tolerance, and a root-mean-
    square error within 1.25x torch's fused kernel's on the same inputs (scores, softmax weights and the weighted sum
    stay float32). The shuffled lengths put a partial query block at the tensor's end in some cases (read through a
    zero-padded copy) and inside it in others (read in place)."""
    lens = LENGTHS[:]
    random.Random(hq * d + causal).shuffle(lens)
    t = sum(lens)
    q = torch.randn(t, hq, d, dtype=dtype) * 2
    k, v = (torch.randn(t, hkv, d, dtype=dtype) * 2 for _ in range(2))
    exact = varlen_attention_naive(q.float(), k.float(), v.float(), cu_from(lens), causal=causal)
    fused = varlen_attention(q, k, v, cu_from(lens), max(lens), causal=causal)
    for name, lib in c_builds.items():
        got = cpu_attention.varlen_attention(q, k, v, cu_from(lens), causal, lib=lib)
        assert got.dtype == dtype and got.shape == q.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5, msg=name)
        else:
            torch.testing.assert_close(got.float(), exact, atol=3e-2, rtol=3e-2, msg=name)
            rms = [(x.float() - exact).pow(2).mean().sqrt() for x in (got, fused)]
            assert rms[0] <= 1.25 * rms[1], (name, rms)


def test_strided_views_and_empty_sequences():
    """q/k/v as views of one fused projection (the layout a layer hands over) give the contiguous inputs' result
    bit for bit; a zero-length sequence in ``cu_seqlens`` is skipped; a custom scale is used."""
    lens = [5, 0, 40, 1, 0, 18]
    t = sum(lens)
    qkv = torch.randn(t, 3, 6, 32)
    q, k, v = qkv.unbind(1)
    got = cpu_attention.varlen_attention(q, k, v, cu_from(lens), False)
    assert torch.equal(
        got, cpu_attention.varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu_from(lens), False)
    )
    torch.testing.assert_close(got, varlen_attention_naive(q, k, v, cu_from(lens), causal=False), atol=1e-5, rtol=1e-5)
    half = cpu_attention.varlen_attention(q, k, v, cu_from(lens), True, softmax_scale=0.05)
    want = varlen_attention_naive(q, k, v, cu_from(lens), causal=True, scale=0.05)
    torch.testing.assert_close(half, want, atol=1e-5, rtol=1e-5)


def test_threads_share_nothing():
    """Two threads (the engine's CPU workers) calling at once get what each gets alone."""
    rng = torch.Generator().manual_seed(0)
    jobs = []
    for n in (3, 7):
        lens = [n * i + 1 for i in range(12)]
        jobs.append([torch.randn(sum(lens), 4, 32, generator=rng) for _ in range(3)] + [cu_from(lens)])
    alone = [cpu_attention.varlen_attention(q, k, v, cu, False) for q, k, v, cu in jobs * 2]
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda j: cpu_attention.varlen_attention(j[0], j[1], j[2], j[3], False), jobs * 2))
    assert all(torch.equal(a, b) for a, b in zip(alone, both))


def test_bfloat16_uses_the_cpus_dot_products_where_it_has_them():
    """A build for this machine uses AVX512-BF16's dot products exactly when the CPU has that flag."""
    flags = cpu_info()["cpu_flags"].split()
    if "avx512f" not in flags:
        pytest.skip("not an AVX-512 machine")
    assert cpu_attention.native_bf16() == ("avx512_bf16" in flags)


def test_bad_input_names_the_problem():
    q = torch.randn(6, 2, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_attention.varlen_attention(
            torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8), cu_from([6]), False
        )
    with pytest.raises(ValueError, match="float32/bfloat16"):
        cpu_attention.varlen_attention(q.half(), q.half(), q.half(), cu_from([6]), False)
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        cpu_attention.varlen_attention(torch.randn(6, 3, 32), q, q, cu_from([6]), False)
    with pytest.raises(ValueError, match="rise from 0 to the 6 packed tokens"):
        cpu_attention.varlen_attention(q, q, q, cu_from([4]), False)
    with pytest.raises(ValueError, match="rise from 0"):
        cpu_attention.varlen_attention(q, q, q, torch.tensor([0, 4, 2, 6]), False)


def test_unbuildable_machine_falls_back(tmp_path, monkeypatch):
    """No working compiler: ``available()`` is False with the compiler's complaint, the probe does not offer the
    kernel, and ``attention(..., kernel="lab")`` runs torch's fused kernel; the build cache is keyed by source,
    compiler and CPU, so the same request is compiled once."""
    from lab.ops import probes
    from lab.ops.attention import attention
    from lab.ops.batch import AttnMeta

    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: no such thing' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("LAB_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_attention, "_LIB", None)
    monkeypatch.setattr(cpu_attention, "_REASON", None)
    assert not cpu_attention.available()
    assert "compiling lab.kernels.cpu_attention failed" in cpu_attention.unavailable_reason()
    assert "no such thing" in cpu_attention.unavailable_reason()
    probe = probes.attention_probe(torch.float32, 4, 32, 1)
    assert list(probe.candidates) == ["sdpa", "matmul", "bmm"]
    meta = AttnMeta.from_lengths([3, 9], causal=False)
    q, k, v = (torch.randn(12, 4, 32) for _ in range(3))
    assert torch.equal(attention(q, k, v, meta, 0, kernel="lab"), attention(q, k, v, meta, 0))
    with pytest.raises(RuntimeError, match="not available"):
        cpu_attention.varlen_attention(q, k, v, meta.cu_seqlens, False)
    monkeypatch.setenv("LAB_CPU_NATIVE_KERNELS", "0")
    monkeypatch.setattr(cpu_attention, "_REASON", None)
    assert not cpu_attention.available() and "LAB_CPU_NATIVE_KERNELS=0" in cpu_attention.unavailable_reason()


def test_build_is_cached(tmp_path):
    first = cpu_attention.build(arch=[], directory=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_attention.build(arch=[], directory=tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert cpu_attention.build(arch=["-O2"], directory=tmp_path) != first  # other flags, another build
