"""The compiled forward (``lab.runtime.compiled``): forced on and off on any CPU, it computes what the eager forward
computes, for encoders and the decoder families, with every knob that reaches the forward; new weights (adapters, a
dtype switch) get a graph of their own, never a stale one; ``compile=None`` times nothing for a small call and, when
made to consider a call, decides by measuring both paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lab import Engine
from lab.runtime import compiled, planner
from tests.test_adapters import make_adapter
from tests.tiny_encoders import tiny_encoder
from tests.tiny_models import tiny_llama

TEXTS = [
    "x",
    "The quick brown fox jumps over the lazy dog.",
    "Paris",
    "What is the capital of France? " * 3,
    "0123456789 !?",
    "Rotary position embeddings rotate queries and keys by an angle.",
    "a b",
    "Embeddings.",
]


def shuffled(seed: int = 0) -> list[str]:
    texts = [t * (1 + i % 3) for i, t in enumerate(TEXTS * 3)]
    np.random.default_rng(seed).shuffle(texts)
    return texts


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def pair(path, **kw) -> tuple[Engine, Engine]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compiled.CompileNotice)
        return Engine(str(path), compile=False, **kw), Engine(str(path), compile=True, **kw)


def same(eager: Engine, comp: Engine, texts, *, atol: float = 2e-5, **call) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compiled.CompileNotice)
        a, b = eager.embed(texts, **call), comp.embed(texts, **call)
    assert a.shape == b.shape
    np.testing.assert_allclose(b, a, atol=atol, rtol=0)
    assert comp.cpu_paths["forward"] == "compiled" and eager.cpu_paths["forward"] == "eager"
    return b


def test_encoder_matches_eager_with_layer_and_token_outputs(tmp_path, minilm_path):
    path = tiny_encoder(tmp_path / "bert", minilm_path)
    eager, comp = pair(path, pooling="mean")
    texts = shuffled()
    same(eager, comp, texts)
    assert len(comp.runner.compiled.compile_seconds) == 1  # both CPU workers ran the one graph
    for e in (eager, comp):
        e.configure(layer=1, pooling="cls")
    same(eager, comp, texts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compiled.CompileNotice)
        tok_a, tok_b = eager.embed(texts[:5], output="tokens"), comp.embed(texts[:5], output="tokens")
    for x, y in zip(tok_a, tok_b):
        np.testing.assert_allclose(y, x, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # qwen2: in the knobs test below
def test_decoders_match_eager(tmp_path, kind):
    eager, comp = pair(tiny_llama(tmp_path, kind), pooling="lasttoken")  # lasttoken: the kept rows of all rows
    same(eager, comp, shuffled(1))


def test_knobs_adapters_and_dtype_never_run_stale_weights(tmp_path):
    base = tiny_llama(tmp_path, "qwen2")
    adapter = make_adapter(base, tmp_path / "ad")
    eager, comp = pair(base, pooling="mean")
    texts = shuffled(2)
    plain = same(eager, comp, texts)
    for e in (eager, comp):
        e.configure(bidirectional=True)
    same(eager, comp, texts)
    for e in (eager, comp):
        e.configure(bidirectional=False, adapters=[adapter])
    merged = same(eager, comp, texts)
    assert np.abs(merged - plain).max() > 1e-3  # the adapter changes the vectors, and the compiled path sees it
    graphs = len(comp.runner.compiled.compile_seconds)
    for e in (eager, comp):
        e.configure(adapters=[])
    np.testing.assert_array_equal(same(eager, comp, texts), plain)  # the base weights' graph, kept
    assert len(comp.runner.compiled.compile_seconds) == graphs
    # chunked prefill runs the eager KV path under compile=True: identical vectors
    for e in (eager, comp):
        e.configure(chunked_prefill=8)
    np.testing.assert_array_equal(comp.embed(texts), eager.embed(texts))
    for e in (eager, comp):
        e.configure(chunked_prefill=None, dtype="bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compiled.CompileNotice)
        a, b = eager.embed(texts), comp.embed(texts)
    assert cosines(a, b).min() > 0.995
    assert comp.runner.compiled.compile_seconds and all(
        k[0] == "torch.bfloat16" for k in list(comp.runner.compiled._graphs)[-1:]
    )


def test_measured_choice_and_small_calls(tmp_path, minilm_path, monkeypatch):
    path = tiny_encoder(tmp_path / "bert", minilm_path)
    eng = Engine(str(path))
    eng.embed(TEXTS)  # far below the payback threshold: nothing timed, nothing compiled
    assert "forward" not in eng.cpu_paths and not eng.runner.compiled.compile_seconds
    monkeypatch.setattr(planner, "COMPILE_MIN_TOKENS", 0)
    monkeypatch.setattr(planner, "PAYBACK", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compiled.CompileNotice)
        got = eng.embed(shuffled())
    d = {d.name: d for d in eng.runner.decisions}["forward"]
    assert d.source == "probe" and set(d.seconds) == {"eager", "compiled"}
    np.testing.assert_allclose(got, Engine(str(path), compile=False).embed(shuffled()), atol=2e-5, rtol=0)
    monkeypatch.setenv("LAB_CPU_FORWARD", "eager")
    other = Engine(str(path))
    other.embed(TEXTS)
    assert {d.name: d for d in other.runner.decisions}["forward"].source == "env"


def test_compile_argument_errors(tmp_path, minilm_path):
    path = tiny_encoder(tmp_path / "bert", minilm_path)
    with pytest.raises(TypeError, match="compile must be None"):
        Engine(str(path), compile="yes")
    with pytest.raises(ValueError, match="contradicts cpu_paths"):
        Engine(str(path), compile=True, cpu_paths={"forward": "eager"})
    eng = Engine(str(path), cpu_paths={"forward": "eager"})
    eng.embed(TEXTS)
    assert eng.cpu_paths["forward"] == "eager" and not eng.runner.compiled.compile_seconds


def test_compile_on_the_padded_fallback_says_it_runs_eagerly(tmp_path, minilm_path):
    path = tiny_encoder(tmp_path / "fb", minilm_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["SomethingElseModel"]  # not in our registry: transformers AutoModel, padded
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(
        UserWarning,
        match="runs transformers' padded forward, which the compiled forward does not take; it runs eagerly",
    ):
        eng = Engine(str(path), pooling="mean", compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = Engine(str(path), pooling="mean", compile=False).embed(TEXTS)
    np.testing.assert_array_equal(eng.embed(TEXTS), plain)
    assert not eng.runner.compiled.compile_seconds


def test_weights_state_names_dtype_and_merged_content(tmp_path):
    eng = Engine(str(tiny_llama(tmp_path, "llama")))
    w = eng.runner.weights
    assert w.state == ("torch.float32", "base")
    name, p = next(iter(eng.model.named_parameters()))
    w.set_merged({name: w.base[name].float() + 1})
    first = w.state[1]
    w.set_merged({name: w.base[name].float() + 2})
    assert first != "base" and w.state[1] not in ("base", first)
    w.set_merged({})
    assert w.state == ("torch.float32", "base")
    assert torch.equal(p.detach(), w.base[name])


def test_a_failed_build_is_a_clear_error_or_eager(tmp_path, minilm_path):
    """A machine where inductor cannot build (its C++ compiler missing: ``CXX`` pointing nowhere, a cold cache, in a
    child process): ``compile=True`` fails naming ``compile=False``; ``compile=None`` warns and runs eagerly."""
    path = tiny_encoder(tmp_path / "bert", minilm_path)
    script = f"""
import warnings
from lab import Engine
from lab.runtime import planner
try:
    Engine({str(path)!r}, compile=True).embed(["a b c", "d"])
    print("no error")
except RuntimeError as e:
    print("error names the fix:", "compile=False" in str(e))
eng = Engine({str(path)!r})
planner.COMPILE_MIN_TOKENS = planner.PAYBACK = 0
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    vectors = eng.embed(["a b c", "d"])
print("warned:", any("compile=False" in str(w.message) for w in seen), "rows:", len(vectors),
      "forward:", eng.cpu_paths.get("forward", "eager"))
"""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "error names the fix: True" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "warned: True rows: 2 forward: eager" in out.stdout, out.stdout + out.stderr[-3000:]
