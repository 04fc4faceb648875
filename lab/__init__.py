"""prefill-lab: a Jupyter-first, prefill-only research engine for embedding and rerank models.

    >>> from lab import Engine
    >>> eng = Engine(path)                    # local model folder
    >>> E = eng.embed(["a text", "another"])  # (2, dim) float32, input order
    >>> eng.configure(pooling="cls")          # live knob, no reload

The package is laid out by layer (``tests/test_structure.py`` holds each layer to what it may import):
``lab.kernels`` (Triton and C kernels beside torch references) < ``lab.ops`` (batch layout, attention and GEMM
dispatch, CPU probes and plan) < ``lab.models`` (families, loading) < ``lab.runtime`` (weights, CPU plan, worker
pool, runner) and ``lab.outputs`` (pooling, heads, output kinds, scoring) < ``lab.adapt`` (LoRA adapters, MNTP /
SimCSE training) < ``lab.engine`` (the Engine and its call pipeline) < ``lab.eval`` (MTEB, sweeps, bench, plots,
panel) < ``lab.distributed`` (Ray, Parquet shards).

Nothing heavy is imported at import time: ``Engine`` and ``evaluate`` (``lab.eval.sweeps.evaluate``) load on first
use.
"""

from __future__ import annotations

from lab._lazy import exports

__version__ = "0.1.0"
__all__ = ["Engine", "evaluate"]
__getattr__ = exports(globals(), {"Engine": "lab.engine.engine", "evaluate": "lab.eval.sweeps"})
