"""Adapters: PEFT LoRA folders read and checked (``adapters``), their key scope (``key_scope``), merged live into an
engine's weights (``merge``), and LLM2Vec-style training that writes them (``train``: MNTP, unsupervised SimCSE
through transformers + peft; ``objectives``: batches and losses; ``run_files``: adapter, checkpoint and log files;
``peft_lora``: the trained LoRA's settings).

The folders ``mntp`` / ``simcse`` write load in llm2vec and in peft over the bare model
(``PeftModel.from_pretrained(AutoModel.from_pretrained(base), folder)``); ``rescope`` rewrites an adapter saved
from a ``*ForCausalLM`` (keys ``base_model.model.model.layers...``) to that scope.

    >>> from lab.adapt import mntp, simcse, rescope
    >>> mntp(base, texts, "runs/mntp", steps=300)
    >>> rescope("old/mntp", "runs/mntp-bare")
"""

from __future__ import annotations

from lab._lazy import exports

__all__ = ["AdaptRun", "LoraSpec", "mntp", "rescope", "simcse"]
__getattr__ = exports(
    globals(),
    {
        **{name: "lab.adapt.train" for name in ("AdaptRun", "mntp", "simcse")},
        "LoraSpec": "lab.adapt.peft_lora",
        "rescope": "lab.adapt.key_scope",
    },
)
