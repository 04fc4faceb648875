"""Adapters: PEFT LoRA folders merged live into an engine's weights (``adapters``) and LLM2Vec-style training that
writes them (``train``: MNTP, unsupervised SimCSE through transformers + peft).

    >>> from lab.adapt import mntp, simcse
    >>> mntp(base, texts, "runs/mntp", steps=300)
"""

from __future__ import annotations

from lab._lazy import exports

__all__ = ["AdaptRun", "LoraSpec", "mntp", "simcse"]
__getattr__ = exports(globals(), {name: "lab.adapt.train" for name in __all__})
