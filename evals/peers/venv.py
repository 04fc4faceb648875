"""The peers' virtual environment and their exported models, built once in a cache folder outside the repository.

The peer runtimes (sentence-transformers on ONNX Runtime and OpenVINO, fastembed) pin their own transformers /
sentence-transformers, which conflict with the project's, so they live in a virtual environment of their own:
``<cache>/peers-venv``, ``<cache>`` being ``~/.cache/prefill-lab`` or ``$LAB_PEERS_CACHE``. ``ensure_venv`` builds it
from ``evals/peers/requirements.txt`` (torch alone first: its CPU build; then the whole file) and writes the file's
hash (``requirements_key``) into it last; a venv whose stamp differs from the file's current hash, or that has no
stamp (an interrupted build), is removed and built again.

``ensure_export`` writes the model in the formats the peers load, once per model folder and requirements hash:
a copy of the sentence-transformers folder with ``onnx/model.onnx`` (optimum's ONNX export) and
``openvino/openvino_model.xml`` (optimum-intel's OpenVINO export) added, made offline from the local folder by
``worker.py export`` in the peers' venv.

    >>> python = ensure_venv()                      # minutes the first time (downloads ~1 GB), then instant
    >>> folder = ensure_export(python, minilm_path())
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from lab import env as lab_env

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"
WORKER = HERE / "worker.py"
STAMP = ".requirements-sha256"  # inside the venv / export folder: the requirements key it was built from


def cache_root() -> Path:
    """``$LAB_PEERS_CACHE`` if set, else ``~/.cache/prefill-lab``."""
    return lab_env.path("LAB_PEERS_CACHE", Path.home() / ".cache" / "prefill-lab", folder=True)


def requirements_key(path: Path = REQUIREMENTS) -> str:
    """The SHA-256 of the requirements file's bytes (hex): a venv or export built from other bytes is rebuilt."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def torch_requirement(path: Path = REQUIREMENTS) -> str:
    """The file's ``torch==...`` line, installed alone before the rest (a bare torch request pulls a CUDA build)."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("torch") and line[5:6] in ("=", "<", ">", "~", "!", " "):
            return line
    raise ValueError(f"{path} pins no torch version: add a line such as torch==2.13.0 (a CPU build) at its top")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_current(folder: Path, key: str) -> bool:
    """Whether ``folder`` was completely built from requirements with this ``key`` (its stamp, written last)."""
    stamp = folder / STAMP
    return stamp.is_file() and stamp.read_text(encoding="utf-8").strip() == key


def ensure_venv(
    requirements: Path = REQUIREMENTS, root: Path | None = None, *, base_python: str | None = None, log=sys.stderr
) -> Path:
    """The peers' venv python, building ``<root>/peers-venv`` from ``requirements`` unless it is current."""
    requirements = Path(requirements)
    venv = Path(root or cache_root()) / "peers-venv"
    key = requirements_key(requirements)
    if is_current(venv, key) and venv_python(venv).exists():
        return venv_python(venv)
    print(
        f"building the peers' virtual environment in {venv} from {requirements} (a few minutes, once)",
        file=log,
        flush=True,
    )
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = base_python or getattr(sys, "_base_executable", None) or sys.executable
    steps = [
        [base, "-m", "venv", str(venv)],
        [str(venv_python(venv)), "-m", "pip", "install", "-q", torch_requirement(requirements)],
        [str(venv_python(venv)), "-m", "pip", "install", "-q", "-r", str(requirements)],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, check=False, stdout=log, stderr=log)
        if done.returncode:
            raise RuntimeError(
                f"building the peers' venv failed at `{' '.join(cmd)}` (exit {done.returncode}); "
                f"fix {requirements} or remove {venv} and run again"
            )
    (venv / STAMP).write_text(key + "\n", encoding="utf-8")
    return venv_python(venv)


def model_key(model_dir: Path) -> str:
    """A short hash of a model folder's file names, sizes and modification times (its weights changed: new key)."""
    h = hashlib.sha256()
    for p in sorted(Path(model_dir).rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(model_dir)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def ensure_export(
    python: Path, model_dir: str | Path, root: Path | None = None, *, requirements: Path = REQUIREMENTS, log=sys.stderr
) -> Path:
    """The model folder with ``onnx/`` and ``openvino/`` exports added, in
    ``<root>/peers-models/<folder name>-<model_key>``; exported (offline) unless present for this requirements key."""
    model_dir = Path(model_dir)
    out = Path(root or cache_root()) / "peers-models" / f"{model_dir.name}-{model_key(model_dir)}"
    key = requirements_key(requirements)
    if is_current(out, key):
        return out
    print(f"exporting {model_dir} to ONNX and OpenVINO in {out} (once)", file=log, flush=True)
    if out.exists():
        shutil.rmtree(out)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [str(python), str(WORKER), "export", str(model_dir), str(out)], check=False, stdout=log, stderr=log, env=env
    )
    if done.returncode:
        raise RuntimeError(f"exporting {model_dir} for the peers failed (exit {done.returncode}); see the log above")
    (out / STAMP).write_text(key + "\n", encoding="utf-8")
    return out
