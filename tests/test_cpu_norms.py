"""prefill-lab's own CPU LayerNorm(x + residual) and RMSNorm(x + residual) (lab.kernels.cpu_norms, in the C library
lab.kernels.cpu_attention builds): torch's ops (lab.kernels.reference.add_layer_norm / add_rms_norm) in every build
(this machine's, AVX2-only, portable), float32 and bfloat16, odd row counts, one row, strided rows, written over x or
the residual; bad input; and the BERT layer's in-place path (its blocks overwrite their own rows) against
transformers (the decoders' pre-norms: tests/test_models_decoder.py)."""

from __future__ import annotations

import pytest
import torch
from lab.kernels import cpu_norms
from lab.kernels.reference import add_layer_norm, add_rms_norm

pytestmark = pytest.mark.skipif(
    not cpu_norms.available(), reason=f"the C kernels did not build here: {cpu_norms.unavailable_reason()}"
)


def _inputs(t, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, n, generator=g) * 3 + 1).to(dtype)  # a mean and a spread to remove
    r = torch.randn(t, n, generator=g).to(dtype)
    w = (torch.randn(n, generator=g) * 0.5 + 1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, r, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,n", [(1, 16), (7, 384), (1001, 384), (33, 768), (5, 48)])
@pytest.mark.parametrize("residual,bias", [(True, True), (False, True), (True, False)])
def test_matches_torch_in_every_build(c_builds, dtype, t, n, residual, bias):
    x, r, w, b = _inputs(t, n, dtype, seed=t * n)
    r, b = (r if residual else None), (b if bias else None)
    want = add_layer_norm(x, r, w, b, 1e-12)
    for name, lib in c_builds.items():
        got = cpu_norms.add_layer_norm(x, r, w, b, 1e-12, lib=lib)
        assert got.dtype == dtype and got.shape == x.shape
        _close_to_torch(got, want, name)


def _close_to_torch(got, want, name):
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=name)
    else:  # the same float32 value rounded once: at most one bfloat16 step apart, almost always equal
        diff = (got.float() - want.float()).abs()
        step = want.float().abs().clamp_min(1e-3) * 2**-7
        assert bool((diff <= step).all()), name
        assert (got != want).float().mean().item() < 1e-3, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,n", [(1, 16), (7, 576), (1001, 576), (33, 64), (5, 48)])
