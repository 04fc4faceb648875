"""The oneDNN-fused FFN paths compute the same function as the plain torch ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lab.kernels import cpu_attention

from lab.ops.attention import KERNELS
from lab.ops.gemm import ACTIVATIONS, activation_inplace, fusable, linear, linear_act, row_blocks
from lab.ops.plan import CpuPlan
from lab.ops.probes import CANDIDATES


@pytest.mark.parametrize(
    "act_name,act",
    [("gelu", F.gelu), ("gelu_new", lambda x: F.gelu(x, approximate="tanh")), ("relu", F.relu), ("silu", F.silu)],
)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_linear_act_matches_plain(act_name, act, dtype, tol):
    x, w, b = torch.randn(37, 24, dtype=dtype), torch.randn(40, 24, dtype=dtype) * 0.2, torch.randn(40, dtype=dtype)
    want = act(F.linear(x.float(), w.float(), b.float()))
    torch.testing.assert_close(linear_act(x, w, b, act_name, act).float(), want, atol=tol, rtol=tol)


def test_fusable_only_for_cpu_float32_bfloat16_and_known_activations():
    assert not fusable(torch.zeros(2, 2, dtype=torch.float16), "gelu")
    assert not fusable(torch.zeros(2, 2), "unknown_act")


@pytest.mark.parametrize("mode", ["native", "widened"])
def test_bfloat16_linear_is_bfloat16_gemm_arithmetic(monkeypatch, mode):
    """Both bfloat16 GEMM modes do a bfloat16 GEMM's arithmetic (exact products, float32 sums, rounded once to
    bfloat16): within one bfloat16 rounding of the float64 product, with and without bias and ``out=`` (a row block
    of a larger output); dtype stays bfloat16. Native mode calls oneDNN's linear op where it takes bfloat16, and
    only where autograd does not record."""
    from lab.ops import gemm as fused

    plan = CpuPlan({"bf16_gemm": mode})
    calls = []
    real = fused.onednn_linear
    monkeypatch.setattr(fused, "onednn_linear", lambda *a: calls.append(1) or real(*a))
    x, w, b = torch.randn(33, 48).bfloat16(), (torch.randn(20, 48) * 0.2).bfloat16(), torch.randn(20).bfloat16()
    with torch.inference_mode():
        for bias in (b, None):
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            got = fused.linear(x, w, bias, plan=plan)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3)
            out = torch.zeros(40, 20, dtype=torch.bfloat16)
            fused.linear(x, w, bias, plan=plan, out=out[3:36])
            torch.testing.assert_close(out[3:36].double(), want, rtol=2**-8, atol=1e-3)
            assert not out[:3].any() and not out[36:].any()
        act = fused.linear_act(x, w, b, "gelu", F.gelu, plan=plan)
        assert act.dtype == torch.bfloat16
        torch.testing.assert_close(
            act.double(), F.gelu(F.linear(x.double(), w.double(), b.double())), rtol=2**-7, atol=1e-2
        )
    onednn = mode == "native" and fused.onednn_bf16()
    assert len(calls) == (4 if onednn else 0)  # the chosen implementation ran
    layer = fused.Linear(48, 20, plan=plan)
    assert isinstance(layer, torch.nn.Linear)
    layer = layer.bfloat16()
    torch.testing.assert_close(layer(x), fused.linear(x, layer.weight, layer.bias, plan=plan))
    assert len(calls) == (4 if onednn else 0)  # grad mode: never oneDNN's op (it has no backward)


def test_widened_weight_is_made_once_per_dtype_switch(monkeypatch):
    """Widened bfloat16 GEMMs read one float32 copy of each weight (views share it), made again only when the
    parameter's data changes (a dtype switch or adapter merge replaces ``.data``), never once per call."""
    from lab.ops import gemm as fused

    plan = CpuPlan({"bf16_gemm": "widened"})
    layer = fused.Linear(48, 20, plan=plan).bfloat16()
    x = torch.randn(5, 48).bfloat16()
    first = fused.wide_weight(layer.weight, plan)
    assert first.dtype == torch.float32 and torch.equal(first, layer.weight.float())
    with torch.inference_mode():
        layer(x)
        assert fused.wide_weight(layer.weight, plan).data_ptr() == first.data_ptr()  # the same copy, not a new one
        rows = layer.weight[4:9]  # a row block (as q/k/v slices are) reads the same copy
        assert fused.wide_weight(rows, plan).data_ptr() == first[4:9].data_ptr()
        torch.testing.assert_close(fused.wide_weight(rows, plan), rows.float(), rtol=0, atol=0)
    layer.weight.data = (layer.weight.float() * 2).bfloat16()  # what Weights.set_dtype / set_merged do
    again = fused.wide_weight(layer.weight, plan)
    assert again.data_ptr() != first.data_ptr() and torch.equal(again, layer.weight.float())


