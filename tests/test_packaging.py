"""Packaging: kernels/ is importable as lab.kernels only, and never stands in for Hugging Face's `kernels` library.

transformers (>= 5.25 depends on it) imports a top-level `kernels` at start-up. Python puts the current directory
first on sys.path, so from the repository root our kernels/ folder would be found first; kernels/__init__.py then
hands the import over to the library (or stays empty where the library is absent).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = str(ROOT / "kernels")


def _run(code: str, cwd) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _origin(line: str) -> str:
    return "None" if line == "None" else str(Path(line).resolve().parent)


def test_kernels_live_under_lab(tmp_path):
    out = _run(
        "import lab.kernels.reference as r, importlib.util as u; s = u.find_spec('kernels');"
        " print(r.__name__); print(s.origin if s else None)",
        tmp_path,
    )
    name, origin = out.splitlines()
    assert name == "lab.kernels.reference"
    assert _origin(origin) != OURS  # None, or the library's own folder


def test_transformers_kernels_probe_unchanged(tmp_path):
    """Importing lab changes nothing in transformers' answer to "is the kernels library usable?"."""
    probe = "from transformers.utils.import_utils import is_kernels_available; print(is_kernels_available())"
    assert _run(probe, tmp_path) == _run("import lab.kernels; " + probe, tmp_path)


def test_repository_root_does_not_shadow_the_library():
    """`python -m lab.demo` / `python -m pytest` run from the root: transformers must still import, and `import
    kernels` must give the library where it is installed."""
    out = _run(
        "import transformers.modeling_utils, kernels, lab.kernels.reference;"
        " print(kernels.__file__); print(lab.kernels.__file__)",
        ROOT,
    )
    top, ours = out.splitlines()
    assert _origin(ours) == OURS
    try:
        from importlib.metadata import PackageNotFoundError, version

        version("kernels")
        installed = True
    except PackageNotFoundError:
        installed = False
    if installed:
        assert _origin(top) != OURS, "the repository's kernels/ was imported in place of the kernels library"


def test_shadowing_module_stays_empty_without_the_library():
    """No library on sys.path: the top-level `kernels` found in the root is inert (no version, no submodules)."""
    out = _run(
        "import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p and 'dist-packages' not in p];"
        " import kernels; print(kernels.__file__); print(hasattr(kernels, '__version__'), "
        "hasattr(kernels, 'reference'))",
        ROOT,
    )
    path, flags = out.splitlines()
    assert _origin(path) == OURS
    assert flags.split() == ["False", "False"]


def test_import_lab_is_light(tmp_path):
    out = _run("import sys, lab; print('torch' in sys.modules, 'transformers' in sys.modules)", tmp_path)
    assert out.split() == ["False", "False"]


def test_wheel_carries_the_c_kernel_source(tmp_path):
    """A regular (non-editable) install has the kernels' C sources and header beside their loader, or the kernels
    cannot build and the probe silently never offers them."""
    import zipfile

    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("prefill_lab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {
        "lab/kernels/cpu_attention.c",
        "lab/kernels/cpu_rows.c",
        "lab/kernels/cpu_vector.h",
        "lab/kernels/cpu_attention.py",
    } <= set(names)


def test_the_c_kernels_build_and_load_wherever_there_is_a_compiler(tmp_path):
    """A broken C source must fail here rather than skip the kernel tests (they skip where the kernels cannot
    build): with a C compiler on the machine, the sources compile into one library (portable flags: any CPU) that
    loads with every kernel bound."""
    from lab.kernels import cpu_attention

    if not any(shutil.which(c) for c in (os.environ.get("CC") or "cc", "gcc", "clang")):
        pytest.skip("no C compiler on this machine")
    lib = cpu_attention.bind(cpu_attention.build(arch=[], directory=tmp_path))
    for name in (
        "lab_varlen_attention",
        "lab_attention_scratch",
        "lab_add_layer_norm",
        "lab_add_rms_norm",
        "lab_rope_pairs",
    ):
        assert getattr(lib, name) is not None, name
