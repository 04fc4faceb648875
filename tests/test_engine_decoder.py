"""Decoder LLMs through the Engine: parity with transformers, the live bidirectional toggle, last-token pooling with
EOS, instructions excluded from pooling, chunked prefill == unchunked, prefix cache == no cache, and their errors."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from conftest import cosine_rows
from tiny_models import tiny_llama

from lab import Engine
from lab.engine.inputs import InputProcessor

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "a",
    "What is the capital of France?",
    "Rotary position embeddings rotate queries and keys.",
    "",
    "Embeddings map text to vectors; rerankers score a query against a document. " * 3,
    "Paris",
]
POOLINGS = ["mean", "lasttoken", "weightedmean", "cls", "max"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def any_folder(request, tmp_path_factory):
    return str(tiny_llama(tmp_path_factory.mktemp(request.param), request.param))


@pytest.fixture(scope="module", params=["llama", "qwen3"])  # the knob sweeps: GQA + bias-free and q/k-norm variants
def folder(request, tmp_path_factory):
    return str(tiny_llama(tmp_path_factory.mktemp(request.param), request.param))


def hf_hidden(path: str, texts_ids: list[list[int]], causal: bool) -> list[torch.Tensor]:
    """transformers' own forward, one sequence at a time. Bidirectional: the 4D float mask of zeros replaces
    transformers' causal mask (every query sees every key), which is exactly LLM2Vec's modification."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in texts_ids:
            x = torch.tensor([ids])
            kw = {} if causal else {"attention_mask": torch.zeros(1, 1, len(ids), len(ids))}
            out.append(model(input_ids=x, **kw).last_hidden_state[0])
    return out


@pytest.mark.parametrize("causal,workers", [(True, None), (False, 3)])
def test_engine_matches_transformers_and_toggles_live(any_folder, causal, workers):
    folder = any_folder
    eng = Engine(folder, pooling="mean", bidirectional=None, max_batch_tokens=40, cpu_workers=workers)
    assert eng.resolved.causal is True and eng.resolved.pooling == "mean"
    weight = eng.model.layers[0].qkv.weight
    eng.configure(bidirectional=not causal)
    texts = TEXTS[:]
    random.shuffle(texts)
    got = eng.embed(texts)
    ids = [list(r.ids) for r in eng.tokenize(texts)]
    want = np.stack([h.mean(0).numpy() for h in hf_hidden(folder, ids, causal)])
    assert cosine_rows(got, want).min() >= 0.9999
    assert eng.model.layers[0].qkv.weight is weight  # no reload
    one = eng.embed([texts[2]])  # batch of one, same answer
    assert cosine_rows(one, got[2:3]).min() >= 0.9999


def test_bidirectional_changes_embeddings(folder):
    eng = Engine(folder, pooling="mean")
    causal = eng.embed(TEXTS)
    eng.configure(bidirectional=True)
    bidir = eng.embed(TEXTS)
    assert cosine_rows(causal, bidir).min() < 0.999
    # a one-token input attends only to itself under either mask, so its embedding cannot change (no EOS: one token)
    eng.configure(append_eos=False)
    assert len(eng.tokenize(["a"])[0].ids) == 1
    one_bidir = eng.embed(["a"])
    eng.configure(bidirectional=None)
    one_causal = eng.embed(["a"])
    assert one_causal.shape == (1, 64) and np.abs(one_causal).max() > 0
    np.testing.assert_allclose(one_bidir, one_causal, atol=1e-6)
    eng.configure(append_eos=None)
    np.testing.assert_allclose(eng.embed(TEXTS), causal, atol=1e-6)


def test_lasttoken_default_appends_eos(folder):
    eng = Engine(folder)
    assert eng.resolved.pooling == "lasttoken" and eng.resolved.append_eos
    eos = eng.tokenizer.eos_token_id
    req = eng.tokenize(["hello there"])[0]
    assert req.ids[-1] == eos and (req.ids[:-1] != eos).all()
    got = eng.embed(["hello there"])
    want = hf_hidden(folder, [list(req.ids)], True)[0][-1].numpy()
    assert cosine_rows(got, want[None]).min() >= 0.9999
    eng.configure(append_eos=False)
    assert eng.tokenize(["hello there"])[0].ids[-1] != eos


