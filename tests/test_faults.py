"""Real OS faults while the GGUF cache writes a conversion: a file size limit (``RLIMIT_FSIZE``: the write fails
with EFBIG) and a SIGKILL in the middle of the write, each in a child process, and a file where the destination
folder should be; a ``lab.adapt`` run killed while its adapter's files move into place; a benchmark's result files
(``evals.results_index.save_run``) under the size limit. Each ends in an error naming the folder (or a killed child), the folder that was there before
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


# ------------------------------------------------------------------------------------------ lab.adapt's folders
ADAPT_CHILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from tiny_models import tiny_llama
from lab.adapt.train import LoraSpec, mntp

base, out = sys.argv[1:3]
if len(sys.argv) > 3:  # killed after the adapter's weights moved in, before its adapter_config.json
    move = os.replace

    def move_then_die(src, dst):
        move(src, dst)
        if os.path.abspath(dst) == os.path.join(os.path.abspath(out), "adapter_model.safetensors"):  # not a checkpoint
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = move_then_die
texts = ["The quick brown fox.", "A packed batch.", "Rotary embeddings.", "Paris is in France."]
mntp(base, texts, out, steps=2, batch_size=2, save_every=1, lora=LoraSpec(r=2, alpha=4.0, dropout=0.0),
     show_progress=False, dtype="float32")
"""


def _adapt(base: Path, out: Path, *kill: str) -> subprocess.CompletedProcess:
    script = ADAPT_CHILD.format(tests=str(Path(__file__).parent))
    return subprocess.run([sys.executable, "-c", script, str(base), str(out), *kill], capture_output=True,
                          text=True, timeout=300, check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_an_adapter_run_killed_while_its_files_move_resumes_to_the_same_adapter(tmp_path):
    """SIGKILL between the adapter's weights and its config landing in the folder: the folder is not taken for a
    finished adapter (its config comes last), ``resume=True`` finishes from the checkpoint, and the adapter equals
    an uninterrupted run's."""
    from safetensors.torch import load_file
    from tiny_models import tiny_llama

    from lab.adapt.train import LoraSpec, mntp

    base = tiny_llama(tmp_path / "base")
    killed = _adapt(base, tmp_path / "killed", "kill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    out = tmp_path / "killed"
    assert (out / "adapter_model.safetensors").exists() and not (out / "adapter_config.json").exists()
    texts = ["The quick brown fox.", "A packed batch.", "Rotary embeddings.", "Paris is in France."]
    kw = {"steps": 2, "batch_size": 2, "save_every": 1, "lora": LoraSpec(r=2, alpha=4.0, dropout=0.0),
          "show_progress": False, "dtype": "float32"}
    mntp(base, texts, out, resume=True, **kw)
    assert _adapt(base, tmp_path / "whole").returncode == 0
    a, b = load_file(str(out / "adapter_model.safetensors")), load_file(str(tmp_path / "whole" /
                                                                           "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2
    assert not (out / "checkpoint").exists()


SAVE_RUN = """
import resource, sys
import pandas as pd
from evals.results_index import save_run
rows = int(sys.argv[2])
if sys.argv[3] == "efbig":  # every file this process writes stops at 4 KiB
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 12, resource.RLIM_INFINITY))
print(save_run(pd.DataFrame({"tokens_per_s": range(rows)}), sys.argv[1], "bench_fault"))
"""


def test_a_benchmark_run_that_cannot_write_keeps_the_previous_results(tmp_path):
    """``evals.results_index.save_run`` under a real file size limit (EFBIG in a child): the run fails, the CSV and
    its meta file written before stay whole, no partial file is left; the next run replaces them."""
    def run(rows: int, fault: str = "none") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", SAVE_RUN, str(tmp_path), str(rows), fault], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, check=False)

    first = run(3)
    assert first.returncode == 0, first.stderr
    csv = Path(first.stdout.strip())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    failed = run(5000, "efbig")  # a CSV of ~25 KB cannot be written
    assert failed.returncode != 0 and "File too large" in failed.stderr + failed.stdout
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing lost, nothing half-written
    assert run(4).returncode == 0 and csv.read_text().count("\n") == 5
