"""``lab.models.decoder`` against transformers on the same weights: per-sequence hidden states of packed batches.

Tiny random checkpoints (``tests/tiny_models.py``: 2 layers, hidden 64, 4 query heads over 2 key/value heads) of
each family; the packed forward must match transformers' base model (``AutoModel`` -> ``last_hidden_state``) run
one sequence at a time, token by token, with cosine >= 0.9999 in float32.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tiny_models import KINDS, tiny_llama

from lab.models.decoder import DecoderModel
from lab.models.rope import rope_from_config
from lab.ops.batch import AttnMeta, KVStep

os.environ.setdefault("HF_HUB_OFFLINE", "1")
COS_MIN = 0.9999
LENGTHS = [5, 1, 7, 7, 3, 1]  # odd lengths, length 1, and a run of equal lengths (one batched SDPA call)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoders")
    return {kind: tiny_llama(root, kind) for kind in KINDS}


def ours(folder, rope_layout: str = "halves") -> DecoderModel:
    config = json.loads((folder / "config.json").read_text())
    model = DecoderModel.from_hf_config(config)
    model.layout["rope_layout"] = rope_layout  # before loading: the layout decides where q/k rows go
    model.load_hf_state_dict(load_file(str(folder / "model.safetensors")))
    return model.eval()


def theirs(folder, cls_name: str = "AutoModel"):
    import transformers

    return getattr(transformers, cls_name).from_pretrained(folder, dtype=torch.float32).eval()


def packed(lengths: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    return ids, positions


def assert_close_per_token(ours_h: torch.Tensor, ref_h: torch.Tensor, what: str) -> float:
    cos = F.cosine_similarity(ours_h.float(), ref_h.float(), dim=-1)
    assert cos.min().item() >= COS_MIN, f"{what}: min cosine {cos.min().item():.6f} (per token {cos.tolist()})"
    return cos.min().item()


def compare_with_transformers(model, ref, lengths, *, causal: bool, what: str) -> None:
    ids, positions = packed(lengths, model.args.vocab_size)
    with torch.no_grad():
        hidden = model(ids, positions, AttnMeta.from_lengths(lengths, causal=causal))
        assert hidden.shape == (sum(lengths), model.hidden_size)
        start = 0
        for n in lengths:
            x = ids[start : start + n][None]
            # Bidirectional reference: transformers uses a 4D attention mask as given (additive, float), so an
            # all-zeros (1, 1, n, n) mask replaces its causal mask with "every token sees every token".
            mask = None if causal else torch.zeros(1, 1, n, n)
            ref_h = ref(input_ids=x, attention_mask=mask).last_hidden_state[0]
            assert_close_per_token(hidden[start : start + n], ref_h, f"{what} len {n}")
            start += n


def _with_kernel(model: DecoderModel, kernel: str, monkeypatch) -> list:
    """Set the CPU ``attention_kernel`` choice in the plan; for ``lab``, count its calls (skip where it did not
    build)."""
    from lab.kernels import cpu_attention

    model.plan["attention_kernel"] = kernel
    calls, real = [], cpu_attention.varlen_attention
    if kernel == "lab":
        if not cpu_attention.available():
            pytest.skip(f"cpu_attention did not build here: {cpu_attention.unavailable_reason()}")
        monkeypatch.setattr(cpu_attention, "varlen_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("kernel", ["sdpa", "lab"])  # torch's fused kernel, prefill-lab's own (CPU choice)
@pytest.mark.parametrize("kind", KINDS)
def test_causal_matches_transformers(folders, kind, kernel, monkeypatch):
    model = ours(folders[kind])
    calls = _with_kernel(model, kernel, monkeypatch)
    assert model.default_causal and model.is_decoder
    compare_with_transformers(model, theirs(folders[kind]), LENGTHS + [33, 70], causal=True, what=kind)
    assert len(calls) == (len(model.layers) if kernel == "lab" else 0)


@pytest.mark.parametrize("kernel", ["sdpa", "lab"])
@pytest.mark.parametrize("kind", KINDS)
def test_bidirectional_matches_transformers(folders, kind, kernel, monkeypatch):
    model = ours(folders[kind])
    calls = _with_kernel(model, kernel, monkeypatch)
    compare_with_transformers(model, theirs(folders[kind]), LENGTHS + [33, 70], causal=False, what=kind)
    assert len(calls) == (len(model.layers) if kernel == "lab" else 0)


def test_bidirectional_config_flag_matches_transformers_is_causal(folders):
    """A config with ``is_causal: false`` defaults to bidirectional, as transformers 5's mask creation reads it."""
    from transformers import AutoConfig, AutoModel

    folder = folders["qwen3"]
    config = json.loads((folder / "config.json").read_text())
    for flag in ({"is_causal": False}, {"use_bidirectional_attention": True}):
        assert DecoderModel.from_hf_config({**config, **flag}).default_causal is False
    ref_config = AutoConfig.from_pretrained(folder)
    ref_config.is_causal = False
    ref = AutoModel.from_pretrained(folder, config=ref_config).eval()
    model = ours(folder)
    compare_with_transformers(model, ref, [6, 2], causal=False, what="is_causal=False")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        {"rope_type": "dynamic", "factor": 2.0},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_matches_transformers(tmp_path, rope):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    folder = tiny_llama(tmp_path, "llama", rope_scaling=dict(rope))
    config = json.loads((folder / "config.json").read_text())
    model = ours(folder)
    ref_rope = LlamaRotaryEmbedding(AutoConfig.from_pretrained(folder))
    torch.testing.assert_close(model.rope.inv_freq, ref_rope.inv_freq, rtol=1e-6, atol=0)
    assert model.rope.attention_scaling == pytest.approx(ref_rope.attention_scaling)
    # the old spelling (rope_scaling + top-level rope_theta) reads the same
    old = {k: v for k, v in config.items() if k != "rope_parameters"}
    old_rope = rope_from_config({**old, "rope_scaling": dict(rope), "rope_theta": 10000.0}, model.args.head_dim)
    torch.testing.assert_close(old_rope.inv_freq, model.rope.inv_freq)
    # long enough that scaled and unscaled frequencies differ (original context 32)
    compare_with_transformers(model, theirs(folder), [70, 1, 45], causal=True, what=rope["rope_type"])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("layout", ["halves", "pairs"])
