"""Architecture name -> our packed implementation; anything else falls back to transformers ``AutoModel``.

One module per family: ``bert.py`` (BERT / RoBERTa / XLM-R encoders), ``decoder.py`` (Llama / Mistral / Qwen2 /
Qwen3, differences as config fields). Model code never imports the engine, scheduler or batch builder.
"""

from __future__ import annotations

import importlib

# architecture (config.json "architectures"[0]) -> "module:Class"
REGISTRY: dict[str, str] = {
    **{
        a: "lab.models.bert:BertModel"
        for a in (
            "BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForPreTraining",
            "RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification",
            "XLMRobertaModel", "XLMRobertaForMaskedLM", "XLMRobertaForSequenceClassification",
        )
    },
    **{
        a: "lab.models.decoder:DecoderModel"
        for a in (
            "LlamaModel", "LlamaForCausalLM", "MistralModel", "MistralForCausalLM",
            "Qwen2Model", "Qwen2ForCausalLM", "Qwen3Model", "Qwen3ForCausalLM",
            "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification", "LlamaForSequenceClassification",
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


def layers_to_run(num_layers: int | None, total: int) -> int:
    """How many of a model's ``total`` layers a forward runs: ``num_layers`` (0 = the embedding output only), or
    all of them for ``None``. The Engine's ``layer`` knob resolves negative values before they get here."""
    if num_layers is None:
        return total
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 0 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers!r} but this model has {total} layers; valid: 0..{total} or None")
    return num_layers
