"""Import the repository's ``evals`` package (it sits next to ``lab/``) without putting the repository root on
``sys.path``: the root also holds ``kernels/``, a top-level name that transformers probes for, so it stays off
the path. Works from any working directory (a notebook started in ``notebooks/``, the tests, the CLI)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def import_evals(submodule: str | None = None) -> ModuleType | None:
    """``evals`` (or ``evals.<submodule>``) from this checkout; ``None`` when lab is installed without it."""
    if "evals" not in sys.modules:
        init = ROOT / "evals" / "__init__.py"
        if importlib.util.find_spec("evals") is None:
            if not init.is_file():
                return None
            spec = importlib.util.spec_from_file_location("evals", init, submodule_search_locations=[str(init.parent)])
            module = importlib.util.module_from_spec(spec)
            sys.modules["evals"] = module
            spec.loader.exec_module(module)
    return importlib.import_module(f"evals.{submodule}" if submodule else "evals")
