"""The scope of an adapter's keys. peft saves them in either of two: the bare model's
(``base_model.model.layers.N...``: saved from ``AutoModel``, what llm2vec and ``lab.adapt`` write) and a head
class's (``base_model.model.model.layers.N...``: saved from a ``*ForCausalLM``). ``bare_key``,
``bare_module_name`` and ``bare_config`` name keys, modules and ``rank_pattern`` / ``alpha_pattern`` entries in the
bare model's scope; ``is_bare_scope`` tells a folder's scope; ``rescope`` rewrites a folder to the bare model's
scope. Both scopes merge alike in the Engine.

    >>> rescope("old/mntp", "runs/mntp-bare")
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from lab.adapt.adapters import ADAPTER_CONFIG, PEFT_PREFIX, WEIGHT_FILES, adapter_keys, read_config, read_weights

# The prefix a *ForCausalLM / *ForMaskedLM puts before its bare model's modules (the class's ``base_model_prefix``).
# An adapter saved from the head class has keys ``base_model.model.model.layers.N...``; one saved from the bare model
# (``AutoModel``: what llm2vec wraps and writes) ``base_model.model.layers.N...``. The bare models of the families we
# run have no top-level module of these names.
HEAD_PREFIXES = ("model.", "transformer.", "bert.", "roberta.", "xlm-roberta.")


def bare_module_name(module: str) -> str:
    """A module name in the bare model's scope: ``model.layers.0.self_attn.q_proj`` -> ``layers.0.self_attn.q_proj``
    (names already in that scope come back unchanged)."""
    for prefix in HEAD_PREFIXES:
        if module.startswith(prefix) and len(module) > len(prefix):
            return module[len(prefix) :]
    return module


def bare_key(key: str) -> str:
    """A PEFT state-dict key in the bare model's scope (``base_model.model.`` kept, the head class's prefix gone)."""
    if not key.startswith(PEFT_PREFIX):
        return key
    return PEFT_PREFIX + bare_module_name(key[len(PEFT_PREFIX) :])


def bare_config(config: dict) -> dict:
    """``adapter_config.json`` with ``rank_pattern`` / ``alpha_pattern`` keys in the bare model's scope (peft matches
    them against module names, so a full name saved from the head class would match nothing there)."""
    out = dict(config)
    for key in ("rank_pattern", "alpha_pattern"):
        if isinstance(config.get(key), dict):
            out[key] = {bare_module_name(k): v for k, v in config[key].items()}
    return out


def is_bare_scope(path: str | os.PathLike) -> bool:
    """Whether an adapter folder's keys are in the bare model's scope (as llm2vec and ``PeftModel.from_pretrained(
    AutoModel.from_pretrained(base), folder)`` expect) rather than a head class's."""
    return all(bare_key(k) == k for k in adapter_keys(path))


def rescope(src: str | os.PathLike, dst: str | os.PathLike | None = None) -> Path:
    """Rewrite an adapter folder's keys to the bare model's scope: ``base_model.model.model.layers.N...`` (saved
    from a ``*ForCausalLM``) -> ``base_model.model.layers.N...``, the scope llm2vec and peft over ``AutoModel``
    load (with the other scope peft only warns "Found missing adapter keys" and leaves every ``lora_B`` at zero).
    The tensors are written unchanged (same values and dtypes, same file format); ``rank_pattern`` /
    ``alpha_pattern`` keys follow. ``dst=None`` rewrites ``src`` in place; otherwise ``dst`` (which must not hold an
    adapter already) gets the rewritten adapter and copies of the folder's other files. Returns the folder written.
    Both scopes merge alike in the Engine.

        >>> rescope("runs/mntp", "runs/mntp-bare")       # a copy llm2vec / PeftModel over AutoModel load fully
    """
    import shutil

    s = Path(src).expanduser()
    config = read_config(s)
    sd, _ = read_weights(s)
    renamed = {bare_key(k): v for k, v in sd.items()}
    if len(renamed) != len(sd):
        raise ValueError(
            f"{str(s)!r} holds keys in both scopes for one module (e.g. both "
            "base_model.model.model.layers... and base_model.model.layers...); it cannot be rescoped"
        )
    out = s if dst is None else Path(dst).expanduser()
    if out != s:
        if (out / ADAPTER_CONFIG).exists():
            raise FileExistsError(f"{str(out)!r} already holds an adapter; pass an empty or new folder as dst")
        out.mkdir(parents=True, exist_ok=True)
        for f in s.iterdir():
            if f.is_file() and f.name not in (ADAPTER_CONFIG, *WEIGHT_FILES):
                shutil.copy2(f, out / f.name)
    weights = next(s / n for n in WEIGHT_FILES if (s / n).is_file())
    tmp = out / (weights.name + ".tmp")
    if weights.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in renamed.items()}, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(renamed, tmp)
    cfg_tmp = out / (ADAPTER_CONFIG + ".tmp")
    cfg_tmp.write_text(json.dumps(bare_config(config), indent=2, sort_keys=True))
    os.replace(tmp, out / weights.name)
    os.replace(cfg_tmp, out / ADAPTER_CONFIG)
    return out