def test_instruction_attended_not_pooled(folder):
    instr = "Given a question, retrieve passages that answer it: "
    eng = Engine(folder, pooling="mean", instruction=instr, prefix_cache=False)
    got = eng.embed(["What is the capital of France?"])
    req = eng.tokenize(["What is the capital of France?"])[0]
    n_instr = InputProcessor(eng.tokenizer, eng.resolved.max_length).instruction_length(instr)
    assert 0 < req.pool_start == n_instr < req.length
    h = hf_hidden(folder, [list(req.ids)], True)[0]
    assert cosine_rows(got, h[n_instr:].mean(0, keepdim=True).numpy()).min() >= 0.9999
    # include_instruction pools the instruction tokens too
    eng.configure(include_instruction=True)
    assert cosine_rows(eng.embed(["What is the capital of France?"]), h.mean(0, keepdim=True).numpy()).min() >= 0.9999
    # per-call override
    eng.configure(include_instruction=False)
    plain = Engine(folder, pooling="mean").embed(["What is the capital of France?"])
    np.testing.assert_allclose(eng.embed(["What is the capital of France?"], instruction=None), plain, atol=1e-6)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_chunked_prefill_equals_unchunked(folder, pooling):
    texts = TEXTS * 2
    random.shuffle(texts)
    full = Engine(folder, pooling=pooling).embed(texts)
    for chunk in (1, 5):
        eng = Engine(folder, pooling=pooling, chunked_prefill=chunk, max_batch_tokens=24, max_num_seqs=5)
        got = eng.embed(texts)
        assert cosine_rows(got, full).min() >= 0.9999, (pooling, chunk)
        assert eng.stats.chunks > len(texts) and eng.stats.tokens_computed == eng.stats.tokens


@pytest.mark.parametrize("pooling", ["mean", "lasttoken", "weightedmean", "cls"])
def test_chunked_prefill_with_instruction(folder, pooling):
    instr = "Represent this sentence for retrieval: "
    full = Engine(folder, pooling=pooling, instruction=instr, prefix_cache=False).embed(TEXTS)
    got = Engine(folder, pooling=pooling, instruction=instr, chunked_prefill=4, prefix_cache=False).embed(TEXTS)
    assert cosine_rows(got, full).min() >= 0.9999


@pytest.mark.parametrize("pooling", ["mean", "lasttoken", "weightedmean"])
def test_prefix_cache_equals_no_cache(folder, pooling):
    instr = "Given a web search query, retrieve relevant passages that answer the query. Query: "
    texts = TEXTS[:]
    random.shuffle(texts)
    plain = Engine(folder, pooling=pooling, instruction=instr, prefix_cache=False)
    ref = plain.embed(texts)
    assert plain.stats.tokens_computed == plain.stats.tokens
    eng = Engine(folder, pooling=pooling, instruction=instr, prefix_cache=True)
    got = eng.embed(texts)
    assert cosine_rows(got, ref).min() >= 0.9999
    s = eng.stats
    assert s.shared_prefix > 5 and s.tokens == plain.stats.tokens
    assert s.tokens_computed == s.tokens - s.shared_prefix * (len(texts) - 1)
    # chunked prefill on top of the prefix cache
    eng.configure(chunked_prefill=5)
    assert cosine_rows(eng.embed(texts), ref).min() >= 0.9999


def test_chunked_prefill_with_bidirectional_is_refused(folder):
    with pytest.raises(ValueError, match="bidirectional attention needs the whole sequence"):
        Engine(folder, chunked_prefill=8, bidirectional=True)
    eng = Engine(folder, chunked_prefill=8)
    with pytest.raises(ValueError, match="bidirectional attention needs the whole sequence"):
        eng.configure(bidirectional=True)
    assert eng.knobs["bidirectional"] is None  # unchanged after the refusal


