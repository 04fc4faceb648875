"""LLM2Vec checkpoints as llm2vec 0.2.3 reads them: which folders are an LLM2Vec layout, where its settings come
from, the name its chat template is chosen by, and its cut of long documents.

An Engine call maps onto llm2vec's ``LLM2Vec.from_pretrained(base_model_name_or_path, peft_model_name_or_path)``:
the model folder as given is llm2vec's base (a published ``-mntp`` folder, or a plain base model), the last adapter
is its ``peft_model_name_or_path``. llm2vec then

- reads ``llm2vec_config.json`` from ``peft_model_name_or_path`` when one is given, else from the base folder, and
  from nowhere else; what the file does not set (or everything, without the file) takes the class defaults
  (``DEFAULTS``: mean pooling, ``max_length`` 512, ``doc_max_length`` 400, ``skip_instruction``), and
  ``enable_bidirectional`` defaults to True;
- chooses its chat template by ``config._name_or_path`` of the model it loaded (``template_name``): for a local
  folder, the ``_name_or_path`` its ``config.json`` holds (the ``-mntp`` folder's in the published usage), never
  ``adapter_config.json``'s ``base_model_name_or_path``; for a hub id, that ``base_model_name_or_path`` when the
  repository holds an adapter (transformers loads it under its base's name), else the id;
- cuts a document whose token count (counted as the tokenizer truncates at ``max_length``, special tokens left
  out) exceeds ``doc_max_length`` to ``int(words x doc_max_length / tokens)`` whitespace-separated words, again
  until it fits (``cut_document``); the instruction is never cut.

An LLM2Vec layout is recognised by any of: a folder with ``llm2vec_config.json`` (llm2vec's ``save``, and
``lab.adapt``'s adapters), a ``config.json`` naming llm2vec's encoder classes (``*EncoderModel`` architectures or an
``auto_map`` to them, as the published ``-mntp`` folders do), or an adapter config whose ``auto_mapping`` names
llm2vec's library; an adapter llm2vec trained comes with one of these (its ``llm2vec_config.json``, or the ``-mntp``
folder it names as its base). Only decoders are LLM2Vec models. ``Layout`` records what recognised it, for the notice
the Engine shows and for ``eng.resolved``'s sources.

    >>> lay = layout(model_folder, adapter_folders, auto=1, decoder=True)
    >>> lay.recognized, lay.why, lay.defaults["pooling"]          # True, 'llm2vec_config.json in ...', ('mean', ...)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from lab._warn import warn
from lab.adapt.adapters import ADAPTER_CONFIG
from lab.engine import framing
from lab.models.folder import LLM2VEC_CONFIG, read_llm2vec_config

# llm2vec 0.2.3's LLM2Vec class defaults, as knob values (``lab.models.folder.read_llm2vec_config`` maps the file)
DEFAULTS = {"pooling": "mean", "max_length": 512, "doc_max_length": 400, "include_instruction": False}
DEFAULT_SOURCE = "llm2vec default"


class Llm2VecNotice(UserWarning):
    """Shown once when an Engine loads an LLM2Vec layout: what recognised it and the llm2vec settings it brings
    (``warnings.filterwarnings("ignore", category=Llm2VecNotice)`` hides it)."""


@dataclass(frozen=True)
class Layout:
    """What llm2vec would make of a model folder and its adapters.

    ``recognized``: an LLM2Vec layout (module docstring), ``why`` says by what; ``defaults``: knob -> (value,
    source) for ``pooling``, ``max_length``, ``doc_max_length``, ``include_instruction`` (from ``llm2vec_config.json``
    in ``config_folder`` or llm2vec's class defaults; empty when not recognised); ``name``: the name llm2vec chooses
    its chat template by (``None`` when it has none)."""

    recognized: bool
    why: str = ""
    config_folder: Path | None = None
    defaults: dict[str, tuple[object, str]] = field(default_factory=dict)
    name: str | None = None


def layout(
    model: str | os.PathLike,
    adapters: list[str],
    *,
    auto: int,
    base: str | os.PathLike,
    repo_id: str | None,
    decoder: bool,
) -> Layout:
    """The LLM2Vec reading of an engine's folders: ``model``, the folder as given (llm2vec's base argument);
    ``adapters``, the adapter folders in merge order, of which the first ``auto`` came with ``model`` (an adapter-only
    folder and the ``-mntp`` folders it names: they stand for llm2vec's base); ``base``, the folder whose weights
    load; ``repo_id``: the hub id the model was named by (``None`` for a local path), which decides the name
    llm2vec chooses its template by (``template_name``)."""
    model, base = Path(model), Path(base)
    folders = [model, *map(Path, adapters), base]
    why = _recognized_by(folders) if decoder else ""
    config_folder = Path(adapters[-1]) if len(adapters) > auto else model
    name = template_name([model, *map(Path, adapters[:auto]), base], repo_id)
    if not why:
        return Layout(False, name=name)
    found = read_llm2vec_config(config_folder)
    source = f"{LLM2VEC_CONFIG} in {config_folder}"
    defaults = {k: (found[k], source) if k in found else (v, DEFAULT_SOURCE) for k, v in DEFAULTS.items()}
    return Layout(True, why, config_folder, defaults, name)


def _recognized_by(folders: list[Path]) -> str:
    """Why these folders are an LLM2Vec layout ('' when they are not)."""
    for f in folders:
        if (f / LLM2VEC_CONFIG).is_file():
            return f"{LLM2VEC_CONFIG} in {f}"
    for f in folders:
        config = _json(f / "config.json")
        archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
        targets = [t for t in (config.get("auto_map") or {}).values() if isinstance(t, str)]
        if any(a.endswith("EncoderModel") for a in archs) or any(t.endswith("EncoderModel") for t in targets):
            return f"{f / 'config.json'} names llm2vec's encoder model"
        mapping = _json(f / ADAPTER_CONFIG).get("auto_mapping") or {}
        if isinstance(mapping, dict) and str(mapping.get("parent_library", "")).startswith("llm2vec"):
            return f"{f / ADAPTER_CONFIG} names llm2vec's model class"
    return ""


def template_name(candidates: list[Path], repo_id: str | None) -> str | None:
    """``config._name_or_path`` of the model llm2vec loads, the name its chat template is chosen by. A hub id:
    transformers 4.44 loads a repository that holds an adapter under the adapter's ``base_model_name_or_path`` and
    any other under the id. A local folder: llm2vec takes the ``_name_or_path`` its ``config.json`` holds (``""``
    without one) from the first of ``candidates`` with a ``config.json`` (the folder given, the ``-mntp`` folder an
    adapter names, the base)."""
    if repo_id:
        base = _json(candidates[0] / ADAPTER_CONFIG).get("base_model_name_or_path")
        return base if isinstance(base, str) and base else repo_id
    for f in candidates:
        config = _json(f / "config.json")
        if config:
            name = config.get("_name_or_path")
            return name if isinstance(name, str) else ""
    return None


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cut_document(text: str, count, doc_max_length: int) -> str:
    """llm2vec's cut of a long document: while the text's token count (``count(text)``: tokens without special
    tokens, truncated at ``max_length`` as llm2vec counts them) exceeds ``doc_max_length``, keep the first
    ``int(words x doc_max_length / tokens)`` whitespace-separated words (joined by single spaces). A text within the
    limit comes back unchanged."""
    n = count(text)
    while n > doc_max_length:
        words = text.split()
        text = " ".join(words[: int(len(words) * (doc_max_length / n))])
        n = count(text)
    return text


def cut_documents(tokenizer, texts: list[str], max_length: int, doc_max_length: int) -> list[str]:
    """``cut_document`` over ``texts`` with ``tokenizer``'s counts (special tokens left out, truncated at
    ``max_length``): one batched call finds the long texts, only those are tokenized again."""
    kw = {
        "add_special_tokens": False,
        "truncation": True,
        "max_length": max_length,
        "return_attention_mask": False,
        "verbose": False,
    }

    def count(text: str) -> int:
        return len(tokenizer(text, **kw)["input_ids"])

    lengths = tokenizer(list(texts), **kw)["input_ids"]
    return [
        cut_document(t, count, doc_max_length) if len(ids) > doc_max_length else t for t, ids in zip(texts, lengths)
    ]


def notice(model_name: str, lay: Layout, resolved) -> None:
    """One line when the folders are an LLM2Vec layout (``Llm2VecNotice``): what recognised it and the llm2vec
    settings it brought to the knobs left unset (``resolved``: the engine's ``Resolved``)."""
    if not lay.recognized:
        return
    r = resolved
    brought = [
        f"{k}={r[k]!r}"
        for k in ("pooling", "max_length", "doc_max_length", "include_instruction", "instruction_pooling")
        if r.sources.get(k, "").startswith("llm2vec")
    ]
    if r.sources.get("causal", "").startswith("llm2vec"):
        brought.insert(0, "bidirectional=True")
    chat = f", the chat template of {lay.name}" if framing.chat_template([lay.name] if lay.name else []) else ""
    warn(
        Llm2VecNotice(
            f"{model_name}: an LLM2Vec layout ({lay.why}); llm2vec's settings for the knobs left unset: "
            f"{', '.join(brought) or 'none'}{chat} (eng.resolved.sources says where each value came from)"
        ),
    )
