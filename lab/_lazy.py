"""Lazy package exports: a package's public names are imported from their modules on first use, so importing the
package (``import lab``, ``import lab.engine``) stays light and a submodule can import a sibling without running the
whole package."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def exports(package: dict, names: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` (PEP 562) for ``package`` (its ``globals()``): ``names`` maps each public name to
    the module that defines it; the object is imported on first use and kept in the package's namespace."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package['__name__']!r} has no attribute {name!r}")
        obj = getattr(importlib.import_module(names[name]), name)
        package[name] = obj  # later lookups (and `from package import name`) find it directly
        return obj

    return __getattr__
