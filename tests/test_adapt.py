"""``lab.adapt``: MNTP and SimCSE runs on a tiny random decoder write PEFT folders that peft loads, are deterministic
for a seed, resume exactly after an interrupt, and refuse bad arguments. Bidirectional attention in the training
model is checked directly (a later token changes an earlier token's state; padding changes nothing)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_models import tiny_llama

from lab.adapt import objectives
from lab.adapt import train as adapt
from lab.adapt.peft_lora import LoraSpec
from lab.adapt.train import mntp, set_bidirectional, simcse

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A packed batch holds many sequences.",
    "Rotary embeddings rotate queries and keys.",
    "What is the capital of France?",
    "Paris is the capital of France.",
    "Embeddings map text to vectors.",
    "a",
    "Rerankers score a query against a document, one pair at a time.",
    "Two dogs run through a field.",
    "0123456789",
]
SMALL = LoraSpec(r=2, alpha=4.0, dropout=0.1)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("adapt"), "llama")


def _weights(folder):
    return load_file(str(folder / "adapter_model.safetensors"))


def test_mntp_writes_a_peft_folder_that_peft_loads(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = mntp(base, TEXTS, tmp_path / "m", steps=4, batch_size=4, lora=SMALL, save_every=2, show_progress=False)
    out = run.path
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 2 and cfg["base_model_name_or_path"] == str(base.resolve())
    assert (out / "loss.png").stat().st_size > 0 and (out / "train_config.json").exists()
    log = run.log
    assert list(log["step"]) == [1, 2, 3, 4] and np.isfinite(log["loss"]).all()
    assert not (out / "checkpoint").exists()  # removed once the adapter is final
    ref = AutoModelForCausalLM.from_pretrained(base).eval()
    # keys in the bare model's scope (llm2vec's): peft loads the adapter onto the ForCausalLM's inner model
    assert all(k.startswith("base_model.model.layers.") for k in _weights(out))
    merged = AutoModelForCausalLM.from_pretrained(base)
    merged.model = PeftModel.from_pretrained(merged.model, str(out)).merge_and_unload()
    x = torch.tensor([[5, 9, 30, 7]])
    assert not torch.allclose(ref(x).logits, merged.eval()(x).logits)  # the adapter changed the model


def test_same_seed_same_adapter_and_resume_is_exact(base, tmp_path, monkeypatch):
    kw = {"steps": 4, "batch_size": 4, "lora": SMALL, "save_every": 2, "show_progress": False, "dtype": "float32"}
    a = mntp(base, TEXTS, tmp_path / "a", **kw)
    b = mntp(base, TEXTS, tmp_path / "b", **kw)
    for k, v in _weights(a.path).items():
        assert torch.equal(v, _weights(b.path)[k]), k

    real = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def interrupt_at_step_3(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", interrupt_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        mntp(base, TEXTS, tmp_path / "c", **kw)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", real)
    c = tmp_path / "c"
    assert (c / "checkpoint").exists() and not (c / "adapter_config.json").exists()
    assert len(np.loadtxt(c / "train_log.csv", delimiter=",", skiprows=1, ndmin=2)) == 2  # what ran is logged
    with pytest.raises(FileExistsError, match="resume=True"):
        mntp(base, TEXTS, c, **kw)
    with pytest.raises(ValueError, match="differ"):
        mntp(base, TEXTS, c, resume=True, **{**kw, "steps": 5})
    resumed = mntp(base, TEXTS, c, resume=True, **kw)
    assert resumed.resumed_from == 2 and list(resumed.log["step"]) == [1, 2, 3, 4]
    for k, v in _weights(a.path).items():
        assert torch.equal(v, _weights(c)[k]), f"resumed run differs at {k}"


def test_simcse_on_top_of_an_adapter_and_causal_control(base, tmp_path):
    m = mntp(base, TEXTS, tmp_path / "m", steps=2, batch_size=4, lora=SMALL, show_progress=False).path
    s = simcse(base, TEXTS, tmp_path / "s", adapters=[m], steps=3, batch_size=4, lora=SMALL, show_progress=False)
    c = simcse(
        base,
        TEXTS,
        tmp_path / "c",
        bidirectional=False,
        steps=3,
        batch_size=4,
        lora=LoraSpec(r=2, alpha=4.0, save_dtype="bfloat16"),
        show_progress=False,
    )
    assert json.loads((s.path / "train_config.json").read_text())["adapters"] == [str(m.resolve())]
    assert np.isfinite(s.log["loss"]).all() and np.isfinite(c.log["loss"]).all()
    assert all(v.dtype == torch.bfloat16 for v in _weights(c.path).values())
    # the first step's InfoNCE loss of 4 near-identical views is about log(4) or below
    assert s.log["loss"].iloc[0] < np.log(4) + 1.0


def test_set_bidirectional_changes_attention_and_respects_padding(base):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(base).eval()
    x, y = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[5, 6, 7, 9]])
    for bidirectional in (False, True):
        set_bidirectional(m, bidirectional)
        for mask in (None, torch.ones(1, 4, dtype=torch.long)):  # no mask: SDPA's own is_causal decides
            a = m.model(input_ids=x, attention_mask=mask).last_hidden_state[0, 0]
            b = m.model(input_ids=y, attention_mask=mask).last_hidden_state[0, 0]
            assert torch.allclose(a, b) != bidirectional
    padded = m.model(input_ids=torch.tensor([[5, 6, 7, 0, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0, 0]]))
    alone = m.model(input_ids=torch.tensor([[5, 6, 7]]))
    torch.testing.assert_close(padded.last_hidden_state[0, :3], alone.last_hidden_state[0], atol=1e-5, rtol=1e-5)


def test_batches_cover_the_texts_and_pad_little():
    rng = np.random.default_rng(0)
    ids = [np.zeros(n, dtype=np.int64) for n in rng.integers(1, 60, size=500)]
    order = objectives.batch_order(ids, 16, 60, seed=3)
    assert len(order) == 60 and all(len(b) == 16 for b in order)
    first_pass = np.concatenate(order[:31])
    assert len(set(first_pass.tolist())) == len(first_pass)  # no text twice within a pass
    lengths = np.array([len(x) for x in ids])
    waste = np.mean([1 - lengths[b].mean() / lengths[b].max() for b in order])
    assert waste < 0.1, f"bucketing left {waste:.0%} padding"
    assert all(np.array_equal(p, q) for p, q in zip(order, objectives.batch_order(ids, 16, 60, seed=3)))


def test_mask_token_falls_back_to_blank(base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    assert tok.mask_token_id is None
    assert tok.decode([objectives.mask_token_id(tok)]) == "_"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"texts": "one string"}, TypeError, "list of strings"),
        ({"texts": ["a", 3]}, TypeError, r"texts\[1\]"),
        ({"texts": ["only one"]}, ValueError, "at least two"),
        ({"steps": 0}, ValueError, "steps"),
        ({"mask_rate": 1.5}, ValueError, "mask_rate"),
        ({"lora": LoraSpec(save_dtype="int8")}, ValueError, "save_dtype"),
    ],
)
def test_bad_arguments_are_named(base, tmp_path, kwargs, error, match):
    args = {"texts": TEXTS, "steps": 2, "show_progress": False}
    args.update(kwargs)
    texts = args.pop("texts")
    with pytest.raises(error, match=match):
        mntp(base, texts, tmp_path / "x", **args)
    assert not (tmp_path / "x").exists()


def test_missing_base_and_adapter_folders(tmp_path, base):
    with pytest.raises(FileNotFoundError, match="config.json"):
        mntp(tmp_path, TEXTS, tmp_path / "x", steps=1, show_progress=False)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        simcse(base, TEXTS, tmp_path / "y", adapters=[tmp_path], steps=1, show_progress=False)


@pytest.mark.slow
def test_llm2vec_study_runs_in_smoke_mode(tmp_path, monkeypatch):
    """The study end to end on SmolLM2 with a few steps and small subsets: adapters, tables, plots, README."""
    import importlib
    import sys

    import pandas as pd

    monkeypatch.setenv("LAB_SMOKE", "1")
    for name in [m for m in sys.modules if m.startswith("evals.llm2vec_study")]:  # the study and its parts
        sys.modules.pop(name)
    study = importlib.import_module("evals.llm2vec_study")
    recipe = importlib.import_module("evals.llm2vec_study_recipe")
    assert recipe.RECIPE["simcse"]["steps"] == 3
    out = tmp_path / "study"
    assert study.main(["--out", str(out), "--limit", "30", "--heldout"]) == 0
    for name in ("mntp", "mntp_simcse", "causal_simcse"):
        assert (out / name / "adapter_model.safetensors").exists()
    results = pd.read_csv(out / "results.csv")
    assert set(results.variant) == set(recipe.variants(out))
    assert {"STSBenchmark", *recipe.HELD_OUT} <= set(results.task)
    layers = pd.read_csv(out / "layers.csv")
    assert layers.layer.min() == 0 and layers.layer.max() == 30
    for f in ("variants.png", "layers.png", "losses.png", "README.md"):
        assert (out / f).stat().st_size > 0
    # the smoke recipe must not leak into other tests
    for name in [m for m in sys.modules if m.startswith("evals.llm2vec_study")]:
        sys.modules.pop(name)


@pytest.mark.slow
def test_committed_study_adapters_load_in_peft_and_the_engine_alike():
    """The study's committed adapters (float16 PEFT folders in the bare-model scope) stacked as llm2vec does: the
    Engine (bidirectional, mean pooling) equals transformers + peft merging them in order onto the bare model, with
    no missing keys (cosine >= 0.9999)."""
    from pathlib import Path

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lab import Engine
    from lab.models.gguf import smollm2_path

    study = Path(__file__).resolve().parents[1] / "evals" / "results" / "llm2vec"
    adapters = [str(study / "mntp"), str(study / "mntp_simcse")]
    base = smollm2_path()
    texts = ["A man is playing a guitar.", "Stocks fell on Monday.", "a", "The cat sits on the mat near the door."]
    eng = Engine(str(base), adapters=adapters, bidirectional=True, pooling="mean", normalize=False, dtype="float32")
    ours = eng.embed(texts)
    ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for a in adapters:  # bare-model scope (llm2vec's): onto the causal LM's inner model
        ref.model = PeftModel.from_pretrained(ref.model, a).merge_and_unload()
    set_bidirectional(ref, True)
    tok = AutoTokenizer.from_pretrained(base)
    with torch.no_grad():
        want = np.stack([ref.model(**tok(t, return_tensors="pt")).last_hidden_state[0].mean(0).numpy() for t in texts])
    cos = (ours * want).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, cos
    assert eng.resolved["adapters"] == ["mntp", "mntp_simcse"]


def test_a_base_by_hub_id_is_written_as_that_id_and_its_commit(base, tmp_path, monkeypatch):
    """``mntp("org/name", ...)`` trains on the cached snapshot and writes ``base_model_name_or_path`` as the id and
    ``revision`` as the commit (what peft and llm2vec read), so the adapter loads by id on any machine."""
    from hub_cache import write_hub_cache
    from huggingface_hub import constants

    from lab import Engine

    cache, commit = tmp_path / "hf-cache", "d" * 40
    write_hub_cache(cache, "tiny-org/base", base, commit=commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    run = mntp("tiny-org/base", TEXTS, tmp_path / "m", steps=1, batch_size=4, lora=SMALL, show_progress=False)
    cfg = json.loads((run.path / "adapter_config.json").read_text())
    assert (cfg["base_model_name_or_path"], cfg["revision"]) == ("tiny-org/base", commit)
    by_id = Engine(str(run.path), pooling="mean").embed(TEXTS)  # the adapter folder alone: its base by id
    np.testing.assert_array_equal(by_id, Engine(str(base), adapters=[str(run.path)], pooling="mean").embed(TEXTS))


def test_auto_dtype_skips_the_bfloat16_probe_without_native_bfloat16(base):
    """On a CPU without avx512_bf16 / amx_bf16 the bfloat16 backward is emulated (minutes for SmolLM2): ``auto``
    takes float32 there without timing it; the flags decide, whichever CPU runs the test."""
    assert not adapt.cpu_bf16_native("avx2 avx512f fma") and adapt.cpu_bf16_native("avx2 avx512_bf16")
    assert adapt.cpu_bf16_native("amx_bf16 amx_tile")
    calls = []
    if not adapt.cpu_bf16_native():
        got = adapt._choose_dtype("auto", torch.device("cpu"), lambda: calls.append(1), [])
        assert got == torch.float32 and not calls  # no probe ran