def test_chunked_prefill_with_kv_prefix_equals_unchunked(folders, kind, layout):
    """Step 1 captures K/V of the first chunks; step 2 attends to them as a prefix (positions continue).

    Step 2 also carries a sequence with no prefix at all, so prefix lengths differ within one step. In the ``pairs``
    rotary layout the cached keys are in the model's own order, and step 2 reads them alike.
    """
    model = ours(folders[kind], layout)
    full = [11, 6, 4]  # sequence C (4 tokens) only appears in step 2
    first = [5, 3]
    ids, positions = packed(full, model.args.vocab_size)
    with torch.no_grad():
        whole = model(ids, positions, AttnMeta.from_lengths(full, causal=True))
    seqs = list(torch.split(ids, full))
    step1_ids = torch.cat([seqs[0][:5], seqs[1][:3]])
    step1_pos = torch.cat([torch.arange(5), torch.arange(3)])
    captured = {}
    kv1 = KVStep(num_layers=model.num_layers, capture=lambda i, k, v: captured.__setitem__(i, (k.clone(), v.clone())))
    with torch.no_grad():
        h1 = model(step1_ids, step1_pos, AttnMeta.from_lengths(first, causal=True, kv=kv1))
    assert sorted(captured) == list(range(model.num_layers))
    assert all(k.shape == (8, model.args.num_kv_heads, model.args.head_dim) for k, _ in captured.values())
    kv2 = KVStep(
        num_layers=model.num_layers,
        cu_prefix=torch.tensor([0, 5, 8, 8], dtype=torch.int32),
        prefix_lens=[5, 3, 0],
        prefix_k=[captured[i][0] for i in range(model.num_layers)],
        prefix_v=[captured[i][1] for i in range(model.num_layers)],
    )
    second = [6, 3, 4]
    step2_ids = torch.cat([seqs[0][5:], seqs[1][3:], seqs[2]])
    step2_pos = torch.cat([torch.arange(5, 11), torch.arange(3, 6), torch.arange(4)])
    with torch.no_grad():
        h2 = model(step2_ids, step2_pos, AttnMeta.from_lengths(second, causal=True, kv=kv2))
    a1, b1 = torch.split(h1, first)
    a2, b2, c2 = torch.split(h2, second)
    wa, wb, wc = torch.split(whole, full)
    for got, want, name in ((torch.cat([a1, a2]), wa, "A"), (torch.cat([b1, b2]), wb, "B"), (c2, wc, "C")):
        assert_close_per_token(got, want, f"{kind} chunked {name}")
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # tied and untied output embeddings
def test_lm_logits_match_causal_lm(folders, kind):
    folder = folders[kind]
    model = ours(folder)
    ref = theirs(folder, "AutoModelForCausalLM")
    lengths = [4, 1]
    ids, positions = packed(lengths, model.args.vocab_size)
    with torch.no_grad():
        hidden = model(ids, positions, AttnMeta.from_lengths(lengths, causal=True))
        last = torch.tensor([3, 4])
        logits = model.lm_logits(hidden[last])
        picked = model.lm_logits(hidden[last], token_ids=[7, 3, 11])
        want = torch.stack([ref(input_ids=ids[:4][None]).logits[0, -1], ref(input_ids=ids[4:][None]).logits[0, -1]])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(picked, want[:, [7, 3, 11]], rtol=1e-4, atol=1e-4)