@pytest.mark.parametrize("residual", [True, False])
def test_rms_norm_matches_torch_in_every_build(c_builds, dtype, t, n, residual):
    x, r, w, _ = _inputs(t, n, dtype, seed=t + n)
    r = r if residual else None
    want, want_sum = add_rms_norm(x, r, w, 1e-6)
    for name, lib in c_builds.items():
        got, got_sum = cpu_norms.add_rms_norm(x, r, w, 1e-6, lib=lib)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.equal(got_sum, want_sum), name  # the sum rounded as torch's add rounds it
        assert (got_sum is x) == (not residual), name
        _close_to_torch(got, want, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_into_x_and_strided_rows(dtype):
    x, r, w, _ = _inputs(9, 64, dtype, seed=4)
    plain, plain_sum = cpu_norms.add_rms_norm(x, r, w, 1e-6)
    over_x = x.clone()
    got, got_sum = cpu_norms.add_rms_norm(over_x, r, w, 1e-6, out=over_x)
    assert got.data_ptr() == over_x.data_ptr() and torch.equal(got, plain) and torch.equal(got_sum, plain_sum)
    wide = torch.zeros(9, 3 * 64, dtype=dtype)
    wide[:, 64:128] = x
    strided_out = torch.full((9, 2 * 64), 7.0, dtype=dtype)
    cpu_norms.add_rms_norm(wide[:, 64:128], r, w, 1e-6, out=strided_out[:, :64])
    assert torch.equal(strided_out[:, :64], plain) and bool((strided_out[:, 64:] == 7).all())
    with pytest.raises(ValueError, match="out may be x only when a residual is given"):
        cpu_norms.add_rms_norm(x, None, w, 1e-6, out=x)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_norms.add_rms_norm(x[:, :40], None, w[:40], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_and_strided_rows(dtype):
    x, r, w, b = _inputs(9, 64, dtype, seed=3)
    want = add_layer_norm(x, r, w, b, 1e-5)
    over_x = x.clone()
    assert cpu_norms.add_layer_norm(over_x, r, w, b, 1e-5, out=over_x).data_ptr() == over_x.data_ptr()
    over_r = r.clone()
    cpu_norms.add_layer_norm(x, over_r, w, b, 1e-5, out=over_r)
    wide = torch.zeros(9, 3 * 64, dtype=dtype)  # rows 192 apart, each 64 contiguous
    wide[:, 64:128] = x
    strided_out = torch.full((9, 2 * 64), 7.0, dtype=dtype)
    cpu_norms.add_layer_norm(wide[:, 64:128], r, w, b, 1e-5, out=strided_out[:, :64])
    plain = cpu_norms.add_layer_norm(x, r, w, b, 1e-5)
    for got in (over_x, over_r, strided_out[:, :64]):
        assert torch.equal(got, plain)
    assert bool((strided_out[:, 64:] == 7).all())  # nothing written past each row
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.04, "rtol": 0.02}
    torch.testing.assert_close(plain, want, **tol)


def test_bad_input_names_the_problem():
    x, r, w, b = _inputs(4, 40, torch.float32, seed=1)  # 40: not a multiple of the kernel's 16
    assert not cpu_norms.supports(x, w, b)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_norms.add_layer_norm(x, r, w, b, 1e-5)
    x, r, w, b = _inputs(4, 32, torch.float32, seed=1)
    with pytest.raises(ValueError, match="weight"):
        cpu_norms.add_layer_norm(x, r, w.double(), b, 1e-5)
    with pytest.raises(ValueError, match="residual must be"):
        cpu_norms.add_layer_norm(x, r[:3], w, b, 1e-5)
    with pytest.raises(ValueError, match="out must be"):
        cpu_norms.add_layer_norm(x, r, w, b, 1e-5, out=torch.empty(4, 32, dtype=torch.bfloat16))
    assert not cpu_norms.supports(x.t(), w[:4])  # columns not contiguous


@pytest.mark.parametrize("ffn", ["blocks", "fused"])
def test_bert_layers_in_place_match_transformers(tmp_path, minilm_path, ffn, monkeypatch):
    """The post-norms in the C kernel, written over the layer's own GEMM outputs; the FFN in row blocks of 5 tokens
    (a partial last block) overwriting their rows: transformers' hidden states on shuffled ragged inputs."""
    import random

    import numpy as np
    from conftest import cosine_rows
    from tiny_encoders import tiny_encoder
    from transformers import AutoModel, AutoTokenizer

    from lab.models import bert
    from lab.models.folder import read_folder, read_state_dict
    from lab.ops.batch import PackedBatch

    monkeypatch.setattr(bert, "FFN_ROWS", 5)
    calls, real = [], cpu_norms.add_layer_norm
    monkeypatch.setattr(cpu_norms, "add_layer_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    path = tiny_encoder(tmp_path / "bert", minilm_path, "bert", hidden=48, heads=3)
    spec = read_folder(path)
    ours = bert.BertModel.from_hf_config(spec.config).eval()
    ours.load_hf_state_dict(read_state_dict(spec))
    ours.plan.update({"add_layer_norm": "lab", "bert_ffn": ffn})
    ref = AutoModel.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["a", "hello world", "", "the quick brown fox jumps over the lazy dog", "naïve café 東京", "x " * 20]
    random.Random(5).shuffle(texts)
    ids = [np.asarray(x) for x in tok(texts)["input_ids"]]
    batch = PackedBatch.build(ids, causal=False, device=torch.device("cpu"))
    with torch.no_grad():
        got = ours(batch.input_ids, batch.positions, batch.meta)
        s = 0
        for x in ids:
            want = ref(input_ids=torch.from_numpy(x)[None]).last_hidden_state[0]
            assert cosine_rows(got[s : s + len(x)].numpy(), want.numpy()).min() >= 0.99999
            torch.testing.assert_close(got[s : s + len(x)], want, atol=2e-5, rtol=1e-4)
            s += len(x)
    blocks = -(-batch.meta.num_tokens // 5) if ffn == "blocks" else 1
    assert len(calls) == 1 + spec.config["num_hidden_layers"] * (1 + blocks)  # embeddings; per layer attention, FFN


def test_bert_under_autograd_keeps_torchs_norms(tmp_path, minilm_path, monkeypatch):
    """The kernel has no backward: with gradients recorded (training), a plan that chose it runs torch's ops, and
    the LayerNorm weights get gradients."""
    import numpy as np
    from tiny_encoders import tiny_encoder

    from lab.models.bert import BertModel
    from lab.models.folder import read_folder, read_state_dict
    from lab.ops.batch import PackedBatch

    calls, real = [], cpu_norms.add_layer_norm
    monkeypatch.setattr(cpu_norms, "add_layer_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    spec = read_folder(tiny_encoder(tmp_path / "bert", minilm_path, "bert", hidden=48, heads=3))
    ours = BertModel.from_hf_config(spec.config)
    ours.load_hf_state_dict(read_state_dict(spec))
    ours.plan.update({"add_layer_norm": "lab", "bert_ffn": "fused"})  # (the row blocks write with out=: no autograd)
    batch = PackedBatch.build(
        [np.array([101, 7592, 2088, 102]), np.array([101, 102])], causal=False, device=torch.device("cpu")
    )
    with torch.enable_grad():
        out = ours(batch.input_ids, batch.positions, batch.meta)
        out.sum().backward()
    assert not calls and out.grad_fn is not None
    assert ours.layers[0].attn_norm.weight.grad is not None and ours.emb_norm.weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(
            ours(batch.input_ids, batch.positions, batch.meta), out.detach(), atol=2e-5, rtol=1e-5
        )
    assert calls  # and without gradients, the kernel


def test_the_triton_backend_keeps_its_own_norms(monkeypatch):
    """A plan that chose the C kernels does not reroute the Triton backend's norms (BERT's post-norm, the decoders'
    pre-norm): only the torch backend's."""
    from lab.models import bert, decoder
    from lab.ops.attention import ops
    from lab.ops.batch import AttnMeta

    calls = []
    for name in ("add_layer_norm", "add_rms_norm"):
        real = getattr(cpu_norms, name)
        monkeypatch.setattr(cpu_norms, name, lambda *a, _real=real, **kw: calls.append(1) or _real(*a, **kw))
    norm = torch.nn.LayerNorm(32)
    x, r = torch.randn(6, 32), torch.randn(6, 32)
    plan = {"add_layer_norm": "lab", "add_rms_norm": "lab"}
    triton = AttnMeta.from_lengths([4, 2], causal=False, backend="triton")
    monkeypatch.setattr(decoder, "ops", lambda meta: ops("torch"))  # Triton's kernels are not what this checks
    with torch.no_grad():
        assert not bert._lab_norm(x, norm, triton, plan)
        assert bert._lab_norm(x, norm, AttnMeta.from_lengths([4, 2], causal=False), plan)
        decoder.add_rms_norm(x, r, norm.weight, 1e-6, triton, plan)
        assert not calls
        decoder.add_rms_norm(x, r, norm.weight, 1e-6, AttnMeta.from_lengths([4, 2], causal=False), plan)
    assert calls == [1]
