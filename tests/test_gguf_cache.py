"""The GGUF safetensors cache is keyed by the file's content: two files with one name never share a folder, a file
changed in place is converted again, and an interrupted conversion never leaves a folder that looks complete.
The slow dequantization (transformers' GGUF loader) is replaced by a tiny random Llama per source file, so these
tests check the cache itself; tests/test_models_decoder.py checks a real GGUF (SmolLM2) against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import randomize_, tiny_config, tiny_tokenizer

from lab import Engine
from lab.models import gguf


@pytest.fixture
def fake_loader(monkeypatch):
    """``load_gguf`` -> a tiny Llama whose weights are seeded by the file's bytes (so different files differ)."""
    from transformers import LlamaForCausalLM

    calls = []

    def load(path):
        data = Path(path).read_bytes()
        calls.append(str(path))
        tok = tiny_tokenizer()
        model = LlamaForCausalLM(tiny_config("llama", len(tok))).eval()
        randomize_(model, seed=sum(data) % 1000)
        config = json.loads(model.config.to_json_string(use_diff=False))
        config["architectures"] = ["LlamaForCausalLM"]
        sd = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        return config, sd, tok

    monkeypatch.setattr(gguf, "load_gguf", load)
    return calls


def _write(path, payload: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + payload)
    return path


def test_two_files_with_one_name_get_their_own_weights(tmp_path, monkeypatch, fake_loader):
    monkeypatch.setenv("LAB_CACHE", str(tmp_path / "cache"))
    a = _write(tmp_path / "a" / "model.gguf", b"first model" * 100)
    b = _write(tmp_path / "b" / "model.gguf", b"second model, other weights" * 100)
    fa, fb = gguf.cache_gguf_as_safetensors(a), gguf.cache_gguf_as_safetensors(b)
    assert fa != fb and fa.parent == fb.parent == tmp_path / "cache"
    ea, eb = Engine(str(a)), Engine(str(b))  # through the Engine's .gguf loading
    assert not torch.equal(ea.model.embed_tokens.weight, eb.model.embed_tokens.weight)
    assert gguf.cache_gguf_as_safetensors(a) == fa and len(fake_loader) == 2  # cached: no third conversion


def test_a_file_changed_in_place_is_converted_again(tmp_path, fake_loader):
    src = _write(tmp_path / "m.gguf", b"version one" * 100)
    out = tmp_path / "cache"
    gguf.cache_gguf_as_safetensors(src, out)
    first = (out / "model.safetensors").read_bytes()
    _write(src, b"version two!" * 100)  # same name, same folder, new content
    gguf.cache_gguf_as_safetensors(src, out)
    assert len(fake_loader) == 2 and (out / "model.safetensors").read_bytes() != first
    source = json.loads((out / "gguf_source.json").read_text())
    assert source["size"] == src.stat().st_size and source["sha256_edges"] == gguf.gguf_fingerprint(src)["sha256_edges"]


def test_a_foreign_or_unrecorded_folder_is_rebuilt(tmp_path, fake_loader):
    src = _write(tmp_path / "m.gguf", b"weights" * 100)
    out = tmp_path / "cache"
    gguf.cache_gguf_as_safetensors(src, out)
    (out / "gguf_source.json").unlink()  # a cache from before fingerprints (or another tool): not trusted
    gguf.cache_gguf_as_safetensors(src, out)
    assert len(fake_loader) == 2 and (out / "gguf_source.json").exists()


def test_an_interrupted_conversion_leaves_no_complete_folder(tmp_path, monkeypatch, fake_loader):
    src = _write(tmp_path / "m.gguf", b"weights" * 100)
    out = tmp_path / "cache"
    import safetensors.torch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", interrupted)
        with pytest.raises(KeyboardInterrupt):
            gguf.cache_gguf_as_safetensors(src, out)
    assert not out.exists() and list(tmp_path.glob(".cache.*")) == []  # no folder, no temp left
    assert (gguf.cache_gguf_as_safetensors(src, out) / "model.safetensors").exists()