def test_missing_weights_are_named(folders):
    folder = folders["qwen2"]
    config = json.loads((folder / "config.json").read_text())
    sd = load_file(str(folder / "model.safetensors"))
    del sd["model.layers.1.self_attn.k_proj.bias"]
    del sd["model.norm.weight"]
    with pytest.raises(KeyError) as err:
        DecoderModel.from_hf_config(config).load_hf_state_dict(sd)
    assert "missing weights: norm.weight, layers.1.self_attn.k_proj.bias (" in str(err.value)


def test_unprefixed_names_and_embedding_only_checkpoint(folders):
    """Weights without ``model.`` (a ``Qwen2Model`` export) and without ``lm_head`` load; LM logits then refuse."""
    folder = folders["qwen2"]
    config = json.loads((folder / "config.json").read_text())
    sd = {k.removeprefix("model."): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    sd.pop("lm_head.weight")
    model = DecoderModel.from_hf_config(config)
    model.load_hf_state_dict(sd)
    with pytest.raises(ValueError, match="lm_head"):
        model.lm_logits(torch.zeros(1, model.hidden_size))
    compare_with_transformers(model.eval(), theirs(folder), [3, 2], causal=True, what="unprefixed")


def test_bfloat16_stays_close_and_keeps_float32_rope(folders):
    folder = folders["qwen3"]
    model = ours(folder)
    lengths = [9, 1, 4]
    ids, positions = packed(lengths, model.args.vocab_size)
    meta = AttnMeta.from_lengths(lengths, causal=True)
    with torch.no_grad():
        h32 = model(ids, positions, meta)
        h16 = model.to(torch.bfloat16)(ids, positions, meta)
    assert h16.dtype == torch.bfloat16 and model.rope.inv_freq.dtype == torch.float32
    assert F.cosine_similarity(h16.float(), h32, dim=-1).min() > 0.99


def test_sliding_window_longer_context_is_refused(tmp_path):
    folder = tiny_llama(tmp_path, "mistral", sliding_window=8)
    model = ours(folder)
    ids, positions = packed([8, 9], model.args.vocab_size)
    with pytest.raises(ValueError, match="sliding-window"):
        model(ids, positions, AttnMeta.from_lengths([8, 9], causal=True))


@pytest.mark.slow
def test_smollm2_from_gguf_matches_transformers():
    """SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized once to a cached safetensors folder) vs transformers."""
    from transformers import AutoModel, AutoTokenizer

    from lab.models.gguf import smollm2_path

    try:
        folder = smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model = ours(folder)
    assert model.args.tie_word_embeddings and model.args.num_kv_heads < model.args.num_heads
    tok = AutoTokenizer.from_pretrained(folder)
    ref = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    texts = [
        "The capital of France is Paris.",
        "Packed prefill runs many sequences of different lengths in one step.",
        "Hi",
    ]
    enc = [tok(t)["input_ids"] for t in texts]
    lengths = [len(e) for e in enc]
    ids = torch.tensor([i for e in enc for i in e])
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        hidden = model(ids, positions, AttnMeta.from_lengths(lengths, causal=True))
        for h, e in zip(torch.split(hidden, lengths), enc):
            ref_h = ref(input_ids=torch.tensor([e])).last_hidden_state[0]
            assert_close_per_token(h, ref_h, f"SmolLM2 {len(e)} tokens")


def test_row_blocked_mlp_equals_whole(folders, monkeypatch):
    """CPU steps longer than ``MLP_ROWS`` run the FFN in row blocks; the hidden states must not change."""
    from lab.models import decoder

    model = ours(folders["qwen2"])  # biases on q/k/v: every projection path
    lengths = [13, 1, 7, 22]
    ids, positions = packed(lengths, model.args.vocab_size)
    meta = AttnMeta.from_lengths(lengths, causal=True)
    with torch.no_grad():
        whole = model(ids, positions, meta)
        monkeypatch.setattr(decoder, "MLP_ROWS", 5)  # 43 tokens: 8 full blocks and a 3-row tail
        blocked = model(ids, positions, meta)
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("method", ["lasttoken", "cls"])
def test_output_rows_equal_the_full_forward_at_those_rows(folders, kind, causal, method):
    """The last layer run for the pooled rows only (``output_rows``) gives the full forward's rows there: with and
    without an instruction prefix (``pool_start``), length-1 sequences, GQA, q/k-norm and qkv bias variants."""
    from lab.ops.batch import OutputRows
    from lab.outputs.pooling import pooling_method

    model = ours(folders[kind])
    ids, pos = packed(LENGTHS, model.args.vocab_size)
    meta = AttnMeta.from_lengths(LENGTHS, causal=causal)
    pool = pooling_method(method)
    for pool_start in ([0] * len(LENGTHS), [2, 0, 3, 6, 1, 0]):
        rows = pool.rows(LENGTHS, pool_start)
        with torch.no_grad():
            want = pool(model(ids, pos, meta), meta, torch.tensor(pool_start))
            got = pool.from_rows(model(ids, pos, meta, output_rows=OutputRows.build(meta, rows)))
        assert got.shape == want.shape == (len(LENGTHS), model.hidden_size)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_pooled_rows_are_the_rows_pool_reads():
    from lab.outputs.pooling import pooling_method

    def rows(method, lengths, pool_start=None):
        return pooling_method(method).rows(lengths, pool_start or [0] * len(lengths))

    assert rows("lasttoken", [3, 1, 2]).tolist() == [2, 3, 5]
    assert rows("cls", [3, 1, 2]).tolist() == [0, 3, 4]
    assert rows("cls", [3, 1, 2], [2, 0, 1]).tolist() == [2, 3, 5]
    assert rows("cls", [3, 1, 2], [3, 0, 0]) is None  # an instruction covering a whole input
    assert rows("lasttoken", [3, 0, 2]) is None  # an empty sequence
    for method in ("mean", "max", "weightedmean", "tokens"):
        assert rows(method, [3, 1, 2]) is None


# ------------------------------------------------------------------------------------------- rotary layouts
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [True, False])
def test_pairs_layout_matches_transformers_and_halves(folders, kind, causal):
    """The ``pairs`` rotary layout (q/k projection rows permuted at load, the rotation a complex multiply) against
    transformers and against the ``halves`` model on the same packed batch: GQA, qkv biases (Qwen2), per-head q/k
    norms (Qwen3), length-1 sequences, and the last layer computed for the pooled rows only."""
    from lab.ops.batch import OutputRows
    from lab.outputs.pooling import pooling_method

    pairs, halves = ours(folders[kind], "pairs"), ours(folders[kind])
    assert pairs.rope_layout == "pairs" and halves.rope_layout == "halves"
    q_rows = pairs.args.num_heads * pairs.args.head_dim
    assert not torch.equal(pairs.layers[0].qkv.weight[:q_rows], halves.layers[0].qkv.weight[:q_rows])
    compare_with_transformers(pairs, theirs(folders[kind]), LENGTHS, causal=causal, what=f"{kind} pairs")
    ids, pos = packed(LENGTHS, pairs.args.vocab_size)
    meta = AttnMeta.from_lengths(LENGTHS, causal=causal)
    rows = pooling_method("lasttoken").rows(LENGTHS, [0] * len(LENGTHS))
    with torch.no_grad():
        torch.testing.assert_close(pairs(ids, pos, meta), halves(ids, pos, meta), rtol=1e-5, atol=1e-6)
        only = OutputRows.build(meta, rows)
        torch.testing.assert_close(
            pairs(ids, pos, meta, output_rows=only), halves(ids, pos, meta, output_rows=only), rtol=1e-5, atol=1e-6
        )


