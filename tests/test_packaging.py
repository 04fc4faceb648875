"""Packaging: kernels/ is importable as lab.kernels only, and installing us leaves transformers' probe alone."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str, cwd) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True).stdout


def test_kernels_live_under_lab(tmp_path):
    out = _run("import lab.kernels.reference as r, importlib.util as u; print(r.__name__, u.find_spec('kernels'))",
               tmp_path)
    assert out.split() == ["lab.kernels.reference", "None"]


def test_transformers_kernels_probe_unchanged(tmp_path):
    """transformers asks whether a top-level `kernels` (Hugging Face's kernel hub library) is importable. That
    library is not a dependency, so with prefill-lab installed the probe must still answer False."""
    out = _run(
        "import importlib.util as u, lab.kernels; from transformers.utils.import_utils import is_kernels_available;"
        " print(u.find_spec('kernels'), is_kernels_available())",
        tmp_path,
    )
    assert out.split() == ["None", "False"]


def test_import_lab_is_light(tmp_path):
    out = _run("import sys, lab; print('torch' in sys.modules, 'transformers' in sys.modules)", tmp_path)
    assert out.split() == ["False", "False"]