def test_chunked_prefill_on_encoder_needs_causal(minilm_path):
    with pytest.raises(ValueError, match="needs causal attention"):
        Engine(minilm_path, chunked_prefill=8)
    eng = Engine(minilm_path, chunked_prefill=8, bidirectional=False)  # a causal BERT: allowed
    assert eng.embed(["a b c d e f g h i j k"]).shape == (1, 384)


def test_chunked_peak_cache_is_bounded_by_budget(folder):
    """Chunked prefill runs a group of long inputs layer by layer, holding across steps the group's hidden states +
    one layer's K/V (``stats.state_bytes``); a group's tokens stay within ``max_batch_tokens`` unless one input
    alone is longer (``lab.engine.kv_path``). Raising the budget so that all three inputs share a group raises it."""
    texts = [TEXTS[0]] * 3
    eng = Engine(folder, pooling="mean", dtype="float32", chunked_prefill=4, max_batch_tokens=8, max_num_seqs=2)
    n = len(eng.tokenize(texts[:1])[0].ids)
    assert n > 8  # each input alone is longer than the budget: one group per input
    a = eng.model.args
    per_token = 4 * (a.hidden_size + 2 * a.num_kv_heads * a.head_dim)  # float32 hidden states + one layer's K/V
    rounds = math.ceil(n / 4)  # chunks of 4 tokens; a group counts its rounds once, not once per layer

    def bound(budget: int) -> int:
        return per_token * max(budget, n)

    eng.embed(texts)
    small = eng.stats.state_bytes
    assert 0 < small <= bound(8)
    assert eng.stats.batches == 3 * rounds  # one group per input

    eng.configure(max_batch_tokens=3 * n, max_num_seqs=3)  # all three inputs fit one group
    eng.embed(texts)
    assert small < eng.stats.state_bytes <= bound(3 * n)
    assert eng.stats.batches == rounds


def test_chunked_prefill_memory_grows_with_chunk_not_length(tmp_path):
    """One long input: the tensor memory a chunked forward allocates (profiler memory events, exact) is the state
    it holds across steps — hidden states + one layer's K/V, a few values per token — plus what one chunk needs;
    an unchunked forward allocates every layer's activations for the whole input. Doubling the input adds only
    the state to the chunked peak, while growing the chunk adds activations."""
    from lab.eval.bench import peak_memory

    folder = tiny_llama(tmp_path, "llama", num_hidden_layers=4, intermediate_size=512, max_position_embeddings=4096)
    eng = Engine(str(folder), pooling="mean", max_length=4096, max_batch_tokens=4096)
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    long_text = {n: " ".join(words[i % len(words)] for i in range(n)) for n in (300, 600)}

    def peak(n: int, chunk: int | None) -> tuple[int, int]:
        eng.configure(chunked_prefill=chunk)
        _, nbytes = peak_memory(lambda: eng.embed([long_text[n]]))
        return nbytes, eng.stats.tokens

    full_1k, tokens_1k = peak(300, None)
    full_2k, tokens_2k = peak(600, None)
    c64_1k, _ = peak(300, 64)
    c64_2k, _ = peak(600, 64)
    c256_2k, _ = peak(600, 256)
    a = eng.model.args
    state_per_token = 4 * (a.hidden_size + 2 * a.num_kv_heads * a.head_dim)  # float32 hidden + one layer's K/V
    extra_tokens = tokens_2k - tokens_1k
    assert tokens_2k > 1.8 * tokens_1k
    # chunked: the peak is far below unchunked, and doubling the input adds the state plus a step's transients that
    # span the whole prefix (its K/V joined to the chunk's, the chunk x prefix causal mask): under 3x the state per
    # token, and under a quarter of what unchunked adds (measured: 2.1x the state, 0.18 of unchunked's growth)
    assert c64_2k < 0.5 * full_2k, (c64_2k, full_2k)
    growth = c64_2k - c64_1k
    assert growth < 3 * extra_tokens * state_per_token, (growth, extra_tokens * state_per_token)
    assert growth < 0.25 * (full_2k - full_1k), (growth, full_2k - full_1k)
    assert c256_2k > c64_2k  # bigger chunks, bigger steps
