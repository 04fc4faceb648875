"""Real OS faults while the GGUF cache writes a conversion: a file size limit (``RLIMIT_FSIZE``: the write fails
with EFBIG) and a SIGKILL in the middle of the write, each in a child process, and a file where the destination
folder should be. Each ends in an error naming the folder (or a killed child), the folder that was there before
left whole, nothing half-written that looks complete, and the next run correct.

The tests run as root, where a read-only folder (``chmod``) does not stop a write, so the file in place of a folder
and the size limit stand in for an unwritable destination. The slow dequantization (transformers' GGUF loader) is
replaced by ``test_gguf_cache.fake_gguf``'s tiny random Llama, as in tests/test_gguf_cache.py; the writing code runs
unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_gguf_cache import fake_gguf

from lab.models import gguf
from lab.models.loading import read_folder, read_state_dict

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import os, resource, signal, sys
sys.path.insert(0, {tests!r})
import test_gguf_cache
from lab.models import gguf
import safetensors.torch

gguf.load_gguf = test_gguf_cache.fake_gguf  # the conversion's input; its writing is what is under test
fault, src, out = sys.argv[1:4]
if fault == "efbig":  # every file this process writes stops at 64 KiB (the model is ~1 MB)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
if fault == "kill":  # killed once model.safetensors is on disk, before the config, tokenizer and the rename
    write = safetensors.torch.save_file

    def save_then_die(*args, **kwargs):
        write(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    safetensors.torch.save_file = save_then_die
try:
    print(gguf.cache_gguf_as_safetensors(src, out))
except OSError as e:
    print(f"OSError: {{e}}")
    sys.exit(3)
"""


def _convert(fault: str, src: Path, out: Path) -> subprocess.CompletedProcess:
    script = CHILD.format(tests=str(Path(__file__).parent))
    return subprocess.run([sys.executable, "-c", script, fault, str(src), str(out)], capture_output=True, text=True,
                          timeout=120, check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture
def convert(monkeypatch):
    """An undisturbed conversion in this process (the next run after a fault)."""
    monkeypatch.setattr(gguf, "load_gguf", fake_gguf)
    return gguf.cache_gguf_as_safetensors


def _source(path: Path, payload: bytes) -> Path:
    path.write_bytes(b"GGUF" + payload)
    return path


def _assert_loads(out: Path, src: Path) -> None:
    assert json.loads((out / "gguf_source.json").read_text())["sha256"] == gguf.gguf_fingerprint(src)["sha256"]
    spec = read_folder(out)
    assert set(read_state_dict(spec)) == set(spec.tensors) and "model.embed_tokens.weight" in spec.tensors


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("fault", ["efbig", "kill"])
def test_a_failed_first_conversion_leaves_nothing_and_the_next_run_converts(tmp_path, convert, fault):
    src = _source(tmp_path / "m.gguf", b"weights" * 100)
    out = tmp_path / "cache" / "m"
    res = _convert(fault, src, out)
    if fault == "efbig":
        assert res.returncode == 3, res.stderr[-2000:]
        assert f"writing the conversion of {src} to {out} failed" in res.stdout and "File too large" in res.stdout
    else:
        assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    assert not out.exists()  # nothing that could pass for a conversion
    assert convert(src, out) == out
    assert sorted(p.name for p in out.parent.iterdir()) == [".lock-m", "m"]  # the killed run's partial folder: gone
    _assert_loads(out, src)


@pytest.mark.parametrize("fault", ["efbig", "kill"])
def test_a_failed_rebuild_keeps_the_folder_that_was_there(tmp_path, convert, fault):
    """The source changed, so its conversion is rebuilt; the rebuild fails: the earlier conversion stays whole
    (byte for byte), and the next run replaces it with the new one."""
    src = _source(tmp_path / "m.gguf", b"version one" * 100)
    out = tmp_path / "cache" / "m"
    convert(src, out)
    before = _snapshot(out)
    _source(src, b"version two!" * 100)
    res = _convert(fault, src, out)
    assert res.returncode == (3 if fault == "efbig" else -signal.SIGKILL), res.stderr[-2000:]
    assert _snapshot(out) == before
    convert(src, out)
    assert sorted(p.name for p in out.parent.iterdir()) == [".lock-m", "m"]
    _assert_loads(out, src)


def test_a_file_in_place_of_the_cache_folder_is_named(tmp_path, convert):
    src = _source(tmp_path / "m.gguf", b"weights" * 100)
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder goes")
    with pytest.raises(OSError, match=rf"cannot create the folder {blocker} for the conversion of {src} .*point "
                                      r"LAB_CACHE \(or out_dir\) at a folder"):
        convert(src, blocker / "m")
    assert blocker.read_text() == "a file where the cache folder goes"
    blocker.unlink()
    convert(src, blocker / "m")
    _assert_loads(blocker / "m", src)
