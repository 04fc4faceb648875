"""Real OS faults on everything the toolkit writes: a file size limit (``RLIMIT_FSIZE``: a write fails with EFBIG, as
on a full disk) and a SIGKILL in the middle of a write, each in a child process, and a file where the destination
folder should be. Covered:

- the GGUF cache writing a conversion (the size limit, a kill, a file in place of the cache folder);
- a ``lab.adapt`` run killed while its adapter's files move into place, or on a full disk at its first checkpoint;
- a benchmark's result files (``evals.results_index.save_run``) under the size limit;
- mteb's result cache through ``lab.evaluate`` and ``evals.run``: the size limit on a task's result, a kill in the
  middle of its JSON, between ``model_meta.json`` and the result moving into place, or while a cached result is
  rewritten; a result file found damaged; a file in place of the cache or ``--out`` folder;
- ``lab.distributed.embed_dataset``'s shards and manifest: the disk full after the first shard, a kill in the middle
  of a shard's file, after it is renamed into place but before the manifest lists it, or in the middle of the
  manifest; a file in place of ``out_dir`` or the folder above it.

Each ends in an error naming the folder (the bytes and the fix, for a write) or a killed child, what was there before
left whole (byte for byte), nothing half-written that looks complete, and the next run correct: it resumes, computing
only what is missing, and ends equal to an uninterrupted run.

The tests run as root, where a read-only folder (``chmod``) does not stop a write, so the file in place of a folder
and the size limit stand in for an unwritable destination. A kill in the middle of a write is made by wrapping a
stdlib call in the child (``os.fsync``, ``os.replace``, ``json.dump``); the code under test runs unchanged. The slow
dequantization (transformers' GGUF loader) is replaced by ``test_gguf_cache.fake_gguf``'s tiny random Llama, as in
tests/test_gguf_cache.py; ``lab.evaluate`` runs ``test_evaluate.FakeEngine`` on STSBenchmark cut to 20 and 30 pairs;
``embed_dataset`` runs all-MiniLM-L6-v2 on a local Ray cluster this module starts (its children join it), ~40 s to
start on 2 busy cores, then 15-25 s a child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from test_gguf_cache import fake_gguf

from lab.adapt.peft_lora import LoraSpec
from lab.adapt.train import mntp
from lab.models import gguf
from lab.models.folder import read_folder, read_state_dict

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
    return subprocess.run(
        [sys.executable, "-c", script, fault, str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


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
    with pytest.raises(
        OSError,
        match=rf"cannot create the folder {blocker} for the conversion of {src} .*point "
        r"LAB_CACHE \(or out_dir\) at a folder",
    ):
        convert(src, blocker / "m")
    assert blocker.read_text() == "a file where the cache folder goes"
    blocker.unlink()
    convert(src, blocker / "m")
    _assert_loads(blocker / "m", src)


# ------------------------------------------------------------------------------------------ lab.adapt's folders
ADAPT_CHILD = """
import os, resource, signal, sys
sys.path.insert(0, {tests!r})
from tiny_models import tiny_llama
from lab.adapt.peft_lora import LoraSpec
from lab.adapt.train import mntp

base, out = sys.argv[1:3]
fault = sys.argv[3] if len(sys.argv) > 3 else "none"
if fault == "efbig":  # every file stops at 32 KiB: the checkpoint's adapter (~18 KB) fits, its optimizer state not
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, resource.RLIM_INFINITY))
if fault == "kill":  # killed after the adapter's weights moved in, before its adapter_config.json
    move = os.replace

    def move_then_die(src, dst):
        move(src, dst)
        if os.path.abspath(dst) == os.path.join(os.path.abspath(out), "adapter_model.safetensors"):  # not a checkpoint
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = move_then_die
texts = ["The quick brown fox.", "A packed batch.", "Rotary embeddings.", "Paris is in France."]
try:
    mntp(base, texts, out, steps=2, batch_size=2, save_every=1, lora=LoraSpec(r=2, alpha=4.0, dropout=0.0),
         show_progress=False, dtype="float32")