def test_cpu_paths_are_probed_and_can_be_forced(minilm_path, monkeypatch):
    """The engine's CPU fast paths come from probes on this machine (reported in ``cpu_paths``), per dtype; each
    choice is one of its probe's candidates, and forcing the other candidates (``cpu_paths=``, for that engine
    alone) changes no output. Nothing here assumes which candidate this CPU prefers or how many probes run."""
    from lab import Engine
    from lab.ops import gemm as fused
    from lab.ops import probes

    texts = ["a probe", "another text, longer than the first one"]
    eng = Engine(minilm_path)
    paths = eng.resolved["cpu_paths"]
    made = {d.name: d for d in eng.runner.decisions}
    assert {"f32_gemm", "bert_qkv", "bert_ffn", "attention_kernel"} <= set(paths) and set(made) <= set(paths)
    for name, d in made.items():  # every decision: a registered candidate, by probe here (nothing forced)
        assert d.choice == paths[name] and d.choice in CANDIDATES[name] and d.source == "probe"
        assert set(d.seconds) <= set(CANDIDATES[name]) and (len(d.seconds) != 1)  # timed, or nothing to time
    # the weight layout is probed where float32 GEMMs went to oneDNN (and torch can reorder weights)
    assert ("f32_weights" in made) == (paths["f32_gemm"] == "onednn" and fused.onednn_packing())
    assert ("add_layer_norm" in made) == cpu_attention.available()  # offered where the C library built
    assert paths["attention_kernel"] in KERNELS
    measured = {(d.name, d.key) for d in probes.decisions()}
    assert all((d.name, d.key) in measured for d in made.values())
    base = eng.embed(texts)
    eng.configure(dtype="bfloat16")
    assert eng.cpu_paths["bf16_gemm"] in CANDIDATES["bf16_gemm"] and "f32_gemm" not in eng.cpu_paths
    eng.configure(dtype="float32")
    assert eng.cpu_paths == paths  # the measurements are reused: the same plan again
    # force the other offered candidate of every probe that had a choice (the timings say what was offered)
    other = {name: next(c for c in d.seconds if c != d.choice) for name, d in made.items() if len(d.seconds) > 1}
    forced = Engine(minilm_path, cpu_paths=other)
    applied = {name: choice for name, choice in other.items() if name in forced.cpu_paths}
    assert all(forced.cpu_paths[name] == choice for name, choice in applied.items())
    assert set(other) - set(applied) <= {"f32_weights"}  # the layout applies only to GEMMs run in oneDNN
    assert all(d.source == "engine" for d in forced.runner.decisions if d.name in other)
    calls = _count_matmul_attention(monkeypatch)
    np.testing.assert_allclose(forced.embed(texts), base, atol=2e-6)
    assert (calls["n"] > 0) == (forced.cpu_paths["attention_kernel"] == "matmul")
    assert eng.cpu_paths == paths  # the first engine kept its own plan
    np.testing.assert_array_equal(eng.embed(texts), base)
    if cpu_attention.available():  # prefill-lab's own kernel, forced: it runs, once per layer and step
        own, real = [], cpu_attention.varlen_attention
        monkeypatch.setattr(cpu_attention, "varlen_attention", lambda *a, **kw: own.append(1) or real(*a, **kw))
        lab_kernel = Engine(minilm_path, cpu_paths={"attention_kernel": "lab"})
        assert lab_kernel.cpu_paths["attention_kernel"] == "lab"
        np.testing.assert_allclose(lab_kernel.embed(texts), base, atol=2e-6)
        assert own and len(own) % 6 == 0  # six layers, once per step of each worker
    monkeypatch.setenv("LAB_CPU_BERT_QKV", "sideways")
    with pytest.raises(ValueError, match="LAB_CPU_BERT_QKV='sideways'.*valid: .*auto"):
        Engine(minilm_path)
    with pytest.raises(ValueError, match=r"cpu_paths\['bert_qkv'\]='sideways' is not a choice; valid: split, stacked"):
        Engine(minilm_path, cpu_paths={"bert_qkv": "sideways"})
    with pytest.raises(ValueError, match="unknown fast path 'bert_kqv'; valid: .*bert_qkv"):
        Engine(minilm_path, cpu_paths={"bert_kqv": "split"})


