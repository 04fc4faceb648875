"""Architecture name -> our packed implementation; anything else falls back to transformers ``AutoModel``.

One module per family: ``bert.py`` (BERT / RoBERTa / XLM-R encoders), ``decoder.py`` (Llama / Mistral / Qwen2 /
Qwen3, differences as config fields); each subclasses ``base.PackedModel`` (the contract the engine relies on). Model
code never imports the engine, scheduler or executor: it sees flat tokens and an ``AttnMeta`` (``lab.ops.batch``).
"""

from __future__ import annotations

import importlib

# architecture (config.json "architectures"[0]) -> "module:Class"
REGISTRY: dict[str, str] = {
    **{
        a: "lab.models.bert:BertModel"
        for a in (
            "BertModel",
            "BertForMaskedLM",
            "BertForSequenceClassification",
            "BertForPreTraining",
            "RobertaModel",
            "RobertaForMaskedLM",
            "RobertaForSequenceClassification",
            "XLMRobertaModel",
            "XLMRobertaForMaskedLM",
            "XLMRobertaForSequenceClassification",
        )
    },
    **{
        a: "lab.models.decoder:DecoderModel"
        for a in (
            "LlamaModel",
            "LlamaForCausalLM",
            "MistralModel",
            "MistralForCausalLM",
            "Qwen2Model",
            "Qwen2ForCausalLM",
            "Qwen3Model",
            "Qwen3ForCausalLM",
            "Qwen2ForSequenceClassification",
            "Qwen3ForSequenceClassification",
            "LlamaForSequenceClassification",
        )
    },
}


def model_class(architecture: str):
    """Our class for an architecture name, or ``None`` when it has no packed implementation."""
    target = REGISTRY.get(architecture)
    if target is None:
        return None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)
