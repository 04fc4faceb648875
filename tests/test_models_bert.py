"""Our packed BERT / RoBERTa / XLM-R encoders equal transformers on the same random weights."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import cosine_rows
from tiny_encoders import tiny_encoder

from lab import Engine
from lab.models.bert import BertModel
from lab.models.folder import read_folder, read_state_dict
from lab.ops.batch import PackedBatch

TEXTS = [
    "a",
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "",
    "naïve café 東京",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
]


# the CPU ``attention_kernel`` choice, in the plan
@pytest.mark.parametrize("kernel", ["sdpa", "matmul", "lab", "bmm"])
@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta"])
def test_packed_forward_matches_transformers(tmp_path, minilm_path, kind, kernel, monkeypatch):
    from lab.kernels import cpu_attention
    from transformers import AutoModel, AutoTokenizer

    if kernel == "lab" and not cpu_attention.available():
        pytest.skip(f"cpu_attention did not build here: {cpu_attention.unavailable_reason()}")
    calls, real = [], cpu_attention.varlen_attention
    monkeypatch.setattr(cpu_attention, "varlen_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    # heads of 16 for ``lab`` (its vectors are 16 floats wide; 12-wide heads would run the fused kernel)
    path = tiny_encoder(tmp_path / kind, minilm_path, kind, heads=3 if kernel == "lab" else 4)
    spec = read_folder(path)
    ours = BertModel.from_hf_config(spec.config).eval()
    ours.load_hf_state_dict(read_state_dict(spec))
    ours.plan["attention_kernel"] = kernel
    ref = AutoModel.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    texts = TEXTS[:]
    random.shuffle(texts)
    pairs = [t[::-1] for t in texts]  # second segments: token_type_ids 1 for BERT
    enc = tok(texts, pairs, truncation=True, max_length=64)
    ids = [np.asarray(x) for x in enc["input_ids"]]
    types = [np.asarray(x) for x in enc["token_type_ids"]]
    batch = PackedBatch.build(ids, causal=False, device=torch.device("cpu"), token_type_ids=types)
    with torch.no_grad():
        got = ours(batch.input_ids, batch.positions, batch.meta, batch.token_type_ids)
        s = 0
        for x, t in zip(ids, types):
            want = ref(
                input_ids=torch.from_numpy(x)[None], token_type_ids=torch.from_numpy(t)[None]
            ).last_hidden_state[0]
            assert cosine_rows(got[s : s + len(x)].numpy(), want.numpy()).min() >= 0.99999
            torch.testing.assert_close(got[s : s + len(x)], want, atol=2e-5, rtol=1e-4)
            s += len(x)
    assert len(calls) == (2 if kernel == "lab" else 0)  # one call per layer


def test_engine_on_roberta_uses_position_offset(tmp_path, minilm_path):
    from transformers import AutoModel, AutoTokenizer

    path = tiny_encoder(tmp_path / "r", minilm_path, "roberta")
    eng = Engine(str(path), pooling="mean", normalize=False, max_batch_tokens=20)
    got = eng.embed(TEXTS)
    ref = AutoModel.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = ref(**enc).last_hidden_state
    m = enc["attention_mask"][..., None].float()
    want = ((h * m).sum(1) / m.sum(1)).numpy()
    assert cosine_rows(got, want).min() >= 0.99999


def test_unknown_architecture_falls_back_to_transformers_padded(tmp_path, minilm_path):
    import json

    path = tiny_encoder(tmp_path / "d", minilm_path, "bert")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["SomethingElseModel"]  # not in our registry: AutoModel still loads it (model_type bert)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="no packed implementation"):
        eng = Engine(str(path), pooling="mean")
    texts = ["a", "a much longer sentence than the first one"]
    got = eng.embed(texts)
    assert eng.stats.path.startswith("transformers-fallback") and eng.stats.padded_tokens > 0
    cfg["architectures"] = ["BertModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    packed = Engine(str(path), pooling="mean").embed(texts)
    assert cosine_rows(got, packed).min() >= 0.99999
