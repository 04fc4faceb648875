"""The ``layer`` knob: pool the hidden states after layer k, running only the first k layers.

Every embedding is checked against transformers' ``output_hidden_states=True`` -> ``hidden_states[k]`` on the same
weights, pooled by hand one text at a time (float32, normalize=False: direction by cosine, scale by norm ratio).
For decoders ``hidden_states[k]`` is the un-normed residual stream below the last layer and the final-normed output
at it, so the final RMSNorm must be applied exactly when k is the last layer. Tiny random checkpoints: a 4-layer
Qwen3 (q/k norms, GQA) and a 4-layer BERT.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import cosine_rows
from tiny_encoders import tiny_encoder
from tiny_models import tiny_llama

from lab import Engine

L = 4  # layers of both tiny models
LAYERS = [*range(L + 1), -1, -2, -L]  # every k in 0..L and negative ones
POOLINGS = ["mean", "cls", "lasttoken"]
COS_MIN = 0.9999
TEXTS = [  # odd lengths (decoder tokenizer: 1, 3, 7, 30, 45, ... tokens), one of a single token; no empty text
    "a",
    "fox",
    "What is the capital?",
    "Paris",
    "Embeddings map text to vectors; rerankers score.",
    "The quick brown fox jumps over the lazy dog. Rotary position embeddings rotate.",
    "A packed batch holds many sequences.",
]
INSTRUCTION = "Given a question, retrieve passages that answer it: "


def resolve(k: int) -> int:
    """The hidden_states index of a layer knob value: -1 = the last layer (L), -L = the first."""
    return L + 1 + k if k < 0 else k


def pool_ref(h: torch.Tensor, pooling: str, start: int = 0) -> np.ndarray:
    """One sequence's ``(n, H)`` hidden states pooled by hand from token ``start`` on."""
    h = h[start:]
    return {"mean": h.mean(0), "cls": h[0], "lasttoken": h[-1]}[pooling].numpy()


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    cos = cosine_rows(got, want)
    assert cos.min() >= COS_MIN, f"{what}: min cosine {cos.min():.6f} ({np.round(cos, 6).tolist()})"
    ratio = np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert np.abs(ratio - 1).max() <= 1e-4, f"{what}: norm ratio {ratio.tolist()}"


class Reference:
    """transformers' ``hidden_states`` (all L + 1) of each token sequence, computed once per (ids, causal)."""

    def __init__(self, model, decoder: bool):
        self.model, self.decoder, self.cache = model, decoder, {}

    def hidden(self, ids: list[int], causal: bool) -> tuple[torch.Tensor, ...]:
        key = (tuple(ids), causal)
        if key not in self.cache:
            x = torch.tensor([ids])
            if not self.decoder:
                mask = torch.ones_like(x)
            else:  # bidirectional: an all-zeros 4D float mask replaces the causal one (every token sees every token)
                mask = None if causal else torch.zeros(1, 1, len(ids), len(ids))
            with torch.no_grad():
                out = self.model(input_ids=x, attention_mask=mask, output_hidden_states=True)
            assert len(out.hidden_states) == L + 1
            self.cache[key] = tuple(h[0] for h in out.hidden_states)
        return self.cache[key]

    def pooled(self, ids_list, k: int, pooling: str, causal: bool, starts=None) -> np.ndarray:
        starts = starts or [0] * len(ids_list)
        return np.stack([pool_ref(self.hidden(ids, causal)[k], pooling, s) for ids, s in zip(ids_list, starts)])


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def dec_folder(tmp_path_factory):
    return str(tiny_llama(tmp_path_factory.mktemp("layer-dec"), "qwen3", num_hidden_layers=L))


@pytest.fixture(scope="module")
def dec_ref(dec_folder):
    from transformers import AutoModel

    return Reference(AutoModel.from_pretrained(dec_folder, dtype=torch.float32).eval(), decoder=True)


@pytest.fixture(scope="module")
def enc_folder(tmp_path_factory, minilm_path):
    return str(tiny_encoder(tmp_path_factory.mktemp("layer-enc") / "bert", minilm_path, "bert", layers=L))


@pytest.fixture(scope="module")
def enc_ref(enc_folder):
    from transformers import AutoModel

    return Reference(AutoModel.from_pretrained(enc_folder, dtype=torch.float32).eval(), decoder=False)


