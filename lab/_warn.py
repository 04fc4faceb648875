"""``warn``: ``warnings.warn`` attributed to the first caller outside the ``lab`` package, so a warning names the
user's line (a notebook cell, a script, a test) however deep in the package it was raised, and Python's "once per
location" filters count it there."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_PACKAGE = str(Path(__file__).parent) + "/"  # as the package's code objects name their files (not resolved)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` with the ``stacklevel`` of the nearest frame outside the package."""
    level, frame = 1, sys._getframe(0)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
