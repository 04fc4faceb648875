"""sentence-transformers and PyLate configs -> a ``ModelSpec``'s defaults, as sentence-transformers reads them:
``modules.json`` (Pooling, Normalize, SpladePooling, and a ``MultiVectorEncoder``'s Dense / MultiVectorMask),
``sentence_bert_config.json`` (``max_seq_length``, per-task lengths, query expansion) and
``config_sentence_transformers.json`` (prompts, ``default_prompt_name``, a PyLate ColBERT folder's prefixes and
expansion). What cannot be reproduced (``mean_sqrt_len_tokens`` pooling, a second Dense, a module path outside the
folder) is refused with a ``ValueError`` naming the file. ``read_json`` reads one JSON file of an expected type.

    >>> read_sentence_transformers(Path("all-MiniLM-L6-v2"), spec)   # fills spec.pooling, .normalize, .prompts ...
    >>> spec.pooling, spec.include_prompt, spec.normalize
    ('mean', True, True)
    >>> register_prefix_tokens(tokenizer, ("[unused0]", "[unused1]"))   # PyLate's prefixes, one token each
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lab.models.checks import is_int
from lab.models.spec import ModelSpec, MultiVectorSpec

# sentence-transformers' pooling config keys -> our pooling names, in the order it checks them
_ST_POOLING_KEYS = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_lasttoken", "lasttoken"),
    ("pooling_mode_weightedmean_tokens", "weightedmean"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
)


def read_json(path: Path, kind: type, what: str):
    """``path``'s JSON, which must be ``kind``; a clear error naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); it should hold {what}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path} should hold {what}, got a {type(value).__name__}")  # noqa: TRY004 (bad file)
    return value


def read_sentence_transformers(p: Path, spec: ModelSpec) -> None:
    """Fill pooling / normalize / max_seq_length / prompts from sentence-transformers files when present."""
    modules = p / "modules.json"
    if modules.exists():
        entries = read_json(modules, list, "a JSON list of sentence-transformers modules")
        for m in entries:
            if not isinstance(m, dict):
                raise ValueError(  # noqa: TRY004 (a bad file, not a bad argument)
                    f"{modules}: every entry must be an object with 'type' and 'path', got {m!r}"
                )
            kind = m.get("type", "")
            if kind.endswith("SpladePooling"):
                spec.splade = _read_splade(_module_folder(p, m) / "config.json")
                spec.include_prompt = True  # SpladePooling pools every attended token, a prompt's too
            elif kind.endswith("Pooling"):
                cfg_path = _module_folder(p, m) / "config.json"
                if cfg_path.exists():
                    pcfg = read_json(cfg_path, dict, "a JSON object (the Pooling config)")
                    mode = pcfg.get("pooling_mode")
                    if mode is None:
                        mode = next((name for key, name in _ST_POOLING_KEYS if pcfg.get(key)), None)
                    if pcfg.get("pooling_mode_mean_sqrt_len_tokens"):
                        raise ValueError(f"{cfg_path}: pooling 'mean_sqrt_len_tokens' is not supported")
                    spec.pooling = {"mean_tokens": "mean", "max_tokens": "max", "cls_token": "cls"}.get(mode, mode)
                    spec.include_prompt = bool(pcfg.get("include_prompt", True))
            elif kind.endswith("Normalize"):
                spec.normalize = True
        if any(str(m.get("type", "")).endswith("MultiVectorMask") for m in entries):
            spec.multi_vector = _read_multi_vector(p, entries)
    sbert = p / "sentence_bert_config.json"
    if sbert.exists():
        scfg = read_json(sbert, dict, "a JSON object (the Transformer module's config)")
        length = scfg.get("max_seq_length")
        if length is not None and (not is_int(length) or length < 1):
            raise ValueError(f"{sbert}: max_seq_length must be a positive integer (tokens) or null, got {length!r}")
        spec.max_seq_length = length
    st_cfg = p / "config_sentence_transformers.json"
    if st_cfg.exists():
        cfg = read_json(st_cfg, dict, "a JSON object (sentence-transformers' model config)")
        prompts = cfg.get("prompts") or {}
        if not isinstance(prompts, dict) or not all(
            isinstance(k, str) and isinstance(v, str | None) for k, v in prompts.items()
        ):
            raise ValueError(f"{st_cfg}: 'prompts' must map prompt names to prompt strings, got {prompts!r}")
        spec.prompts.update({k: v or "" for k, v in prompts.items()})
        if cfg.get("model_type") == "ColBERT" and spec.multi_vector is None:  # a PyLate (<= 3) ColBERT folder
            spec.multi_vector = _read_pylate(p, cfg, spec)
        spec.default_prompt_name = cfg.get("default_prompt_name")
        if spec.default_prompt_name is not None and spec.default_prompt_name not in spec.prompts:
            raise ValueError(
                f"{st_cfg}: default_prompt_name {spec.default_prompt_name!r} is not one of its prompts "
                f"{sorted(spec.prompts)}; add it to 'prompts' or remove default_prompt_name"
            )