def test_weight_layout_is_probed_and_can_be_forced(minilm_path, monkeypatch):
    """Where float32 GEMMs run in oneDNN, the weight layout is probed (``f32_weights``, reported in ``cpu_paths``);
    ``cpu_paths={"f32_weights": ...}`` (or ``LAB_CPU_F32_WEIGHTS``) forces it with the same embeddings (the same
    products, summed in another order: float32 rounding), and a wrong value names the valid ones."""
    from lab import Engine
    from lab.ops import gemm as fused

    if not (_has_fused_op() and fused.onednn_packing()):
        pytest.skip("this torch build cannot reorder weights for oneDNN")
    texts = ["a", "weights reordered once into oneDNN's blocked layout " * 9, "Paris", "x y z " * 40]
    got = {}
    for layout in ("plain", "packed"):
        eng = Engine(minilm_path, cpu_paths={"f32_gemm": "onednn", "f32_weights": layout})
        d = {d.name: d for d in eng.runner.decisions}["f32_weights"]
        assert eng.cpu_paths["f32_weights"] == layout == eng.runner.plan.weights(torch.float32)
        assert d.source == "engine"
        got[layout] = eng.embed(texts)
    np.testing.assert_allclose(got["plain"], got["packed"], atol=2e-6)
    probed = {d.name: d for d in Engine(minilm_path, cpu_paths={"f32_gemm": "onednn"}).runner.decisions}
    assert probed["f32_weights"].source == "probe" and set(probed["f32_weights"].seconds) == {"packed", "plain"}
    monkeypatch.setenv("LAB_CPU_F32_WEIGHTS", "blocked")
    with pytest.raises(ValueError, match="LAB_CPU_F32_WEIGHTS='blocked'.*valid: packed, plain, auto"):
        Engine(minilm_path, cpu_paths={"f32_gemm": "onednn"})


def test_dtype_switch_drops_derived_weights(minilm_path):
    """A dtype switch (and an adapter merge, through the same swap) drops every copy derived from a weight (packed,
    widened): nothing stale is kept in memory, and switching back remakes them with the same embeddings."""
    from lab import Engine
    from lab.ops import gemm as fused

    if not (_has_fused_op() and fused.onednn_packing()):
        pytest.skip("this torch build cannot reorder weights for oneDNN")
    eng = Engine(minilm_path, cpu_paths={"f32_gemm": "onednn", "f32_weights": "packed"})
    texts = ["packed weights", "and a dtype switch " * 5]
    first = eng.embed(texts)

    def copies(stale: bool):
        """The kinds of the copies kept: made from the live data, or (``stale``) from older data."""
        return [kind for kind, _, current in eng.runner.plan.copies() if current != stale]

    assert "packed" in copies(False) and copies(True) == []
    eng.configure(dtype="bfloat16")  # the bfloat16 probes may make copies of layer 0's weights, from the new data
    assert copies(True) == []
    eng.embed(texts)
    eng.configure(dtype="float32")
    assert copies(True) == []
    np.testing.assert_allclose(eng.embed(texts), first, rtol=0, atol=1e-7)
    assert "packed" in copies(False) and copies(True) == []


