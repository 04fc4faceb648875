"""Engine parity with sentence-transformers on all-MiniLM-L6-v2, live knobs and stats."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import cosine_rows

from lab import Engine


@pytest.mark.parametrize("budget,workers", [(8, None), (64, 3), (300, 1), (16384, None), (16384, 2)])
def test_parity_with_sentence_transformers_shuffled(minilm_path, minilm_st, sentences, budget, workers):
    texts = sentences * 3
    random.shuffle(texts)
    threads = torch.get_num_threads()
    eng = Engine(minilm_path, max_batch_tokens=budget, max_num_seqs=7, cpu_workers=workers)
    got = eng.embed(texts)
    ref = minilm_st.encode(texts, convert_to_numpy=True, batch_size=5)
    assert got.dtype == np.float32 and got.shape == (len(texts), 384)
    cos = cosine_rows(got, ref)
    assert cos.min() >= 0.99999, (cos.min(), texts[int(cos.argmin())][:50])
    np.testing.assert_allclose(got, ref, atol=2e-5)
    s = eng.stats
    assert s.sequences == len(texts) and s.padded_tokens == 0
    assert s.truncated == 3  # the one long sentence, three times
    assert s.batches >= 2 if budget <= 300 else s.batches >= 1
    assert torch.get_num_threads() == threads  # the CPU workers' thread counts stay theirs


def test_output_keeps_input_order(minilm_engine, sentences):
    one_by_one = np.stack([minilm_engine.embed([t])[0] for t in sentences])
    together = minilm_engine.embed(sentences)
    assert cosine_rows(one_by_one, together).min() >= 0.99999


def test_the_public_seam_runs_what_embed_runs(minilm_engine, sentences):
    """``embed_pass`` + ``run_passes`` (what ``lab.engine.rerank`` and ``lab.engine.st_encode`` build on): one call
    over several passes gives each pass's outputs in input order, and one ``Stats`` for all of them."""
    from lab.outputs.heads import TokensHead

    eng = minilm_engine
    dense, tokens = eng.run_passes(
        [eng.embed_pass(sentences, None), eng.embed_pass(sentences, None, "tokens", head=TokensHead())], "seam"
    )
    assert eng.stats.sequences == 2 * len(sentences)
    np.testing.assert_array_equal(dense, eng.embed(sentences, instruction=None))
    for ours, theirs in zip(tokens, eng.embed(sentences, output="tokens", instruction=None)):
        np.testing.assert_array_equal(ours, theirs)


def test_stats_fields(minilm_engine):
    minilm_engine.embed(["A man plays a guitar.", "Someone plays guitar."])
    s = minilm_engine.stats
    assert (s.sequences, s.batches, s.padded_tokens, s.truncated) == (2, 1, 0, 0)
    assert s.tokens == len(minilm_engine.tokenizer("A man plays a guitar.")["input_ids"]) + len(
        minilm_engine.tokenizer("Someone plays guitar.")["input_ids"]
    )
    assert s.seconds > 0 and s.tokens_per_s == pytest.approx(s.tokens / s.seconds)
    assert "sequences" in s.to_dict() and "tokens/s" in str(s)


def test_defaults_come_from_sentence_transformers_files(minilm_engine):
    r = minilm_engine.resolved
    assert r["pooling"] == "mean" and r["normalize"] is True and r["max_length"] == 256 and r["causal"] is False
    assert minilm_engine.knobs["pooling"] is None  # still "model default"
    assert r["cpu_workers"] == torch.get_num_threads()  # one CPU worker per intra-op thread


def test_configure_is_live_without_reload(minilm_path, sentences):
    eng = Engine(minilm_path)
    weight = eng.model.layers[0].qkv.weight
    base = eng.embed(sentences)
    assert eng.configure(pooling="cls", normalize=False) is eng
    cls = eng.embed(sentences)
    assert eng.model.layers[0].qkv.weight is weight  # the same parameters: nothing reloaded
    assert not np.allclose(cls, base, atol=1e-3)
    assert abs(np.linalg.norm(cls, axis=1) - 1).max() > 1e-2  # not normalized any more
    eng.configure(pooling=None, normalize=None)
    np.testing.assert_allclose(eng.embed(sentences), base, atol=1e-6)


def test_truncate_dim_then_normalize(minilm_path, minilm_st, sentences):
    eng = Engine(minilm_path, truncate_dim=128)
    got = eng.embed(sentences)
    ref = minilm_st.encode(sentences, convert_to_numpy=True, normalize_embeddings=False)[:, :128]
    assert got.shape == (len(sentences), 128)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert cosine_rows(got, ref).min() >= 0.99999


def test_max_length_knob_truncates_and_counts(minilm_path, minilm_st):
    texts = ["one two three four five six seven eight nine ten eleven twelve", "short"]
    eng = Engine(minilm_path, max_length=8)
    got = eng.embed(texts)
    assert eng.stats.truncated == 1 and eng.stats.tokens == 8 + 3
    minilm_st.max_seq_length = 8
    try:
        ref = minilm_st.encode(texts, convert_to_numpy=True)
    finally:
        minilm_st.max_seq_length = 256
    assert cosine_rows(got, ref).min() >= 0.99999


def test_bfloat16_on_cpu_and_back(minilm_path, minilm_st, sentences):
    eng = Engine(minilm_path)
    f32 = eng.embed(sentences)
    eng.configure(dtype="bfloat16")
    assert eng.model.layers[0].qkv.weight.dtype == torch.bfloat16
    bf16 = eng.embed(sentences)
    assert bf16.dtype == np.float32
    assert cosine_rows(bf16, f32).min() >= 0.999
    eng.configure(dtype="float32")  # re-cast from the float32 master copy: exact again
    np.testing.assert_array_equal(eng.embed(sentences), f32)


def test_empty_list_and_empty_string(minilm_engine, minilm_st):
    assert minilm_engine.embed([]).shape == (0, 384)
    got = minilm_engine.embed([""])
    ref = minilm_st.encode([""], convert_to_numpy=True)
    assert cosine_rows(got, ref).min() >= 0.99999


def test_progress_bar_runs(minilm_engine, capsys):
    minilm_engine.embed(["a b c"] * 5, show_progress=True)
    assert "embed" in capsys.readouterr().err


def test_similarity_helper(minilm_engine):
    E = minilm_engine.embed(["A man plays a guitar.", "Someone plays guitar.", "The stock market fell."])
    S = minilm_engine.similarity(E)
    assert S.shape == (3, 3) and np.allclose(np.diag(S), 1, atol=1e-5)
    assert S[0, 1] > S[0, 2]