def token_ids(eng: Engine, texts: list[str]) -> list[list[int]]:
    """The reference's tokens: the tokenizer's own output (append_eos=False, no empty text: what the engine runs)."""
    return [list(x) for x in eng.tokenizer(texts)["input_ids"]]


def shuffled(texts: list[str]) -> list[str]:
    texts = texts * 2
    random.shuffle(texts)
    return texts


# ------------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_decoder_every_layer_matches_transformers(dec_folder, dec_ref, causal):
    eng = Engine(dec_folder, normalize=False, append_eos=False, bidirectional=not causal, max_batch_tokens=48)
    texts = shuffled(TEXTS)
    ids = token_ids(eng, texts)
    assert min(map(len, ids)) == 1 and len({len(x) for x in ids}) > 3
    assert [list(r.ids) for r in eng.tokenize(texts)] == ids  # the engine runs these tokens
    for k in LAYERS:
        for pooling in POOLINGS:
            eng.configure(layer=k, pooling=pooling)
            assert eng.resolved["layer"] == resolve(k)
            got = eng.embed(texts)
            assert_same(got, dec_ref.pooled(ids, resolve(k), pooling, causal), f"layer={k} {pooling} causal={causal}")


def test_encoder_every_layer_matches_transformers(enc_folder, enc_ref):
    eng = Engine(enc_folder, normalize=False, max_batch_tokens=40)
    assert not eng.is_decoder and eng.model.num_layers == L
    texts = shuffled(TEXTS)
    ids = token_ids(eng, texts)
    for k in LAYERS:
        for pooling in POOLINGS:
            eng.configure(layer=k, pooling=pooling)
            got = eng.embed(texts)
            assert_same(got, enc_ref.pooled(ids, resolve(k), pooling, False), f"encoder layer={k} {pooling}")


def test_below_last_layer_the_decoder_skips_the_final_norm(dec_folder, dec_ref):
    """At k < L the engine's rows equal ``hidden_states[k]`` and differ from its final-normed version (so the
    parity above can tell them apart), and at k = L they equal the normed last hidden state."""
    from transformers import AutoModel

    eng = Engine(dec_folder, normalize=False, append_eos=False, pooling="lasttoken", layer=2)
    ids = token_ids(eng, TEXTS)
    got = eng.embed(TEXTS)
    norm = AutoModel.from_pretrained(dec_folder, dtype=torch.float32).eval().norm
    with torch.no_grad():
        normed = np.stack([norm(dec_ref.hidden(x, True)[2])[-1].numpy() for x in ids])
    assert_same(got, dec_ref.pooled(ids, 2, "lasttoken", True), "layer=2")
    assert cosine_rows(got, normed).max() < 0.999
    eng.configure(layer=None)
    assert_same(eng.embed(TEXTS), dec_ref.pooled(ids, L, "lasttoken", True), "last layer")


# ------------------------------------------------------------------------------------- KV path: chunks, prefix cache
@pytest.mark.parametrize("pooling", POOLINGS)
def test_chunked_prefill_at_each_layer_equals_unchunked(dec_folder, dec_ref, pooling):
    texts = shuffled(TEXTS)
    plain = Engine(dec_folder, normalize=False, append_eos=False, pooling=pooling)
    chunked = Engine(
        dec_folder,
        normalize=False,
        append_eos=False,
        pooling=pooling,
        chunked_prefill=3,
        max_batch_tokens=40,
        max_num_seqs=4,
    )
    ids = token_ids(plain, texts)
    for k in LAYERS:
        plain.configure(layer=k)
        chunked.configure(layer=k)
        full, got = plain.embed(texts), chunked.embed(texts)
        assert chunked.stats.chunks > len(texts)  # inputs really ran in pieces, layer by layer
        assert_same(got, full, f"chunked layer={k}")
        assert_same(got, dec_ref.pooled(ids, resolve(k), pooling, True), f"chunked layer={k} vs transformers")


@pytest.mark.parametrize("chunk", [None, 3])
def test_prefix_cache_at_each_layer(dec_folder, dec_ref, chunk):
    """An instruction shared by every input: computed once (prefix cache) for the first k layers only."""
    texts = shuffled(TEXTS)
    eng = Engine(
        dec_folder, normalize=False, append_eos=False, pooling="mean", instruction=INSTRUCTION, chunked_prefill=chunk
    )
    reqs = eng.tokenize(texts, instruction=INSTRUCTION)
    ids, starts = [list(r.ids) for r in reqs], [r.pool_start for r in reqs]
    assert min(starts) > 3
    for k in LAYERS:
        for prefix_cache in (True, False):
            eng.configure(layer=k, prefix_cache=prefix_cache)
            got = eng.embed(texts)
            assert (eng.stats.shared_prefix > 0) == (prefix_cache and resolve(k) > 0)  # layer 0: nothing to share
            want = dec_ref.pooled(ids, resolve(k), "mean", True, starts)
            assert_same(got, want, f"instruction layer={k} prefix_cache={prefix_cache} chunk={chunk}")