@pytest.mark.parametrize("mode,layout", [("blas", "plain"), ("onednn", "plain"), ("onednn", "packed")])
def test_float32_linear_modes_compute_f_linear(monkeypatch, mode, layout):
    """Both float32 GEMM modes, oneDNN's with each weight layout, give ``F.linear`` (to float32 rounding), with and
    without bias and ``out=`` (a row block of a larger output); oneDNN is not used where autograd records (it has
    no backward)."""
    from lab.ops import gemm as fused

    if mode == "onednn" and not _has_fused_op():
        pytest.skip("this torch build has no oneDNN torch.ops.mkldnn._linear_pointwise")
    if layout == "packed" and not fused.onednn_packing():
        pytest.skip("this torch build cannot reorder weights for oneDNN")
    plan = CpuPlan({"f32_gemm": mode, "f32_weights": layout})
    calls = []
    real = fused.onednn_linear
    monkeypatch.setattr(fused, "onednn_linear", lambda *a: calls.append(1) or real(*a))
    assert plan.f32_gemm == mode and plan.weights(torch.float32) == layout
    x, w, b = torch.randn(37, 24), torch.randn(40, 24) * 0.2, torch.randn(40)
    with torch.inference_mode():
        for bias in (b, None):
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            torch.testing.assert_close(fused.linear(x, w, bias, plan=plan).double(), want, atol=1e-5, rtol=1e-5)
            out = torch.zeros(50, 40)
            fused.linear(x, w, bias, plan=plan, out=out[5:42])
            torch.testing.assert_close(out[5:42].double(), want, atol=1e-5, rtol=1e-5)
            assert not out[:5].any() and not out[42:].any()
    assert len(calls) == (4 if mode == "onednn" else 0)  # the chosen implementation ran
    wg = w.clone().requires_grad_()
    fused.linear(x, wg, b, plan=plan).sum().backward()  # grad mode: the BLAS path, which has a backward
    torch.testing.assert_close(wg.grad, x.sum(0).expand(40, 24))
    assert len(calls) == (4 if mode == "onednn" else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weight_is_made_once_per_view_until_its_data_changes(monkeypatch, dtype):
    """In ``packed`` mode oneDNN's GEMMs read each weight reordered once into its blocked layout: one copy per base
    tensor and row block (q/k/v slices), reused by every call and by the fused-activation path, remade when the
    data changes (``.data`` replaced, as a dtype switch or adapter merge does, or changed in place); outputs equal
    the plain layout's to float32 / bfloat16 rounding, for odd shapes, one row, and no bias."""
    from lab.ops import gemm as fused

    if not (_has_fused_op() and fused.onednn_packing()):
        pytest.skip("this torch build cannot reorder weights for oneDNN")
    if dtype == torch.bfloat16 and not fused.onednn_bf16():
        pytest.skip("oneDNN does not take bfloat16 on this CPU")
    plan = CpuPlan({"f32_gemm": "onednn", "bf16_gemm": "native", "f32_weights": "packed", "bf16_weights": "packed"})
    monkeypatch.setattr(fused, "PACK_ROWS", 256)
    layer = fused.Linear(29, 3 * 37, plan=plan).to(dtype)
    rows = [layer.weight[j * 37 : (j + 1) * 37] for j in range(3)]
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2**-7}
    with torch.inference_mode():
        first = fused.packed_weight(layer.weight, plan)
        assert first is fused.packed_weight(layer.weight, plan) and first.layout == torch._mkldnn
        blocks = [fused.packed_weight(r, plan) for r in rows]
        assert len({id(b) for b in blocks + [first]}) == 4 and all(
            fused.packed_weight(r, plan) is b for r, b in zip(rows, blocks)
        )
        assert fused.packed_weight(layer.weight, CpuPlan()) is not first  # another engine's plan: its own copy
        asked, real = [], fused.packed_weight
        monkeypatch.setattr(fused, "packed_weight", lambda w, p: asked.append(w.shape) or real(w, p))
        for n in (1, 2, 33):
            x = torch.randn(n, 29, dtype=dtype)
            want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
            torch.testing.assert_close(layer(x).double(), want, **tol)
            torch.testing.assert_close(
                fused.linear(x, rows[1], None, plan=plan).double(), F.linear(x.double(), rows[1].double()), **tol
            )
            torch.testing.assert_close(
                fused.linear_act(x, layer.weight, layer.bias, "gelu", F.gelu, plan=plan).double(), F.gelu(want), **tol
            )
        assert asked == [(111, 29), (37, 29), (111, 29)] * 3  # every GEMM read the packed layout
        assert real(layer.weight, plan) is first  # and reused it
    layer.weight.data = (layer.weight.float() * 2).to(dtype)  # what Weights.set_dtype / set_merged do
    with torch.inference_mode():
        again = real(layer.weight, plan)
        assert again is not first
        x = torch.randn(5, 29, dtype=dtype)
        torch.testing.assert_close(
            layer(x).double(), F.linear(x.double(), layer.weight.double(), layer.bias.double()), **tol
        )
    with torch.no_grad():
        layer.weight.mul_(-1)  # in place: the version changes
    with torch.inference_mode():
        assert real(layer.weight, plan) is not again
        torch.testing.assert_close(
            layer(x).double(), F.linear(x.double(), layer.weight.double(), layer.bias.double()), **tol
        )
        made_here = torch.randn(11, 29, dtype=dtype)  # an inference tensor: no version counter
        torch.testing.assert_close(
            fused.linear(x, made_here, plan=plan).double(), F.linear(x.double(), made_here.double()), **tol
        )
        assert real(made_here, plan) is real(made_here, plan)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_inplace_equals_activation_and_writes_its_input(name):
    x = torch.randn(9, 13) * 3
    want = ACTIVATIONS[name](x.clone())
    y = x.clone()
    got = activation_inplace(name)(y)
    assert got.data_ptr() == y.data_ptr()
    torch.testing.assert_close(y, want, atol=0, rtol=0)


