"""prefill-lab: a Jupyter-first, prefill-only research engine for embedding and rerank models.

    >>> from lab import Engine
    >>> eng = Engine(path)                    # local model folder
    >>> E = eng.embed(["a text", "another"])  # (2, dim) float32, input order
    >>> eng.configure(pooling="cls")          # live knob, no reload

Nothing heavy is imported at import time: ``Engine`` and ``evaluate`` (``lab.sweeps.evaluate``) load on first
use.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Engine", "evaluate"]


def __getattr__(name: str):
    if name == "Engine":
        from lab.engine import Engine as obj
    elif name == "evaluate":
        from lab.sweeps import evaluate as obj
    else:
        raise AttributeError(f"module 'lab' has no attribute {name!r}")
    globals()[name] = obj  # later lookups (and `from lab import ...`) find it directly
    return obj
