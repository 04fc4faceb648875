"""``lab.engine.knobs.resolve``: one frozen ``Resolved`` per knob setting, each value with where it came from, read
by the engine, its ``repr`` and the panel (``eng.resolved``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lab.engine.knobs import Knobs, ModelFacts, Resolved, resolve
from lab.engine.llm2vec import Layout
from lab.models.spec import ModelSpec

SPEC = ModelSpec(path=Path("/nowhere"), config={}, weights=[], weight_format="safetensors")
PLAIN = Layout(False)
LLM2VEC = Layout(
    True,
    "llm2vec_config.json in /m",
    Path("/m"),
    {
        "pooling": ("mean", "llm2vec_config.json in /m"),
        "max_length": (512, "llm2vec default"),
        "doc_max_length": (400, "llm2vec default"),
        "include_instruction": (False, "llm2vec default"),
    },
)


def facts(**kw) -> ModelFacts:
    base = {
        "hidden": 64,
        "positions": 2048,
        "is_decoder": True,
        "default_causal": True,
        "num_layers": 4,
        "specials": 1,
        "tokenizer_max": None,
        "spec": SPEC,
    }
    return ModelFacts(**{**base, **kw})


def test_a_decoder_without_configs_takes_the_model_kinds_defaults():
    r = resolve(Knobs(), facts(), PLAIN)
    assert (r.pooling, r.causal, r.append_eos, r.instruction_pooling, r.layer) == ("lasttoken", True, True, "exact", 4)
    assert r.max_length == 2048 and r.doc_max_length is None and r.normalize is False
    assert r.sources["pooling"] == r.sources["causal"] == "model default"


def test_an_encoder_reads_its_sentence_transformers_configs():
    spec = dataclasses.replace(SPEC, pooling="cls", include_prompt=False, normalize=True, max_seq_length=128)
    r = resolve(
        Knobs(), facts(is_decoder=False, default_causal=False, positions=512, tokenizer_max=256, spec=spec), PLAIN
    )
    assert (r.pooling, r.include_instruction, r.normalize, r.max_length, r.causal) == ("cls", False, True, 128, False)
    assert r.sources["pooling"] == r.sources["include_instruction"] == "sentence-transformers Pooling"
    assert r.sources["max_length"] == "sentence-transformers config"
    assert r.append_eos is False  # encoders never append one
    # without a sentence-transformers max_seq_length: the smaller of the tokenizer's and the model's limits
    r = resolve(Knobs(), facts(is_decoder=False, positions=512, tokenizer_max=256), PLAIN)
    assert r.max_length == 256


def test_an_llm2vec_layout_brings_its_settings_and_a_set_knob_wins():
    r = resolve(Knobs(), facts(), LLM2VEC)
    assert (r.pooling, r.causal, r.max_length, r.doc_max_length, r.instruction_pooling) == (
        "mean",
        False,
        512,
        400,
        "llm2vec",
    )
    assert r.sources["pooling"] == "llm2vec_config.json in /m" and r.sources["causal"] == "llm2vec default"
    assert r.defaults["pooling"] == "mean" and r.defaults["causal"] is False
    r = resolve(Knobs(pooling="lasttoken", bidirectional=False, doc_max_length=0, layer=-2), facts(), LLM2VEC)
    assert (r.pooling, r.causal, r.doc_max_length, r.layer) == ("lasttoken", True, None, 3)
    assert r.sources["pooling"] == r.sources["causal"] == r.sources["doc_max_length"] == "user"
    assert r.defaults["pooling"] == "mean"  # what the model would give, whatever the knob says
    assert r.append_eos is False  # the llm2vec rule appends llm2vec's EOS text, never an EOS token id


def test_a_template_never_pools_the_instruction_unless_the_knob_says_so():
    spec = dataclasses.replace(SPEC, include_prompt=True)
    assert resolve(Knobs(), facts(spec=spec), PLAIN).include_instruction is True
    r = resolve(Knobs(template="Q: {text}"), facts(spec=spec), PLAIN)
    assert r.include_instruction is False and r.sources["include_instruction"].startswith("template")
    assert resolve(Knobs(template="Q: {text}", include_instruction=True), facts(spec=spec), PLAIN).include_instruction


def test_resolved_is_frozen_and_a_read_only_mapping():
    r = resolve(Knobs(pooling="mean"), facts(), PLAIN, {"dtype": "float32", "cpu_workers": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.pooling = "cls"
    assert r["pooling"] == r.pooling == "mean" and r["dtype"] == "float32" and r["cpu_workers"] == 2
    assert list(r) == [f.name for f in dataclasses.fields(Resolved) if f.name not in ("sources", "defaults")]
    assert "sources" not in r and dict(r)["layer"] == 4
    with pytest.raises(KeyError):
        r["sources"]
    assert "'pooling': 'mean' (user)" in repr(r)


def test_the_engine_reads_one_resolved_object(minilm_path):
    from lab import Engine

    eng = Engine(minilm_path, max_length=64)
    r = eng.resolved
    assert isinstance(r, Resolved) and r.max_length == 64 and r.sources["max_length"] == "user"
    assert r.pooling == "mean" and r.sources["pooling"] == "sentence-transformers Pooling"
    assert r.layer == eng.num_layers and r.dtype == "float32" and r.adapters == []
    assert f"pooling={r.pooling}" in repr(eng)
    eng.configure(pooling="cls", layer=-1)
    assert eng.resolved.pooling == "cls" and eng.resolved.sources["pooling"] == "user" and r.pooling == "mean"