def test_pairs_layout_bfloat16_as_close_as_halves(folders):
    """bfloat16 in the ``pairs`` layout (the rotation through one float32 copy) stays as close to the float32 model
    as the ``halves`` bfloat16 model does."""
    pairs = ours(folders["qwen3"], "pairs")
    ids, pos = packed(LENGTHS, pairs.args.vocab_size)
    meta = AttnMeta.from_lengths(LENGTHS, causal=True)
    with torch.no_grad():
        want = pairs(ids, pos, meta)
        low = {
            layout: ours(folders["qwen3"], layout).to(torch.bfloat16)(ids, pos, meta).float()
            for layout in ("halves", "pairs")
        }
    err = {layout: (h - want).abs().max().item() for layout, h in low.items()}
    assert err["pairs"] <= 1.5 * err["halves"] + 1e-3, err


def test_rotate_pairs_equals_apply_rotary_in_the_permuted_layout():
    """``rotate_pairs_`` on a head in the ``pairs`` order equals ``apply_rotary`` on the same head in transformers'
    order: in place on a strided view of a fused projection (float32 / float64: a complex view), on a tensor whose
    strides forbid that view (a copy), and in bfloat16 (through float32, rounded once: no less accurate)."""
    from lab.kernels.reference import apply_rotary

    from lab.models.rope import RopeTables, pairs_order, pairs_rows, rotate_pairs_

    t, h, d = 37, 5, 16
    positions = torch.randint(0, 300, (t,))
    inv_freq = rope_from_config({"rope_theta": 10000.0}, d).inv_freq
    order = pairs_order(d)
    assert order.tolist()[:4] == [0, d // 2, 1, d // 2 + 1] and sorted(order.tolist()) == list(range(d))
    assert torch.equal(pairs_rows(2, d), torch.cat([order, d + order]))
    fused = torch.randn(t, 3 * h * d, dtype=torch.float64)
    x = fused[:, h * d : 2 * h * d].view(t, h, d)  # rows of stride 3 h d: the complex view works in place
    exact = RopeTables.at(positions, inv_freq, 1.3, "halves", torch.float64)
    want = apply_rotary(x.clone(), exact.cos, exact.sin)
    cis = RopeTables.at(positions, inv_freq, 1.3, "pairs", torch.float32).cis
    for dtype in (torch.float64, torch.float32):
        y = x[..., order].to(dtype)
        view = fused.to(dtype)[:, : h * d].view(t, h, d)
        view.copy_(y)
        got = rotate_pairs_(view, cis)
        assert got is view
        torch.testing.assert_close(got.double(), want[..., order], rtol=0, atol=1e-6)
    odd = torch.zeros(t, h * d + 1)[:, 1:].view(t, h, d)  # rows of odd stride: no complex view, a float32 copy
    odd.copy_(x[..., order])
    got = rotate_pairs_(odd, cis)
    assert got is odd and odd.stride(0) == h * d + 1
    torch.testing.assert_close(got.double(), want[..., order], rtol=0, atol=1e-6)
    low = x[..., order].to(torch.bfloat16)
    err_pairs = (rotate_pairs_(low.clone(), cis).double() - want[..., order]).abs().max()
    halves = RopeTables.at(positions, inv_freq, 1.3, "halves", torch.bfloat16)
    err_halves = (apply_rotary(x.to(torch.bfloat16), halves.cos, halves.sin).double() - want).abs().max()
    assert err_pairs <= err_halves, (err_pairs, err_halves)


@pytest.mark.parametrize("kind", KINDS)
def test_one_pass_pre_norms_match_transformers(folders, kind, monkeypatch):
    """The pre-norms (and the final norm) in prefill-lab's one-pass C kernel, as the ``add_rms_norm`` probe may
    choose: transformers' hidden states; with gradients recorded the plan's choice gives way to torch's ops."""
    from lab.kernels import cpu_norms

    if not cpu_norms.available():
        pytest.skip(f"the C kernels did not build here: {cpu_norms.unavailable_reason()}")
    calls, real = [], cpu_norms.add_rms_norm
    monkeypatch.setattr(cpu_norms, "add_rms_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = ours(folders[kind])
    model.plan["add_rms_norm"] = "lab"
    compare_with_transformers(model, theirs(folders[kind]), LENGTHS + [33], causal=True, what=kind)
    assert len(calls) == 2 * len(model.layers) + 1  # two per block, the final norm
    calls.clear()
    from lab.models.decoder import add_rms_norm

    x, r, meta = torch.randn(6, 64), torch.randn(6, 64), AttnMeta.from_lengths([4, 2], causal=True)
    with torch.enable_grad():  # nothing to differentiate through in the kernel: torch's ops
        add_rms_norm(x, r, model.layers[0].ln_attn, model.eps, meta, model.plan)
    assert not calls