_SPLADE_CHOICES = {"pooling_strategy": ("max", "sum"), "activation_function": ("relu", "log1p_relu")}


def _read_splade(cfg_path: Path) -> dict[str, str]:
    """A SpladePooling config with sentence-transformers' defaults (max, relu) filled in; unknown values refused."""
    cfg = read_json(cfg_path, dict, "a JSON object (the SpladePooling config)") if cfg_path.exists() else {}
    out = {}
    for key, choices in _SPLADE_CHOICES.items():
        out[key] = cfg.get(key) or choices[0]
        if out[key] not in choices:
            raise ValueError(f"{cfg_path}: {key}={out[key]!r} is not supported; valid: {', '.join(choices)}")
    return out


def _module_folder(p: Path, entry: dict) -> Path:
    """The folder of a ``modules.json`` entry; ``ValueError`` when its path leads outside the model folder (an
    absolute path, or ``..`` above it). Checked on the path as written: a module folder that is a symlink (a folder
    assembled from links) is followed."""
    rel = str(entry.get("path", ""))
    norm = os.path.normpath(rel) if rel else "."
    if os.path.isabs(rel) or norm == ".." or norm.startswith(("../", "..\\")):
        raise ValueError(
            f"{p / 'modules.json'}: module path {entry.get('path')!r} is outside the model folder; "
            "refusing to read from there"
        )
    return p / rel


_MV_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}
_QUERY_EXPANSION_KEYS = {"strategy", "attend", "token", "length"}


def _multi_vector_modules(p: Path, entries: list) -> tuple[Path | None, str, bool, dict]:
    """The Dense folder and activation, whether Normalize follows, and MultiVectorMask's config."""
    dense, activation, normalize, mask = None, "identity", False, {}
    for m in entries:
        kind, folder = str(m.get("type", "")), _module_folder(p, m)
        cfg_path = folder / "config.json"
        reads_config = kind.endswith(("Dense", "MultiVectorMask"))  # the Transformer's config.json is read already
        cfg = (
            read_json(cfg_path, dict, "a JSON object (the module's config)")
            if reads_config and cfg_path.exists()
            else {}
        )
        if kind.endswith("Dense"):
            if dense is not None:
                raise ValueError(f"{p / 'modules.json'}: more than one Dense in a multi-vector model is not supported")
            if cfg.get("module_input_name", "token_embeddings") != "token_embeddings":
                raise ValueError(
                    f"{cfg_path}: a Dense over {cfg.get('module_input_name')!r} in a multi-vector model "
                    "is not supported; only a projection of every token (token_embeddings)"
                )
            name = cfg.get("activation_function", "torch.nn.modules.linear.Identity")
            if name not in _MV_ACTIVATIONS:
                raise ValueError(
                    f"{cfg_path}: activation_function {name!r} is not supported; valid: {', '.join(_MV_ACTIVATIONS)}"
                )
            dense, activation = folder, _MV_ACTIVATIONS[name]
        elif kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("MultiVectorMask"):
            mask = cfg
        elif not kind.endswith("Transformer"):
            raise ValueError(
                f"{p / 'modules.json'}: module {kind!r} in a multi-vector model is not supported "
                "(Transformer, Dense, MultiVectorMask and Normalize are)"
            )
    return dense, activation, normalize, mask


def _read_multi_vector(p: Path, entries: list) -> MultiVectorSpec:
    """A MultiVectorEncoder folder's modules (``MultiVectorSpec``); what we cannot reproduce is refused by name."""
    dense, activation, normalize, mask = _multi_vector_modules(p, entries)
    if mask.get("keep_only_token_ids"):
        raise ValueError(f"{p}: MultiVectorMask keep_only_token_ids (image-patch documents) is not supported")
    tcfg = (
        read_json(p / "sentence_bert_config.json", dict, "a JSON object (the Transformer module's config)")
        if (p / "sentence_bert_config.json").exists()
        else {}
    )
    qe = _query_expansion(tcfg.get("query_expansion"), p / "sentence_bert_config.json")
    tasks = mask.get("skiplist_tasks") or ["document"]
    return MultiVectorSpec(
        dense=dense,
        activation=activation,
        normalize=normalize,
        skiplist_words=tuple(mask.get("skiplist_words") or ()),
        skiplist_tasks=(tasks,) if isinstance(tasks, str) else tuple(tasks),
        query_expansion=qe,
        query_length=tcfg.get("query_length"),
        document_length=tcfg.get("document_length"),
    )