except OSError as e:
    print(f"OSError: {{e}}")
    sys.exit(3)
"""


ADAPT_TEXTS = ["The quick brown fox.", "A packed batch.", "Rotary embeddings.", "Paris is in France."]
ADAPT_KW = {
    "steps": 2,
    "batch_size": 2,
    "save_every": 1,
    "lora": LoraSpec(r=2, alpha=4.0, dropout=0.0),
    "show_progress": False,
    "dtype": "float32",
}


def _adapt(base: Path, out: Path, *kill: str) -> subprocess.CompletedProcess:
    script = ADAPT_CHILD.format(tests=str(Path(__file__).parent))
    return subprocess.run(
        [sys.executable, "-c", script, str(base), str(out), *kill],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_an_adapter_run_killed_while_its_files_move_resumes_to_the_same_adapter(tmp_path):
    """SIGKILL between the adapter's weights and its config landing in the folder: the folder is not taken for a
    finished adapter (its config comes last), ``resume=True`` finishes from the checkpoint, and the adapter equals
    an uninterrupted run's."""
    from safetensors.torch import load_file
    from tiny_models import tiny_llama

    base = tiny_llama(tmp_path / "base")
    killed = _adapt(base, tmp_path / "killed", "kill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    out = tmp_path / "killed"
    assert (out / "adapter_model.safetensors").exists() and not (out / "adapter_config.json").exists()
    mntp(base, ADAPT_TEXTS, out, resume=True, **ADAPT_KW)
    assert _adapt(base, tmp_path / "whole").returncode == 0
    a, b = (
        load_file(str(out / "adapter_model.safetensors")),
        load_file(str(tmp_path / "whole" / "adapter_model.safetensors")),
    )
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2
    assert not (out / "checkpoint").exists()


def test_an_adapter_run_on_a_full_disk_names_the_folder_and_the_next_run_finishes(tmp_path):
    """EFBIG while the first checkpoint is written (``RLIMIT_FSIZE`` in a child): an ``OSError`` naming the folder
    and ``resume=True``; no checkpoint, temporary folder or adapter config left that could pass for finished work;
    the next run ends with the adapter an uninterrupted run writes."""
    from safetensors.torch import load_file
    from tiny_models import tiny_llama

    base = tiny_llama(tmp_path / "base")
    out = tmp_path / "full"
    res = _adapt(base, out, "efbig")
    assert res.returncode == 3, res.stderr[-2000:]
    assert f"cannot write checkpoint to the folder {out}" in res.stdout and "File too large" in res.stdout
    assert "resume=True" in res.stdout
    assert sorted(p.name for p in out.iterdir()) == ["train_config.json", "train_log.csv"]
    mntp(base, ADAPT_TEXTS, out, resume=True, **ADAPT_KW)
    assert _adapt(base, tmp_path / "whole").returncode == 0
    a, b = (load_file(str(d / "adapter_model.safetensors")) for d in (out, tmp_path / "whole"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


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
        return subprocess.run(
            [sys.executable, "-c", SAVE_RUN, str(tmp_path), str(rows), fault],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    first = run(3)
    assert first.returncode == 0, first.stderr
    csv = Path(first.stdout.strip())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    failed = run(5000, "efbig")  # a CSV of ~25 KB cannot be written
    assert failed.returncode != 0 and "File too large" in failed.stderr + failed.stdout
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing lost, nothing half-written
    assert run(4).returncode == 0 and csv.read_text().count("\n") == 5


# ------------------------------------------------------------------- lab.evaluate / evals.run: mteb's result cache
EVAL_CHILD = """
import json, os, resource, signal, sys
sys.path.insert(0, {tests!r})
from test_evaluate import FakeEngine
from evals import run as cli
from evals.tasks import get_task
from lab.eval.sweeps import evaluate

cache, fault, entry, *limits = sys.argv[1:]
if fault == "efbig":  # every file this process writes stops at 512 bytes (a task's result is ~1.4 KB)
    resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.RLIM_INFINITY))
if fault == "kill-mid-write":  # killed with half of a task's result JSON written (mteb's TaskResult.to_disk)
    dump = json.dump

    def dump_half_then_die(obj, f, **kwargs):
        if isinstance(obj, dict) and "task_name" in obj:
            text = json.dumps(obj, **kwargs)
            f.write(text[: len(text) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        dump(obj, f, **kwargs)

    json.dump = dump_half_then_die
if fault == "kill-between-moves":  # killed once model_meta.json is in place, before the task's result
    move = os.replace

    def move_then_die(src, dst):
        move(src, dst)
        if os.path.basename(dst) == "model_meta.json":
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = move_then_die
try:
    if entry == "cli":
        cli.main(["--model", "unused", "--tasks", "STSBenchmark", "--limit", limits[0], "--cache", cache,
                  "--out", os.path.join(cache, "..", "out")], engine=FakeEngine())
    else:
        evaluate(FakeEngine(), [get_task("STSBenchmark", limit=int(n)) for n in limits], cache=cache,
                 overwrite=entry == "overwrite", show_progress=False)
except OSError as e:
    print(f"OSError: {{e}}")
    sys.exit(3)
"""
FIRST, SECOND = 20, 30  # two tiny tasks: STSBenchmark.n20 and STSBenchmark.n30


def _evaluate_child(cache: Path, fault: str, entry: str, *limits: int) -> subprocess.CompletedProcess:
    script = EVAL_CHILD.format(tests=str(Path(__file__).parent))
    return subprocess.run(
        [sys.executable, "-c", script, str(cache), fault, entry, *map(str, limits)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _evaluate(cache, *limits: int, **kwargs) -> dict[str, str]:
    """An undisturbed ``lab.evaluate`` of FakeEngine in this process: each task's status (computed / cached)."""
    from test_evaluate import FakeEngine

    from evals.tasks import get_task
    from lab.eval.sweeps import evaluate, task_table

    df = evaluate(
        FakeEngine(), [get_task("STSBenchmark", limit=n) for n in limits], cache=cache, show_progress=False, **kwargs
    )
    return dict(task_table(df)[["task", "status"]].itertuples(index=False))


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (``None``) under ``root``, by relative path."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _result_folder(cache: Path) -> Path:
    [folder] = {p.parent for p in (cache / "results").rglob("model_meta.json")}
    return folder


def _assert_result_reads(path: Path, name: str) -> None:
    from mteb.results import TaskResult

    assert TaskResult.from_disk(path).task_name == name


@pytest.mark.parametrize("entry", ["evaluate", "cli"])
def test_an_evaluation_that_cannot_write_keeps_the_results_before(tmp_path, entry):
    """The second task's result cannot be written (a real file size limit, EFBIG, in a child running
    ``lab.evaluate`` or ``evals.run``): an ``OSError`` names the results folder, the bytes and the fix; the first
    task's result, ``model_meta.json`` and ``run_settings.jsonl`` stay byte for byte, nothing half-written is left;
    the next run reads the first task from the cache and computes only the second."""
    cache = tmp_path / "cache"
    assert _evaluate(cache, FIRST) == {f"STSBenchmark.n{FIRST}": "computed"}
    before = _tree(cache)
    res = _evaluate_child(cache, "efbig", entry, *([SECOND] if entry == "cli" else [FIRST, SECOND]))
    assert res.returncode == 3, res.stderr[-2000:]
    folder = _result_folder(cache)
    assert (
        f"cannot write STSBenchmark.n{SECOND}.json (" in res.stdout
        and f"bytes) to the folder {folder}: File too large; free space there" in res.stdout
        and "point cache= (evals.run --cache" in res.stdout
    ), res.stdout
    assert _tree(cache) == before
    assert _evaluate(cache, FIRST, SECOND) == {
        f"STSBenchmark.n{FIRST}": "cached",
        f"STSBenchmark.n{SECOND}": "computed",
    }
    _assert_result_reads(folder / f"STSBenchmark.n{SECOND}.json", f"STSBenchmark.n{SECOND}")
    assert not list(cache.glob(".partial-*"))


@pytest.mark.parametrize(
    ("fault", "entry"),
    [("kill-mid-write", "evaluate"), ("kill-between-moves", "evaluate"), ("kill-mid-write", "overwrite")],
)
def test_an_evaluation_killed_while_a_result_is_written_keeps_the_results_before(tmp_path, fault, entry):
    """SIGKILL in the middle of a task's result JSON (half of it on disk), or between ``model_meta.json`` and the
    result moving into place, or while a result already cached is rewritten (``overwrite=True``): every result
    there before stays byte for byte and readable, and the next run computes only the task that is missing (its
    staging folder, ``.partial-<pid>``, removed)."""
    cache = tmp_path / "cache"
    _evaluate(cache, FIRST)
    folder = _result_folder(cache)
    first = (folder / f"STSBenchmark.n{FIRST}.json").read_bytes()
    limits = [FIRST] if entry == "overwrite" else [FIRST, SECOND]
    res = _evaluate_child(cache, fault, entry, *limits)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    assert (folder / f"STSBenchmark.n{FIRST}.json").read_bytes() == first
    assert not (folder / f"STSBenchmark.n{SECOND}.json").exists()
    _assert_result_reads(folder / f"STSBenchmark.n{FIRST}.json", f"STSBenchmark.n{FIRST}")
    assert len(list(cache.glob(".partial-*"))) == 1  # the killed run's staging folder: never read
    expected = {f"STSBenchmark.n{FIRST}": "cached"} | (
        {} if entry == "overwrite" else {f"STSBenchmark.n{SECOND}": "computed"}
    )
    assert _evaluate(cache, *limits) == expected
    assert (folder / f"STSBenchmark.n{FIRST}.json").read_bytes() == first
    assert not list(cache.glob(".partial-*"))


def test_a_damaged_result_is_named_and_computed_again(tmp_path):
    """A result JSON cut in half (what mteb's own writer leaves when killed mid-write): the next run warns naming
    the file, computes that task again and replaces the file; the other task's result is read from the cache and
    left byte for byte."""
    import re

    cache = tmp_path / "cache"
    _evaluate(cache, FIRST, SECOND)
    folder = _result_folder(cache)
    damaged, other = folder / f"STSBenchmark.n{SECOND}.json", folder / f"STSBenchmark.n{FIRST}.json"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    keep = other.read_bytes()
    with pytest.warns(
        UserWarning,
        match=rf"the cached mteb result {re.escape(str(damaged))} is damaged and cannot "
        rf"be read .*STSBenchmark.n{SECOND} is computed again",
    ):
        status = _evaluate(cache, FIRST, SECOND)
    assert status == {f"STSBenchmark.n{FIRST}": "cached", f"STSBenchmark.n{SECOND}": "computed"}
    _assert_result_reads(damaged, f"STSBenchmark.n{SECOND}")
    assert other.read_bytes() == keep


@pytest.mark.parametrize("where", ["evaluate cache", "cli --cache", "cli --out"])
def test_a_file_in_place_of_a_result_folder_is_named_before_any_work(tmp_path, where):
    """A file where the result cache (``lab.evaluate``'s ``cache=``, ``evals.run --cache``) or ``evals.run --out``
    should be: an ``OSError`` naming the folder, the file in the way and the fix, before the engine embeds
    anything; the file is left as it was."""
    from test_evaluate import FakeEngine

    from evals import run as cli
    from evals.tasks import get_task
    from lab.eval.sweeps import evaluate

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder goes")
    eng = FakeEngine()
    if where == "evaluate cache":
        call = partial(
            evaluate, eng, [get_task("STSBenchmark", limit=FIRST)], cache=blocker / "cache", show_progress=False
        )
    else:
        folders = {"--cache": tmp_path / "cache", "--out": tmp_path / "out", where.split()[1]: blocker / "x"}
        call = partial(
            cli.main,
            [
                "--model",
                "unused",
                "--tasks",
                "STSBenchmark",
                "--limit",
                str(FIRST),
                "--cache",
                str(folders["--cache"]),
                "--out",
                str(folders["--out"]),
            ],
            engine=eng,
        )
    fix = "pass --out a folder" if where == "cli --out" else r"point cache= \(evals.run --cache, \$LAB_MTEB_CACHE\)"
    with pytest.raises(
        OSError,
        match=rf"cannot create the folder {blocker}.* \({blocker} is a file, not a "
        rf"folder\); {fix}",
    ):
        call()
    assert eng.n_embed == 0 and blocker.read_text() == "a file where a folder goes"


# ------------------------------------------------------------------------------------ embed_dataset's shards
EMBED_CHILD = """
import os, resource, signal, sys
from lab._extras import minilm_path
from lab.distributed import embed_dataset

corpus, out, address, fault = sys.argv[1:5]
KILLED = 1  # the shard a kill interrupts: shard 0 is written and recorded before it


def write_kill(name, nth=1):
    # SIGKILL in the nth fsync of a temporary file for name (atomic_write's .<name>.<pid>.tmp), half of its bytes
    # on disk: a process killed in the middle of a write
    sync, seen = os.fsync, []

    def half_then_die(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{{fd}}")).startswith(f".{{name}}."):
            seen.append(fd)
            if len(seen) == nth:
                os.ftruncate(fd, os.fstat(fd).st_size // 2)
                sync(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        sync(fd)

    os.fsync = half_then_die


def on_shard(row):
    if fault == "efbig" and row["shard"] == 0:  # the disk is full from here on: every file stops at 8 KiB
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 13, resource.RLIM_INFINITY))


if fault == "kill-mid-shard":
    write_kill(f"shard-{{KILLED:05d}}.parquet")
if fault == "kill-mid-manifest":  # its writes: the job, then after shard 0, then after shard 1 (killed)
    write_kill("manifest.json", nth=KILLED + 2)
if fault == "kill-after-shard-rename":  # shard 1's file in place, the manifest not yet rewritten
    move = os.replace

    def move_then_die(src, dst):
        move(src, dst)
        if os.path.basename(dst) == f"shard-{{KILLED:05d}}.parquet":
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = move_then_die
try:
    embed_dataset(minilm_path(), corpus, out, num_actors=1, shard_texts={shard}, address=address, on_shard=on_shard,
                  show_progress=False)
except OSError as e:
    print(f"OSError: {{e}}")
    sys.exit(3)
"""
SHARD, ROWS = 10, 40  # four shards


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for this module's embed_dataset tests (3 logical CPUs: the RayEngine of this process,
    a child's actor, and one a killed child's actor holds until Ray reaps it); its address for the children."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=3, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def job(ray_cluster, minilm_path, tmp_path_factory):
    """The corpus (a JSONL file), a RayEngine of this process for the runs after a fault, and the shards of an
    uninterrupted run (``read_embeddings``'s ids and vectors)."""
    from lab.distributed import RayEngine, embed_dataset, read_embeddings

    root = tmp_path_factory.mktemp("embed")
    corpus = root / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"id": f"doc-{i}", "text": f"sentence {i}: " + "word " * (i % 9)}) + "\n" for i in range(ROWS)
        )
    )
    with RayEngine(minilm_path, num_actors=1) as reng:
        embed_dataset(reng, corpus, root / "whole", shard_texts=SHARD, show_progress=False)
        yield {"corpus": corpus, "address": ray_cluster, "reng": reng, "whole": read_embeddings(root / "whole")}


def _embed_child(job: dict, out: Path, fault: str) -> subprocess.CompletedProcess:
    script = EMBED_CHILD.format(shard=SHARD)
    return subprocess.run(
        [sys.executable, "-c", script, str(job["corpus"]), str(out), job["address"], fault],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _assert_resumes(job: dict, out: Path, done: int) -> None:
    """``out`` holds the first ``done`` shards as the uninterrupted run wrote them (readable, no other shard
    listed); the next run computes only the others, leaves those files and records as they were, and ends with the
    uninterrupted run's ids and vectors and no temporary file."""
    import numpy as np

    from lab.distributed import embed_dataset, read_embeddings
    from lab.distributed.shards import MANIFEST

    ids, vectors = read_embeddings(out)
    assert ids == job["whole"][0][: done * SHARD] and np.allclose(vectors, job["whole"][1][: done * SHARD], atol=1e-6)
    kept = json.loads((out / MANIFEST).read_text())["shards"]
    files = {k: (out / v["file"]).read_bytes() for k, v in kept.items()}
    summary = embed_dataset(job["reng"], job["corpus"], out, shard_texts=SHARD, show_progress=False)
    assert summary.loc[summary["computed"], "shard"].tolist() == list(range(done, ROWS // SHARD))
    after = json.loads((out / MANIFEST).read_text())["shards"]
    assert {k: after[k] for k in kept} == kept and all(
        (out / v["file"]).read_bytes() == files[k] for k, v in kept.items()
    )
    ids, vectors = read_embeddings(out)
    assert ids == job["whole"][0] and np.allclose(vectors, job["whole"][1], atol=1e-6)
    assert sorted(p.name for p in out.iterdir()) == [
        MANIFEST,
        *(f"shard-{k:05d}.parquet" for k in range(ROWS // SHARD)),
    ]


def test_embed_dataset_on_a_full_disk_names_the_folder_and_resumes(tmp_path, job):
    """The disk fills after shard 0 (a real file size limit, EFBIG, in the child): an ``OSError`` names the output
    folder, the shard file and its bytes, and the fix; shard 0 and the manifest stay whole and readable, no
    temporary file is left; the next run computes shards 1 to 3 only and ends equal to an uninterrupted run."""
    out = tmp_path / "out"
    res = _embed_child(job, out, "efbig")
    assert res.returncode == 3, res.stderr[-3000:]
    assert (
        "cannot write shard-00001.parquet (" in res.stdout
        and f"bytes) to the folder {out}: File too large; free space there" in res.stdout
        and "run embed_dataset again: it resumes" in res.stdout
    ), res.stdout
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    _assert_resumes(job, out, done=1)


@pytest.mark.parametrize("fault", ["kill-mid-shard", "kill-after-shard-rename", "kill-mid-manifest"])
def test_embed_dataset_killed_while_writing_resumes_to_the_same_shards(tmp_path, job, fault):
    """SIGKILL of the child with half of shard 1's temporary file written, after shard 1's file was renamed into
    place but before the manifest lists it, or with half of the manifest that would list it written: the folder
    reads as shard 0 alone (the manifest before the kill), and the next run recomputes shards 1 to 3, removes the
    killed write's temporary file and ends equal to an uninterrupted run."""
    out = tmp_path / "out"
    res = _embed_child(job, out, fault)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    leftovers = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert len(leftovers) == (0 if fault == "kill-after-shard-rename" else 1), leftovers
    assert (out / "shard-00001.parquet").exists() == (fault != "kill-mid-shard")
    _assert_resumes(job, out, done=1)


@pytest.mark.parametrize("blocked", ["out_dir", "its parent"])
def test_a_file_in_place_of_the_output_folder_is_named_before_any_work(tmp_path, blocked):
    """A file where ``out_dir`` (or the folder above it) should be: an ``OSError`` naming the folder, the file and
    the fix, raised before any model is looked at (the model path here does not exist) or any actor starts."""
    pytest.importorskip("ray")
    from lab.distributed import embed_dataset

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder goes")
    out = blocker if blocked == "out_dir" else blocker / "out"
    with pytest.raises(
        OSError,
        match=rf"cannot create the folder {out} for embed_dataset's shards \({blocker} is "
        r"a file, not a folder\); point out_dir at a folder that can be written",
    ):
        embed_dataset(tmp_path / "no-such-model", ["a", "b"], out, show_progress=False)
    assert blocker.read_text() == "a file where a folder goes"
