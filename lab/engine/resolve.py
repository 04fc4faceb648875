"""Where each knob left at ``None`` gets its value: an LLM2Vec layout's settings, the sentence-transformers
configs, or the model kind's default, each value with its source (``Engine.resolved.sources``).

    >>> d = defaults(knobs, layout, spec, decoder=True, default_causal=True)
    >>> d["pooling"]                                     # ('mean', 'llm2vec_config.json in /models/x-mntp')
"""

from __future__ import annotations

import warnings

from lab.engine import framing, llm2vec
from lab.engine.knobs import Knobs, Resolved

MODEL_DEFAULT = "model default"
USER = "user"
TEMPLATE = "template (its words are never the text)"
ST_POOLING = "sentence-transformers Pooling"


def defaults(k: Knobs, lay: llm2vec.Layout, spec, *, decoder: bool, default_causal: bool) -> dict[str, tuple]:
    """knob -> (value, source) for the knobs whose default the model decides, under the knobs ``k`` (their adapters
    give ``lay``, llm2vec's reading of the folders; ``spec``: the model folder's ``ModelSpec``)."""
    d = lay.defaults
    if spec.pooling is not None:
        pooling = (spec.pooling, ST_POOLING)
    else:
        pooling = ("lasttoken" if decoder else "mean", MODEL_DEFAULT)
    if k.template is not None:  # a template's words are never the text: not pooled unless the knob says so
        include = (False, TEMPLATE)
    elif "include_instruction" in d:
        include = d["include_instruction"]
    else:
        include = ((bool(spec.include_prompt), ST_POOLING) if spec.include_prompt is not None
                   else (False, MODEL_DEFAULT))
    max_length = ((spec.max_seq_length, "sentence-transformers config") if spec.max_seq_length
                  else (None, MODEL_DEFAULT))
    return {
        "pooling": d.get("pooling", pooling),
        "include_instruction": include,
        "max_length": d.get("max_length", max_length),
        "doc_max_length": d.get("doc_max_length", (None, MODEL_DEFAULT)),
        "causal": (False, llm2vec.DEFAULT_SOURCE) if lay.recognized and decoder else (default_causal, MODEL_DEFAULT),
        "instruction_pooling": ("llm2vec", llm2vec.DEFAULT_SOURCE) if lay.recognized else ("exact", MODEL_DEFAULT),
        "normalize": (True, "sentence-transformers Normalize") if spec.normalize else (False, MODEL_DEFAULT),
    }


def sources(k: Knobs, found: dict[str, tuple]) -> dict[str, str]:
    """Where each value of ``found`` (``defaults``) that runs comes from: ``"user"`` for a knob that is set."""
    return {name: USER if getattr(k, "bidirectional" if name == "causal" else name) is not None else src
            for name, (_, src) in found.items()}


def notice_llm2vec(model_name: str, lay: llm2vec.Layout, r: Resolved) -> None:
    """One line when the folders are an LLM2Vec layout (``llm2vec.Llm2VecNotice``): what recognised it and the
    llm2vec settings it brought to the knobs left unset."""
    if not lay.recognized:
        return
    brought = [f"{k}={r[k]!r}" for k in ("pooling", "max_length", "doc_max_length", "include_instruction",
                                        "instruction_pooling") if r.sources.get(k, "").startswith("llm2vec")]
    if r.sources.get("causal", "").startswith("llm2vec"):
        brought.insert(0, "bidirectional=True")
    chat = f", the chat template of {lay.name}" if framing.chat_template([lay.name] if lay.name else []) else ""
    warnings.warn(llm2vec.Llm2VecNotice(
        f"{model_name}: an LLM2Vec layout ({lay.why}); llm2vec's settings for the knobs left unset: "
        f"{', '.join(brought) or 'none'}{chat} (eng.resolved.sources says where each value came from)"), stacklevel=4)