@pytest.mark.parametrize("t,rows", [(1, 4), (37, 8), (37, 37), (64, 16)])
def test_row_blocks_equals_whole_ffn(t, rows):
    x, up, down, b = torch.randn(t, 24), torch.randn(40, 24) * 0.2, torch.randn(16, 40) * 0.2, torch.randn(16)
    want = F.linear(F.gelu(F.linear(x, up)), down, b)
    got = row_blocks(x, down, b, rows, lambda r: activation_inplace("gelu")(linear(r, up)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _has_fused_op() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@pytest.mark.parametrize("act_name,act", [("gelu", F.gelu), ("silu", F.silu)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_fused_path_is_taken_on_cpu(monkeypatch, act_name, act, dtype, tol):
    """Where oneDNN's fused op exists, CPU float32 inputs with a supported activation take it: one
    ``torch.ops.mkldnn._linear_pointwise`` call, equal to the unfused ``act(F.linear(...))``; bfloat16 ones too where
    oneDNN's linear takes bfloat16 on this CPU (``onednn_bf16``), and where it does not (no AVX-512) the plain ops run,
    equal all the same."""
    if not _has_fused_op():
        pytest.skip("this torch build has no oneDNN torch.ops.mkldnn._linear_pointwise: there is no fused path")
    from lab.ops import gemm as fused

    x, w, b = torch.randn(37, 24, dtype=dtype), torch.randn(40, 24, dtype=dtype) * 0.2, torch.randn(40, dtype=dtype)
    takes = dtype == torch.float32 or fused.onednn_bf16()
    assert fused.fusable(x, act_name) == takes
    real, calls = torch.ops.mkldnn._linear_pointwise, []

    def counting(*args, **kwargs):
        calls.append(args[3:])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
    got = fused.linear_act(x, w, b, act_name, act)
    assert calls == ([(fused._ONEDNN_ACT[act_name][0], [], fused._ONEDNN_ACT[act_name][1])] if takes else [])
    assert got.dtype == dtype and got.shape == (37, 40)
    torch.testing.assert_close(got.float(), act(F.linear(x, w, b)).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("mode", ["blas", "onednn"])
def test_decoder_float32_gemm_modes_match_transformers(tmp_path, monkeypatch, mode):
    """A tiny Llama through the Engine with each float32 GEMM mode forced (``LAB_CPU_F32_GEMM``): the mode is the
    one reported, and mean-pooled embeddings of shuffled odd-length inputs (one of a single token) equal
    transformers' forward, one sequence at a time, within float32 rounding."""
    if mode == "onednn" and not _has_fused_op():
        pytest.skip("this torch build has no oneDNN torch.ops.mkldnn._linear_pointwise")
    from tiny_models import tiny_llama

    from lab import Engine

    monkeypatch.setenv("LAB_CPU_F32_GEMM", mode)  # the process default, read when the engine decides
    folder = str(tiny_llama(tmp_path, "llama"))
    eng = Engine(folder, pooling="mean", max_batch_tokens=48)
    assert eng.cpu_paths["f32_gemm"] == mode == eng.runner.plan.f32_gemm
    texts = [
        "a",
        "Rotary position embeddings rotate queries and keys. " * 3,
        "Paris is the capital of France",
        "x y z " * 11,
        "What?",
    ]
    got = eng.embed(texts)
    np.testing.assert_allclose(got, _transformers_mean(folder, eng.tokenize(texts)), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("mode", ["whole", "blocks"])
def test_decoder_causal_attention_modes_match_transformers(tmp_path, monkeypatch, mode):
    """Causal attention in query blocks (``causal_attention`` = ``blocks``, forced by ``cpu_paths``)
    or whole: the mode is the one reported, and the embeddings of texts longer than three blocks (with short ones
    beside them, shuffled) equal transformers' forward, one sequence at a time, within float32 rounding."""
    from tiny_models import tiny_llama

    from lab import Engine
    from lab.models.decoder import CAUSAL_BLOCK

    folder = str(tiny_llama(tmp_path, "llama"))
    # the torch path (sdpa), where the blocks live
    eng = Engine(
        folder, pooling="mean", max_length=256, cpu_paths={"causal_attention": mode, "attention_kernel": "sdpa"}
    )
    assert eng.cpu_paths["causal_attention"] == mode and eng.cpu_paths["attention_kernel"] == "sdpa"
    texts = [
        "Rotary position embeddings rotate queries and keys. " * 9,
        "a",
        "What?",
        "x y z " * 40,
        "Paris is the capital of France. " * 20,
    ]
    reqs = eng.tokenize(texts)
    assert sum(3 * CAUSAL_BLOCK < r.length < 256 for r in reqs) == 3  # the blocked path runs (nothing truncated)
    got = eng.embed(texts)
    np.testing.assert_allclose(got, _transformers_mean(folder, reqs), rtol=1e-5, atol=2e-6)


def test_decoder_attention_kernel_is_probed_without_the_three_op_path(tmp_path, monkeypatch):
    """Decoders probe torch's fused kernel against prefill-lab's own (where it built) and are never offered
    ``matmul``, which rounds scores to bfloat16: asking for it names the valid choices."""
    from tiny_models import tiny_llama

    from lab import Engine

    folder = str(tiny_llama(tmp_path, "llama"))
    eng = Engine(folder, pooling="mean")
    made = [d for d in eng.runner.decisions if d.name == "attention_kernel"]
    assert len(made) == 1 and set(made[0].seconds) == ({"sdpa", "lab"} if cpu_attention.available() else {"sdpa"})
    assert eng.cpu_paths["attention_kernel"] == made[0].choice
    with pytest.raises(ValueError, match=r"cpu_paths\['attention_kernel'\]='matmul' is not a attention_kernel choice"):
        Engine(folder, pooling="mean", cpu_paths={"attention_kernel": "matmul"})
    monkeypatch.setenv("LAB_CPU_ATTENTION_KERNEL", "matmul")
    with pytest.raises(ValueError, match="LAB_CPU_ATTENTION_KERNEL='matmul' is not a attention_kernel choice"):
        Engine(folder, pooling="mean")


def _count_matmul_attention(monkeypatch) -> dict:
    """Count calls of the torch kernels' matmul attention path (``attention_kernel`` = ``matmul``)."""
    from lab.kernels import reference

    calls, real = {"n": 0}, reference._matmul_attention

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(reference, "_matmul_attention", counted)
    return calls


@pytest.mark.parametrize("layout,kernel", [("halves", None), ("pairs", "torch"), ("pairs", "lab")])
def test_decoder_rope_layouts_match_transformers(tmp_path, monkeypatch, layout, kernel):
    """Each rotary layout forced (``cpu_paths``; ``pairs`` permutes the q/k projection rows at load), the
    ``pairs`` rotation in torch or prefill-lab's C kernel (``rope_kernel``): the choices are the ones
    reported, the embeddings equal transformers' forward within float32 rounding, plainly, in chunks of 7 tokens
    (keys cached in the model's own layout) and behind a cached instruction prefix, and a dtype round trip keeps the
    layout and the outputs."""
    from lab.kernels import cpu_rope
    from tiny_models import tiny_llama

    from lab import Engine

    if kernel == "lab" and not cpu_rope.available():
        pytest.skip(f"the C kernels did not build here: {cpu_rope.unavailable_reason()}")
    forced = {"rope_layout": layout, **({"rope_kernel": kernel} if kernel else {})}
    folder = str(tiny_llama(tmp_path, "qwen2"))  # q/k/v biases and grouped-query attention
    eng = Engine(folder, pooling="mean", cpu_paths=forced)
    assert eng.cpu_paths["rope_layout"] == layout == eng.model.rope_layout
    assert eng.cpu_paths.get("rope_kernel") == (kernel if cpu_rope.available() else None)
    texts = [
        "Rotary position embeddings rotate queries and keys. " * 3,
        "a",
        "Paris is the capital of France",
        "x y z " * 11,
        "What?",
    ]
    want = _transformers_mean(folder, eng.tokenize(texts))
    got = eng.embed(texts)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    eng.configure(chunked_prefill=7)
    np.testing.assert_allclose(eng.embed(texts), want, rtol=1e-4, atol=1e-5)
    eng.configure(chunked_prefill=None, instruction="Represent this sentence: ")
    instructed = eng.tokenize(texts)
    starts = [r.pool_start for r in instructed]
    assert min(starts) > 0
    np.testing.assert_allclose(eng.embed(texts), _transformers_mean(folder, instructed, starts), rtol=1e-4, atol=1e-5)
    eng.configure(instruction=None, dtype="bfloat16")
    eng.configure(dtype="float32")
    assert eng.cpu_paths["rope_layout"] == layout
    np.testing.assert_array_equal(eng.embed(texts), got)


def _transformers_mean(folder: str, requests, starts: list[int] | None = None) -> np.ndarray:
    """transformers' float32 forward of ``folder``, one tokenized request at a time, mean-pooled from ``starts``
    (default 0; an instruction's tokens are left out) (the reference of the decoder tests above)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    starts = starts or [0] * len(requests)
    with torch.no_grad():
        return np.stack(
            [
                model(input_ids=torch.tensor([list(r.ids)])).last_hidden_state[0, s:].mean(0).numpy()
                for r, s in zip(requests, starts)
            ]
        )