def _query_expansion(qe, where: Path) -> dict | None:
    """A checked ``query_expansion`` with sentence-transformers' defaults (``attend`` False, ``token`` None)."""
    if qe is not None:
        if (
            not isinstance(qe, dict)
            or set(qe) - _QUERY_EXPANSION_KEYS
            or qe.get("strategy") not in ("fixed", "min")
            or not isinstance(qe.get("length"), int)
            or qe["length"] < 1
        ):
            raise ValueError(
                f"{where}: query_expansion {qe!r} is not valid: expected "
                "{'strategy': 'fixed' | 'min', 'attend': bool, 'token': str | None, 'length': int >= 1}"
            )
        qe = {
            "strategy": qe["strategy"],
            "attend": bool(qe.get("attend", False)),
            "token": qe.get("token"),
            "length": qe["length"],
        }
    return qe


def _read_pylate(p: Path, cfg: dict, spec: ModelSpec) -> MultiVectorSpec:
    """A PyLate (<= 3) ColBERT folder, read as sentence-transformers' ``MultiVectorEncoder`` reads it: the top-level
    ``query_prefix`` / ``document_prefix`` start the ``query`` / ``document`` prompts (and become single special
    tokens when the vocabulary has them); ``query_length`` is the expansion length (32 when absent) unless
    ``do_query_expansion`` is false; ``attend_to_expansion_tokens`` is ``attend``; the skiplist is the config's or
    ``string.punctuation``; a token-level Normalize follows the Dense."""
    import string

    where = p / "config_sentence_transformers.json"
    entries = (
        read_json(p / "modules.json", list, "a JSON list of sentence-transformers modules")
        if (p / "modules.json").exists()
        else []
    )
    dense, activation, _, _ = _multi_vector_modules(p, entries)
    prefixes = {}
    for key, name in (("query_prefix", "query"), ("document_prefix", "document")):
        if key in cfg:
            prefixes[name] = cfg[key] or ""
            spec.prompts[name] = prefixes[name] + ((cfg.get("prompts") or {}).get(name) or "").removeprefix(
                prefixes[name]
            )
    lengths = {k: cfg[k] for k in ("query_length", "document_length") if cfg.get(k) is not None}
    if "query_expansion" in cfg:
        qe = _query_expansion(cfg["query_expansion"], where)
    elif cfg.get("do_query_expansion") is False:
        qe = None
    else:
        attend = cfg.get("attend_to_expansion_tokens", cfg.get("attend_to_mask_tokens"))
        qe = _query_expansion(
            {"strategy": "fixed", "attend": bool(attend), "length": lengths.pop("query_length", None) or 32}, where
        )
    skip = cfg.get("skiplist_words")
    return MultiVectorSpec(
        dense=dense,
        activation=activation,
        normalize=True,
        skiplist_words=tuple(string.punctuation if skip is None else skip),
        skiplist_tasks=("document",),
        query_expansion=qe,
        query_length=lengths.get("query_length"),
        document_length=lengths.get("document_length"),
        prefix_tokens=tuple(v for v in prefixes.values() if v),
    )


def register_prefix_tokens(tokenizer, prefixes: tuple[str, ...]) -> None:
    """PyLate's prefixes as single, case-kept special tokens when the vocabulary (or its added tokens) holds them
    but text would split them (``[unused0]`` -> ``[``, ``unused``, ...), so prepending them as text gives the
    tokens they were trained with, as sentence-transformers does; prefixes the tokenizer does not know stay text."""
    from tokenizers import AddedToken

    known = set(tokenizer.get_vocab()) | set(getattr(tokenizer, "added_tokens_encoder", None) or {})
    new = []
    for value in prefixes:
        if not value.split():
            continue
        for prefix in (value, value.split(None, 1)[0]):
            if prefix in known:
                if tokenizer.tokenize(prefix) != [prefix]:
                    new.append(AddedToken(prefix, normalized=False, special=True))
                break
    if new:
        tokenizer.add_special_tokens({"additional_special_tokens": new})
