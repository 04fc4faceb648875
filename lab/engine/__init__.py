"""The Engine and its call pipeline: the facade (``engine.Engine``: knobs, ``configure``, ``embed`` / ``score`` /
``rerank`` / ``encode``), knobs (``knobs``), inputs (``inputs``: tokenization, instructions), one call's state
(``call``), the scheduler, the executor (packed path) and the KV path (chunked prefill, prefix cache), long inputs
(``windows``), the rerank / score call kinds (``rerank``) and sentence-transformers' ``encode`` (``st_encode``).

    >>> from lab.engine import Engine
"""

from __future__ import annotations

from lab._lazy import exports

__all__ = ["Engine", "Stats"]
__getattr__ = exports(globals(), {"Engine": "lab.engine.engine", "Stats": "lab.engine.call"})