# ------------------------------------------------------------------------------------------- only k layers run
class LayerCalls:
    """Forward calls per layer of ``model.layers`` (hooks)."""

    def __init__(self, model):
        self.counts = [0] * len(model.layers)
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(model.layers)]

    def _hook(self, i):
        def hook(*_):
            self.counts[i] += 1

        return hook

    def take(self) -> list[int]:
        counts, self.counts = self.counts, [0] * len(self.counts)
        return counts

    def close(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("which", ["decoder", "encoder"])
def test_only_the_first_k_layers_run(which, dec_folder, enc_folder):
    folder = dec_folder if which == "decoder" else enc_folder
    eng = Engine(folder, normalize=False, append_eos=False, cpu_workers=1)  # one forward per packed step
    calls = LayerCalls(eng.model)
    try:
        for k in LAYERS:
            n = resolve(k)
            for pooling in POOLINGS:  # cls / lasttoken: the decoder's last computed layer runs for pooled rows only
                eng.configure(layer=k, pooling=pooling)
                eng.embed(TEXTS)
                assert eng.stats.batches == 1
                assert calls.take() == [1] * n + [0] * (L - n), (k, pooling)
        if which == "decoder":  # the KV path: each layer runs once per round of chunks, none past k
            finish = eng.model.finish
            finished = []  # one entry per final-norm call (``finish(..., last=True)``)

            def counting_finish(x, residual, meta, *, last):
                finished.extend([1] if last else [])
                return finish(x, residual, meta, last=last)

            eng.model.finish = counting_finish
            eng.configure(chunked_prefill=4, pooling="mean")
            for k in LAYERS:
                eng.configure(layer=k)
                eng.embed(TEXTS)
                counts = calls.take()
                rounds = counts[0] if resolve(k) else 2
                assert counts == [rounds] * resolve(k) + [0] * (L - resolve(k)) and rounds > 1, (k, counts)
                assert bool(finished) == (resolve(k) == L), k  # the final norm only after the last layer
                finished.clear()
    finally:
        calls.close()


# ------------------------------------------------------------------------------------------ score / rerank paths
def test_cross_encoder_scores_from_layer_k(tmp_path, minilm_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = tiny_encoder(tmp_path / "ce", minilm_path, "bert", num_labels=1, layers=L)
    pairs = [("what is the capital?", "Paris is the capital of France."), ("a", "fox"), ("q", "")]
    eng = Engine(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    for k in (0, 1, -2, None):
        eng.configure(layer=k)
        want = []
        with torch.no_grad():
            for q, d in pairs:
                hs = model.bert(**tok([q], [d], return_tensors="pt"), output_hidden_states=True).hidden_states
                cls = hs[L if k is None else resolve(k)][:, 0]
                want.append(model.classifier(torch.tanh(model.bert.pooler.dense(cls)))[0, 0].item())
        np.testing.assert_allclose(eng.score(pairs, activation=None), want, atol=2e-6, rtol=0)


def test_llm_yes_no_from_layer_k(dec_folder):
    """The yes/no reranker reads LM logits off the hidden state after layer k (a logit lens: no final norm)."""
    from transformers import AutoModelForCausalLM

    from lab.engine.rerank import YesNoPrompt

    prompt = YesNoPrompt(system="Judge: yes or no.", instruction="Find it", yes_token="ĠFrance", no_token="Ġcapital")
    pairs = [("What is the capital of France?", "Paris is the capital of France."), ("fox", "the lazy dog")]
    eng = Engine(dec_folder, layer=2)
    tok = eng.tokenizer
    yes, no = tok.convert_tokens_to_ids("ĠFrance"), tok.convert_tokens_to_ids("Ġcapital")
    model = AutoModelForCausalLM.from_pretrained(dec_folder, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for q, d in pairs:
            text = f"Judge: yes or no.\n\n<Instruct>: Find it\n<Query>: {q}\n<Document>: {d}\n\nAnswer (yes or no):\n"
            ids = tok(text, add_special_tokens=False)["input_ids"]
            h = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[2][0, -1]
            logits = model.lm_head(h)
            want.append((logits[yes] - logits[no]).item())
    for prefix_cache in (True, False):
        eng.configure(prefix_cache=prefix_cache)
        np.testing.assert_allclose(eng.score(pairs, prompt=prompt, activation=None), want, atol=2e-5, rtol=0)
        assert (eng.stats.shared_prefix > 0) == prefix_cache


def test_transformers_fallback_pools_hidden_states_k(tmp_path, minilm_path, enc_ref):
    path = tiny_encoder(tmp_path / "fb", minilm_path, "bert", layers=L)  # same seed: the weights enc_ref holds
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["SomethingElseModel"]  # not in our registry: transformers AutoModel, padded
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="no packed implementation"):
        eng = Engine(str(path), pooling="mean", normalize=False)
    assert eng.model.num_layers == L and eng.resolved["layer"] == L
    ids = token_ids(eng, TEXTS)
    for k in (0, 1, -1, None):
        eng.configure(layer=k)
        want = enc_ref.pooled(ids, L if k is None else resolve(k), "mean", False)
        assert_same(eng.embed(TEXTS), want, f"fallback layer={k}")
        assert eng.stats.path.startswith("transformers-fallback")
    with pytest.raises(ValueError, match="has 4 layers"):
        eng.configure(layer=5)


# ------------------------------------------------------------------------------------------- knob, errors, naming
def test_layer_errors_leave_the_engine_unchanged(dec_folder):
    eng = Engine(dec_folder, layer=2, pooling="mean")
    before, resolved, emb = eng.knobs, eng.resolved, eng.embed(TEXTS)
    msg = "layer=5 but this model has 4 layers; valid: 0..4, -4..-1, or None"
    with pytest.raises(ValueError, match=msg.replace(".", r"\.")):
        eng.configure(layer=5, pooling="cls")
    with pytest.raises(ValueError, match="layer=-5 but this model has 4 layers"):
        eng.configure(layer=-5)
    for bad in (1.5, "2", True):
        with pytest.raises(TypeError, match="layer must be an int"):
            eng.configure(layer=bad, pooling="cls")
    assert eng.knobs == before and eng.resolved == resolved
    np.testing.assert_array_equal(eng.embed(TEXTS), emb)
    with pytest.raises(ValueError, match="layer=40 but this model has 4 layers"):
        Engine(dec_folder, layer=40)
    with pytest.raises(TypeError, match="layer must be an int"):
        Engine(dec_folder, layer=2.0)
    assert eng.configure(layer=np.int64(-1)).knobs["layer"] == -1  # numpy ints (a sweep) are fine


def test_resolved_and_repr(dec_folder):
    eng = Engine(dec_folder)
    assert eng.knobs["layer"] is None and eng.resolved["layer"] == L and "layer=" not in repr(eng)
    eng.configure(layer=-1)
    assert eng.resolved["layer"] == L and "layer=" not in repr(eng)
    eng.configure(layer=-3)
    assert eng.resolved["layer"] == 2 and "layer=2," in repr(eng)
    eng.configure(layer=-L)
    assert eng.resolved["layer"] == 1 and "layer=1," in repr(eng)
    eng.configure(layer=0)
    assert eng.resolved["layer"] == 0 and "layer=0," in repr(eng)
    eng.configure(layer=L)
    assert eng.resolved["layer"] == L and "layer=" not in repr(eng)


def test_mteb_experiment_names_carry_the_layer(dec_folder):
    pytest.importorskip("mteb")
    from lab.eval.mteb_adapter import as_mteb_model

    eng = Engine(dec_folder)
    model = as_mteb_model(eng)

    def meta(layer):
        eng.configure(layer=layer)
        m = model.mteb_model_meta
        return (m.experiment_kwargs or {}).get("layer"), m.experiment_name

    last, last_name = meta(None)
    assert last is None and last_name is None  # the last layer at the model's defaults: the plain run's folder
    assert meta(-1) == (None, last_name) and meta(L) == (None, last_name)  # one variant, one cache folder
    two, two_name = meta(2)
    assert two == 2 and two_name != last_name and "layer_2" in two_name
    assert meta(-3) == (2, two_name)
    assert meta(0)[1] not in (last_name, two_name)
