"""Every notebook runs top to bottom with ``LAB_SMOKE=1`` (tiny workloads) through nbclient; any cell error fails.

The kernel is this interpreter (a kernelspec written to a temporary ``JUPYTER_PATH``, nothing registered
globally), started in ``notebooks/``. Select or skip with ``-m notebooks`` / ``-m "not notebooks"``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = [
    "01_quickstart",
    "02_pooling_and_bidirectional",
    "03_chunked_prefill",
    "04_mteb",
    "05_throughput",
    "06_llm2vec",
    "07_outputs",
]
# generous: a 2-core CI machine shared with other jobs
CELL_TIMEOUT_S = int(os.environ.get("LAB_NOTEBOOK_TIMEOUT", "600"))


def test_the_notebooks_exist():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_as_intended(path):
    """Committed with the outputs of a full run (so a reader sees the results without running anything): every
    cell run, no error output, at least one plot, no smoke-mode run, under 1 MB."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{path.name}: run every cell before committing"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: committed with an error output: {errors[0].get('ename')}"
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), f"{path.name}: no plot"
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "smoke mode: False" in text, f"{path.name}: committed from a smoke run (LAB_SMOKE=1); run it in full"
    assert "profiler_start" not in text, f"{path.name}: torch profiler noise in the outputs"
    assert path.stat().st_size < 1_000_000, f"{path.name} is {path.stat().st_size} bytes; keep it under 1 MB"
    assert nb.metadata.kernelspec.name == "python3"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory) -> Path:
    """A ``python3`` kernelspec running this interpreter, in a folder only our JUPYTER_PATH points to."""
    pytest.importorskip("ipykernel")
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (prefill-lab tests)",
                "language": "python",
            }
        )
    )
    return root


@pytest.mark.notebooks
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_smoke_mode(path, kernel_dir, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    monkeypatch.setenv("LAB_SMOKE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("LAB_MTEB_CACHE", str(tmp_path / "mteb-cache"))  # never the repository's cache
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(path, as_version=4)
    # Unix sockets, not TCP ports: several test runs on one machine cannot pick the same port for their kernels
    sockets = tempfile.mkdtemp(prefix="lab-nb-")
    km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"))
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    t0 = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:  # the message holds the cell source and the traceback
        pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    print(f"{path.name}: {time.perf_counter() - t0:.0f} s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type in ("display_data", "execute_result") and "image/png" in o.get("data", {})
    ]
    assert images, f"{path.name} showed no plot"
