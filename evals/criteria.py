"""How the speed benchmarks judge agreement and targets: the minimum cosine between two systems' embeddings, and
issue 15's rule that a speed-up counts only at a minimum cosine of ``COSINE_TARGET`` against the baseline.

Light on purpose (numpy only): ``bench_decoder`` imports it before torch, also in its fresh subprocesses.

    >>> cos = min_cosine(engine_rows, baseline_rows)
    >>> meets_speed_target(ratio=1.5, target=1.45, cos=cos)      # None without a target
"""

from __future__ import annotations

import numpy as np

COSINE_TARGET = 0.9999  # issue 15: the speed targets hold at this minimum cosine against the same-dtype baseline


def row_cosines(a, b) -> np.ndarray:
    """The row-wise cosines between ``a`` and ``b`` ``(N, D)``, in float64 (a zero row counts as 0)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = np.clip(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-300, None)
    return (a * b).sum(1) / norms


def min_cosine(a, b) -> float:
    """The smallest row-wise cosine between ``a`` and ``b`` ``(N, D)`` (``row_cosines``)."""
    return float(row_cosines(a, b).min())


def meets_speed_target(ratio: float, target: float | None, cos: float) -> bool | None:
    """``None`` without a target; else whether ``ratio`` reaches it with min cosine >= ``COSINE_TARGET``."""
    return None if target is None else bool(ratio >= target and cos >= COSINE_TARGET)


def cosine_note(ratio: float, target: float | None, cos: float) -> str:
    """Why ``meets_speed_target`` is False although the ratio reaches the target ("" otherwise)."""
    if target is None or ratio < target or cos >= COSINE_TARGET:
        return ""
    return f"speed reaches the target, but min cosine {cos:.6f} < {COSINE_TARGET}"
