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
    calls = []

    def load(path):
        calls.append(str(path))
        return fake_gguf(path)

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
    assert source["size"] == src.stat().st_size and source["sha256"] == gguf.gguf_fingerprint(src)["sha256"]


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


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_a_damaged_cached_model_is_rebuilt_from_the_source(tmp_path, fake_loader, damage):
    """A cached model.safetensors that cannot be read (cut short, or garbage over it) is converted again from the
    GGUF, whose digest still matches gguf_source.json, with a warning naming both; no temporary folder is left."""
    from lab.models.folder import read_folder, read_state_dict

    src = _write(tmp_path / "m.gguf", b"weights" * 100)
    out = tmp_path / "cache" / "m"
    gguf.cache_gguf_as_safetensors(src, out)
    good = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(good[: len(good) // 2] if damage == "truncated" else b"\x07" * len(good))
    with pytest.warns(
        UserWarning,
        match=rf"the cached conversion {out / 'model.safetensors'} is damaged .*; "
        rf"rebuilding it from {src}, whose SHA-256 matches the one "
        rf"{out / 'gguf_source.json'} records",
    ):
        assert gguf.cache_gguf_as_safetensors(src, out) == out
    assert len(fake_loader) == 2 and (out / "model.safetensors").read_bytes() == good
    assert sorted(p.name for p in out.parent.iterdir()) == [".lock-m", "m"]
    spec = read_folder(out)
    assert set(read_state_dict(spec)) == set(spec.tensors)


def test_lab_cache_naming_a_file_is_refused_naming_it(tmp_path, monkeypatch, fake_loader):
    src = _write(tmp_path / "m.gguf", b"weights" * 100)
    f = tmp_path / "cache-file"
    f.write_text("a file, not a folder")
    monkeypatch.setenv("LAB_CACHE", str(f))
    with pytest.raises(ValueError, match=rf"LAB_CACHE='{f}' is a file, not a folder: point LAB_CACHE at a folder"):
        gguf.cache_gguf_as_safetensors(src)
    with pytest.raises(ValueError, match=rf"LAB_CACHE='{f}' is a file"):
        Engine(str(src))
    assert f.read_text() == "a file, not a folder" and fake_loader == []


def test_copies_with_other_paths_and_mtimes_share_one_entry(tmp_path, monkeypatch, fake_loader):
    """A second virtual environment holds its own copy of a packaged GGUF (other path, other mtime): the cache is
    keyed by content, so it reuses the first one's folder instead of converting and rewriting it."""
    import os

    monkeypatch.setenv("LAB_CACHE", str(tmp_path / "cache"))
    a = _write(tmp_path / "venv1" / "model.gguf", b"packaged weights" * 100)
    b = _write(tmp_path / "venv2" / "model.gguf", b"packaged weights" * 100)
    os.utime(b, ns=(a.stat().st_mtime_ns + 10**9, a.stat().st_mtime_ns + 10**9))
    fa = gguf.cache_gguf_as_safetensors(a)
    assert gguf.cache_gguf_as_safetensors(b) == fa and len(fake_loader) == 1
    fixed = tmp_path / "fixed"  # a folder of a fixed name, as smollm2_path() uses
    stamp = None
    for src in (a, b, a):
        gguf.cache_gguf_as_safetensors(src, fixed)
        stamp = stamp or (fixed / "model.safetensors").stat().st_mtime_ns
        assert (fixed / "model.safetensors").stat().st_mtime_ns == stamp  # never rewritten
    assert len(fake_loader) == 2


_CONVERT = """
import os, sys, time
sys.path.insert(0, {tests!r})
import test_gguf_cache
from lab.models import gguf

calls, ready = {calls!r}, {ready!r}

def load(path):
    with open(calls, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    time.sleep(1.0)  # a conversion that takes a while: the other process runs meanwhile
    return test_gguf_cache.fake_gguf(path)

gguf.load_gguf = load
with open(ready, "a") as f:
    f.write("x")
deadline = time.time() + 60
while open(ready).read().count("x") < 2 and time.time() < deadline:  # both start converting together
    time.sleep(0.01)
print(gguf.cache_gguf_as_safetensors({src!r}, {out!r}))
"""


def fake_gguf(path):
    """The conversion ``fake_loader`` stands in for, for a process of its own."""
    from transformers import LlamaForCausalLM

    tok = tiny_tokenizer()
    model = LlamaForCausalLM(tiny_config("llama", len(tok))).eval()
    randomize_(model, seed=sum(Path(path).read_bytes()) % 1000)
    config = json.loads(model.config.to_json_string(use_diff=False))
    config["architectures"] = ["LlamaForCausalLM"]
    return config, {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, tok


def test_two_processes_converting_at_once_leave_one_valid_entry(tmp_path):
    import subprocess
    import sys

    from lab.models.folder import read_folder, read_state_dict

    src = _write(tmp_path / "m.gguf", b"weights" * 100)
    out = tmp_path / "cache" / "m"
    script = _CONVERT.format(
        tests=str(Path(__file__).parent),
        calls=str(tmp_path / "calls"),
        ready=str(tmp_path / "ready"),
        src=str(src),
        out=str(out),
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parents[1],
            env=env,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert {o.strip() for o, _ in results} == {str(out)}
    assert len((tmp_path / "calls").read_text().split()) == 1  # the second process waited and reused the folder
    assert sorted(p.name for p in out.parent.iterdir()) == [".lock-m", "m"]  # no temporary folder left
    spec = read_folder(out)
    assert set(read_state_dict(spec)) == set(spec.tensors) and "model.embed_tokens.weight" in spec.tensors
