"""The Engine and its call pipeline: the facade (``engine.Engine``: knobs, ``configure``, ``embed`` / ``score`` /
``rerank`` / ``encode``), the knob registry (``knob_registry``) and the knobs' values and resolution on a model
(``knobs``), the adapters in force (``adapter_state``), how texts become a pass (``passes``), inputs (``inputs``:
tokenization, instructions), one call's state (``call``), the scheduler, the executor (packed path) and the KV path
(chunked prefill, prefix cache), long inputs (``windows``), the rerank / score call kinds (``rerank``) and
sentence-transformers' ``encode`` (``st_encode``).

    >>> from lab.engine import Engine
"""

from __future__ import annotations

from lab._lazy import exports

__all__ = ["Engine", "Stats"]
__getattr__ = exports(globals(), {"Engine": "lab.engine.engine", "Stats": "lab.engine.call"})
