"""Model folders -> our modules: config and weights reading, sentence-transformers defaults, tokenizer.

Reads a local Hugging Face / sentence-transformers folder (the weight files transformers reads:
``model.safetensors`` or the shards ``model.safetensors.index.json`` names, else ``pytorch_model.bin`` with a
warning; a ``.gguf`` file through ``lab.models.gguf``), maps the architecture to our implementation through the
registry in ``lab.models`` and collects what sentence-transformers would use as defaults (pooling mode, Normalize
module, max_seq_length, prompts). No ``trust_remote_code``.

Before any model is built, ``read_folder`` checks the config against itself (sizes, epsilons, RoPE settings) and
against the checkpoint's tensor index (names and shapes, from the safetensors headers): a config that asks for
layers the checkpoint lacks, or for an embedding of another size, fails naming the key and the file instead of
allocating a model the weights cannot fill. ``read_state_dict`` refuses non-finite weights, naming the tensor.

    >>> spec = read_folder(path)                 # what is there, no weights loaded
    >>> loaded = load(spec, dtype=torch.float32, device=torch.device("cpu"))
"""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lab.models.checks import check_against_checkpoint, check_config, check_finite, is_int
from lab.models.hub import local_name

# sentence-transformers' pooling config keys -> our pooling names, in the order it checks them
_ST_POOLING_KEYS = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_lasttoken", "lasttoken"),
    ("pooling_mode_weightedmean_tokens", "weightedmean"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
)


@dataclass(frozen=True)
class MultiVectorSpec:
    """A sentence-transformers ``MultiVectorEncoder`` (ColBERT) folder: Transformer, optional token-level Dense,
    MultiVectorMask, optional Normalize, and the Transformer's per-task lengths and query expansion
    (``lab.outputs.multivector`` applies them)."""

    dense: Path | None  # the Dense module's folder (a projection of every token), None without one
    activation: str  # the Dense's activation: "identity" or "tanh"
    normalize: bool  # a token-level Normalize module follows
    skiplist_words: tuple[str, ...]  # MultiVectorMask: tokens left out of scoring ...
    skiplist_tasks: tuple[str, ...]  # ... for these tasks ("document" also covers no task)
    query_expansion: dict | None  # {"strategy": "fixed" | "min", "attend": bool, "token": str | None, "length": int}
    query_length: int | None
    document_length: int | None
    # PyLate's query / document prefixes (e.g. "[unused0]"): made single special tokens if the vocabulary has them
    prefix_tokens: tuple[str, ...] = ()


@dataclass
class ModelSpec:
    """What a model folder holds and what sentence-transformers would default to."""

    path: Path
    config: dict
    weights: list[Path]
    weight_format: str  # "safetensors" | "bin" | "gguf"
    pooling: str | None = None
    include_prompt: bool | None = None  # the Pooling config's (True when it does not say); None: no Pooling config
    normalize: bool = False
    max_seq_length: int | None = None
    # prompt name -> text: sentence-transformers' (>= 5) defaults, empty ``query`` and ``document`` prompts, updated
    # with config_sentence_transformers.json's ``prompts``
    prompts: dict[str, str] = field(default_factory=lambda: {"query": "", "document": ""})
    default_prompt_name: str | None = None  # config_sentence_transformers.json's: the prompt used when none is named
    gguf_file: Path | None = None
    # a sentence-transformers SparseEncoder's SpladePooling: {"pooling_strategy": max|sum, "activation_function":
    # relu|log1p_relu}; None without one
    splade: dict[str, str] | None = None
    multi_vector: MultiVectorSpec | None = None  # a sentence-transformers MultiVectorEncoder (ColBERT) folder
    # the checkpoint's tensors without their data: name -> (shape, file), from the safetensors headers (a pickle
    # file's: memory-mapped)
    tensors: dict[str, tuple[tuple[int, ...], Path]] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        """The folder's name (its parent's when the folder has a generic name such as ``model``)."""
        return local_name(self.path)

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else _ARCH_BY_TYPE.get(self.config.get("model_type", ""), "")


_ARCH_BY_TYPE = {"bert": "BertModel", "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"}


def read_folder(path: str | os.PathLike) -> ModelSpec:
    """Inspect a model folder (or a ``.gguf`` file); raises ``FileNotFoundError`` naming what is missing."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist; pass a local model folder (offline mode)")
    if p.is_file() and p.suffix == ".gguf":
        from lab.models.gguf import cache_gguf_as_safetensors

        return read_folder(cache_gguf_as_safetensors(p))
    if not p.is_dir():
        raise FileNotFoundError(f"{str(p)!r} is neither a model folder nor a .gguf file")
    cfg_file = p / "config.json"
    if not cfg_file.exists():
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs:
            return read_folder(ggufs[0])
        raise FileNotFoundError(
            f"no config.json in {str(p)!r}: a transformers model folder needs config.json next to its weights"
        )
    config = _read_json(cfg_file, dict, "a JSON object of model settings")
    check_config(config, cfg_file)
    weights, fmt = _find_weights(p)
    spec = ModelSpec(path=p, config=config, weights=weights, weight_format=fmt)
    if fmt == "safetensors":
        spec.tensors = read_tensor_index(weights)
    else:  # memory-mapped: the tensors' data is not read here
        spec.tensors = {k: (tuple(v.shape), f) for f in weights for k, v in load_pickle_weights(f, mmap=True).items()}
    from lab.models import REGISTRY

    if spec.architecture in REGISTRY:
        check_against_checkpoint(config, spec.tensors, _describe_files(spec), cfg_file)
    _read_sentence_transformers(p, spec)
    return spec


LLM2VEC_CONFIG = "llm2vec_config.json"
# llm2vec's pooling_mode -> our knob defaults. ``eos_token``: llm2vec appends the EOS token and pools it (our
# ``lasttoken`` appends EOS on decoders by default); ``last_token``: the last token as it is, nothing appended;
# ``bos_token``: the BOS token's state, the first token when the tokenizer adds one (our ``cls``).
LLM2VEC_POOLING = {
    "mean": {"pooling": "mean"},
    "weighted_mean": {"pooling": "weightedmean"},
    "eos_token": {"pooling": "eos_token"},  # the last token after llm2vec's EOS text (lab.engine.framing)
    "last_token": {"pooling": "lasttoken"},  # llm2vec appends no EOS: the llm2vec rule's append_eos default
    "bos_token": {"pooling": "cls"},
}


def read_llm2vec_config(folder: str | os.PathLike) -> dict:
    """Knob defaults from ``folder``'s ``llm2vec_config.json`` (what ``LLM2Vec.save`` writes and
    ``LLM2Vec.from_pretrained`` reads): ``pooling_mode`` -> ``pooling`` (``LLM2VEC_POOLING``), ``max_length`` and
    ``doc_max_length`` -> the knobs of those names, ``skip_instruction`` -> ``include_instruction`` (its negation).
    ``{}`` without the file. A value of the wrong type or an unknown pooling mode raises ``ValueError`` naming the
    file and the key; unknown keys are left out, with a warning."""
    f = Path(folder).expanduser() / LLM2VEC_CONFIG
    if not f.is_file():
        return {}
    cfg = _read_json(f, dict, "a JSON object of LLM2Vec settings (pooling_mode, max_length, skip_instruction)")
    out: dict = {}
    mode = cfg.get("pooling_mode")
    if mode is not None:
        if mode not in LLM2VEC_POOLING:
            raise ValueError(f"{f}: pooling_mode {mode!r} is not one llm2vec defines; valid: "
                             f"{', '.join(LLM2VEC_POOLING)}")
        out.update(LLM2VEC_POOLING[mode])
    for key in ("max_length", "doc_max_length"):
        length = cfg.get(key)
        if length is not None:
            if not is_int(length) or length < 1:
                raise ValueError(f"{f}: {key} must be a positive integer (tokens), got {length!r}")
            out[key] = int(length)
    skip = cfg.get("skip_instruction")
    if skip is not None:
        if not isinstance(skip, bool):
            raise ValueError(f"{f}: skip_instruction must be true or false, got {skip!r}")
        out["include_instruction"] = not skip
    unknown = sorted(set(cfg) - {"pooling_mode", "max_length", "doc_max_length", "skip_instruction"})
    if unknown:
        warnings.warn(f"{f}: key(s) {', '.join(unknown)} are not llm2vec settings this engine reads (pooling_mode, "
                      "max_length, doc_max_length, skip_instruction); they are ignored", stacklevel=3)
    return out


MODEL_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json")


def has_model_weights(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a model's own weights (the files ``read_folder`` reads, or a ``.gguf``)."""
    p = Path(folder).expanduser()
    return any((p / f).is_file() for f in MODEL_WEIGHT_FILES) or any(p.glob("*.gguf"))


# weight files of a model folder that are not the model's weights (read by other loaders)
_OTHER_WEIGHT_FILES = ("adapter_model.safetensors",)


def _find_weights(p: Path) -> tuple[list[Path], str]:
    """The weight files transformers reads: ``model.safetensors``, or the shards ``model.safetensors.index.json``
    names; without either, ``pytorch_model.bin`` (or the shards of ``pytorch_model.bin.index.json``). Other
    ``*.safetensors`` files beside them are left unread, with a warning that lists them."""
    index = p / "model.safetensors.index.json"
    if index.exists():
        files, fmt = _shards(p, index), "safetensors"
    elif (p / "model.safetensors").is_file():
        files, fmt = [p / "model.safetensors"], "safetensors"
    elif (p / "pytorch_model.bin.index.json").exists():
        files, fmt = _shards(p, p / "pytorch_model.bin.index.json"), "bin"
    elif (p / "pytorch_model.bin").is_file():
        files, fmt = [p / "pytorch_model.bin"], "bin"
    else:
        others = sorted(f.name for f in p.glob("*.safetensors") if f.name not in _OTHER_WEIGHT_FILES)
        hint = (f"; found {', '.join(others)}, which transformers does not read either: rename the model's weights "
                "to model.safetensors" if others else "")
        raise FileNotFoundError(f"no weights in {str(p)!r}: expected model.safetensors (or a sharded index "
                                f"model.safetensors.index.json, or pytorch_model.bin){hint}")
    read = {f.resolve() for f in files}
    unread = sorted(f.name for f in p.glob("*.safetensors")
                    if f.resolve() not in read and f.name not in _OTHER_WEIGHT_FILES)
    if unread:
        warnings.warn(f"{p}: weight file(s) {', '.join(unread)} are not read: the model's weights are "
                      f"{', '.join(f.name for f in files)}, as transformers reads them (model.safetensors, or the "
                      "shards model.safetensors.index.json names); remove or move stale weight files", stacklevel=3)
    return files, fmt


def _shards(p: Path, index: Path) -> list[Path]:
    """The files a shard index's ``weight_map`` names, each checked to be inside the folder."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index} is not a valid shard index (a JSON object with a 'weight_map' of tensor name "
                         f"-> file): {type(e).__name__}: {e}") from None
    for f in files:
        # the name as written must stay inside the folder; the file itself may be a symbolic link, as the Hugging
        # Face hub cache links each snapshot's files to ../../blobs (the same rule as an unsharded model.safetensors)
        if not isinstance(f, str) or os.path.isabs(f) or os.path.normpath(f).split(os.sep)[0] == os.pardir:
            raise ValueError(f"{index} names the shard {f!r}, which is not a file inside {p}; refusing to read "
                             "weights from outside the model folder")
        if not (p / f).is_file():
            raise FileNotFoundError(f"{index} names the shard {f!r}, which is not in {p}; the download is incomplete")
        target = (p / f).resolve()
        if not any(target.is_relative_to(root) for root in _link_roots(p)):
            raise ValueError(f"{index} names the shard {f!r}, a link out of the folder (to {target}); refusing to "
                             f"read weights from outside {p}: put the file itself in the folder")
    return [p / f for f in files]


def _link_roots(p: Path) -> list[Path]:
    """Where the files of folder ``p`` may resolve to: ``p`` itself, and for a Hugging Face hub cache snapshot
    (``<repo>/snapshots/<commit>/``, its files links to ``../../blobs``) that repository's ``blobs`` folder."""
    folder = p.resolve()
    roots = [folder]
    if folder.parent.name == "snapshots":
        roots.append((folder.parent.parent / "blobs").resolve())
    return roots


def read_tensor_index(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Every tensor's name -> ``(shape, file)`` from the safetensors headers, no data read; a truncated or corrupt
    file raises ``ValueError`` naming it."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, tuple[tuple[int, ...], Path]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[key] = (tuple(st.get_slice(key).get_shape()), f)
        except (SafetensorError, OSError) as e:
            raise _bad_safetensors(f, e) from None
    return out


def _bad_safetensors(f: Path, e: Exception) -> ValueError:
    size = f.stat().st_size if f.exists() else 0
    return ValueError(f"{f} is not a valid safetensors file ({size} bytes; {e}): it is truncated or corrupt. "
                      "Download or save it again")


def _describe_files(spec: ModelSpec) -> str:
    if len(spec.weights) == 1:
        return str(spec.weights[0])
    index = "model.safetensors.index.json" if spec.weight_format == "safetensors" else "pytorch_model.bin.index.json"
    return f"the {len(spec.weights)} shards of {spec.path / index}"


def _read_json(path: Path, kind: type, what: str):
    """``path``'s JSON, which must be ``kind``; a clear error naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); it should hold {what}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path} should hold {what}, got a {type(value).__name__}")  # noqa: TRY004 (bad file)
    return value


def _read_sentence_transformers(p: Path, spec: ModelSpec) -> None:
    """Fill pooling / normalize / max_seq_length / prompts from sentence-transformers files when present."""
    modules = p / "modules.json"
    if modules.exists():
        entries = _read_json(modules, list, "a JSON list of sentence-transformers modules")
        for m in entries:
            if not isinstance(m, dict):
                raise ValueError(  # noqa: TRY004 (a bad file, not a bad argument)
                    f"{modules}: every entry must be an object with 'type' and 'path', got {m!r}")
            kind = m.get("type", "")
            if kind.endswith("SpladePooling"):
                spec.splade = _read_splade(_module_folder(p, m) / "config.json")
                spec.include_prompt = True  # SpladePooling pools every attended token, a prompt's too
            elif kind.endswith("Pooling"):
                cfg_path = _module_folder(p, m) / "config.json"
                if cfg_path.exists():
                    pcfg = _read_json(cfg_path, dict, "a JSON object (the Pooling config)")
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
        scfg = _read_json(sbert, dict, "a JSON object (the Transformer module's config)")
        length = scfg.get("max_seq_length")
        if length is not None and (not is_int(length) or length < 1):
            raise ValueError(f"{sbert}: max_seq_length must be a positive integer (tokens) or null, got {length!r}")
        spec.max_seq_length = length
    st_cfg = p / "config_sentence_transformers.json"
    if st_cfg.exists():
        cfg = _read_json(st_cfg, dict, "a JSON object (sentence-transformers' model config)")
        prompts = cfg.get("prompts") or {}
        if not isinstance(prompts, dict) or not all(
                isinstance(k, str) and isinstance(v, str | None) for k, v in prompts.items()):
            raise ValueError(f"{st_cfg}: 'prompts' must map prompt names to prompt strings, got {prompts!r}")
        spec.prompts.update({k: v or "" for k, v in prompts.items()})
        if cfg.get("model_type") == "ColBERT" and spec.multi_vector is None:  # a PyLate (<= 3) ColBERT folder
            spec.multi_vector = _read_pylate(p, cfg, spec)
        spec.default_prompt_name = cfg.get("default_prompt_name")
        if spec.default_prompt_name is not None and spec.default_prompt_name not in spec.prompts:
            raise ValueError(f"{st_cfg}: default_prompt_name {spec.default_prompt_name!r} is not one of its prompts "
                             f"{sorted(spec.prompts)}; add it to 'prompts' or remove default_prompt_name")


_SPLADE_CHOICES = {"pooling_strategy": ("max", "sum"), "activation_function": ("relu", "log1p_relu")}


def _read_splade(cfg_path: Path) -> dict[str, str]:
    """A SpladePooling config with sentence-transformers' defaults (max, relu) filled in; unknown values refused."""
    cfg = _read_json(cfg_path, dict, "a JSON object (the SpladePooling config)") if cfg_path.exists() else {}
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
        raise ValueError(f"{p / 'modules.json'}: module path {entry.get('path')!r} is outside the model folder; "
                         "refusing to read from there")
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
        cfg = _read_json(cfg_path, dict, "a JSON object (the module's config)") \
            if reads_config and cfg_path.exists() else {}
        if kind.endswith("Dense"):
            if dense is not None:
                raise ValueError(f"{p / 'modules.json'}: more than one Dense in a multi-vector model is not supported")
            if cfg.get("module_input_name", "token_embeddings") != "token_embeddings":
                raise ValueError(f"{cfg_path}: a Dense over {cfg.get('module_input_name')!r} in a multi-vector model "
                                 "is not supported; only a projection of every token (token_embeddings)")
            name = cfg.get("activation_function", "torch.nn.modules.linear.Identity")
            if name not in _MV_ACTIVATIONS:
                raise ValueError(f"{cfg_path}: activation_function {name!r} is not supported; valid: "
                                 f"{', '.join(_MV_ACTIVATIONS)}")
            dense, activation = folder, _MV_ACTIVATIONS[name]
        elif kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("MultiVectorMask"):
            mask = cfg
        elif not kind.endswith("Transformer"):
            raise ValueError(f"{p / 'modules.json'}: module {kind!r} in a multi-vector model is not supported "
                             "(Transformer, Dense, MultiVectorMask and Normalize are)")
    return dense, activation, normalize, mask


def _read_multi_vector(p: Path, entries: list) -> MultiVectorSpec:
    """A MultiVectorEncoder folder's modules (``MultiVectorSpec``); what we cannot reproduce is refused by name."""
    dense, activation, normalize, mask = _multi_vector_modules(p, entries)
    if mask.get("keep_only_token_ids"):
        raise ValueError(f"{p}: MultiVectorMask keep_only_token_ids (image-patch documents) is not supported")
    tcfg = _read_json(p / "sentence_bert_config.json", dict, "a JSON object (the Transformer module's config)") \
        if (p / "sentence_bert_config.json").exists() else {}
    qe = _query_expansion(tcfg.get("query_expansion"), p / "sentence_bert_config.json")
    tasks = mask.get("skiplist_tasks") or ["document"]
    return MultiVectorSpec(
        dense=dense, activation=activation, normalize=normalize,
        skiplist_words=tuple(mask.get("skiplist_words") or ()),
        skiplist_tasks=(tasks,) if isinstance(tasks, str) else tuple(tasks),
        query_expansion=qe, query_length=tcfg.get("query_length"), document_length=tcfg.get("document_length"))


def _query_expansion(qe, where: Path) -> dict | None:
    """A checked ``query_expansion`` with sentence-transformers' defaults (``attend`` False, ``token`` None)."""
    if qe is not None:
        if (not isinstance(qe, dict) or set(qe) - _QUERY_EXPANSION_KEYS or qe.get("strategy") not in ("fixed", "min")
                or not isinstance(qe.get("length"), int) or qe["length"] < 1):
            raise ValueError(f"{where}: query_expansion {qe!r} is not valid: expected "
                             "{'strategy': 'fixed' | 'min', 'attend': bool, 'token': str | None, 'length': int >= 1}")
        qe = {"strategy": qe["strategy"], "attend": bool(qe.get("attend", False)), "token": qe.get("token"),
              "length": qe["length"]}
    return qe


def _read_pylate(p: Path, cfg: dict, spec: ModelSpec) -> MultiVectorSpec:
    """A PyLate (<= 3) ColBERT folder, read as sentence-transformers' ``MultiVectorEncoder`` reads it: the top-level
    ``query_prefix`` / ``document_prefix`` start the ``query`` / ``document`` prompts (and become single special
    tokens when the vocabulary has them); ``query_length`` is the expansion length (32 when absent) unless
    ``do_query_expansion`` is false; ``attend_to_expansion_tokens`` is ``attend``; the skiplist is the config's or
    ``string.punctuation``; a token-level Normalize follows the Dense."""
    import string

    where = p / "config_sentence_transformers.json"
    entries = _read_json(p / "modules.json", list, "a JSON list of sentence-transformers modules") \
        if (p / "modules.json").exists() else []
    dense, activation, _, _ = _multi_vector_modules(p, entries)
    prefixes = {}
    for key, name in (("query_prefix", "query"), ("document_prefix", "document")):
        if key in cfg:
            prefixes[name] = cfg[key] or ""
            spec.prompts[name] = prefixes[name] + ((cfg.get("prompts") or {}).get(name) or "").removeprefix(
                prefixes[name])
    lengths = {k: cfg[k] for k in ("query_length", "document_length") if cfg.get(k) is not None}
    if "query_expansion" in cfg:
        qe = _query_expansion(cfg["query_expansion"], where)
    elif cfg.get("do_query_expansion") is False:
        qe = None
    else:
        attend = cfg.get("attend_to_expansion_tokens", cfg.get("attend_to_mask_tokens"))
        qe = _query_expansion({"strategy": "fixed", "attend": bool(attend),
                               "length": lengths.pop("query_length", None) or 32}, where)
    skip = cfg.get("skiplist_words")
    return MultiVectorSpec(
        dense=dense, activation=activation, normalize=True,
        skiplist_words=tuple(string.punctuation if skip is None else skip), skiplist_tasks=("document",),
        query_expansion=qe, query_length=lengths.get("query_length"), document_length=lengths.get("document_length"),
        prefix_tokens=tuple(v for v in prefixes.values() if v))


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


def _read_multi_vector_dense(folder: Path) -> dict[str, torch.Tensor]:
    """The Dense module's ``linear.weight`` (and ``linear.bias``) as the model's ``colbert_linear`` head."""
    st, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    if st.exists():
        sd = _load_safetensors(st)
    elif pt.exists():
        sd = load_pickle_weights(pt)
    else:
        raise FileNotFoundError(f"no weights in {folder}: expected model.safetensors (the Dense module's linear)")
    if "linear.weight" not in sd:
        raise ValueError(f"{folder}: expected the tensor 'linear.weight', found {sorted(sd)[:4]}")
    return {f"colbert_linear.{k.removeprefix('linear.')}": v for k, v in sd.items() if k.startswith("linear.")}


# bge-m3's per-token heads, saved beside the weights by FlagEmbedding as torch state dicts of one Linear each
M3_HEAD_FILES = ("sparse_linear", "colbert_linear")


class Checkpoint(dict):
    """A state dict that also knows the file each tensor came from (``files``), so errors can name it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.files: dict[str, Path] = {}

    def add(self, tensors: dict[str, torch.Tensor], file: Path) -> None:
        self.update(tensors)
        self.files.update(dict.fromkeys(tensors, file))


def read_state_dict(spec: ModelSpec) -> Checkpoint:
    """All weights of the folder on CPU, in their stored dtype; bge-m3's ``sparse_linear.pt`` /
    ``colbert_linear.pt`` beside them (through ``torch.load(weights_only=True)``) under those prefixes. Every
    floating tensor is checked to be finite (one pass each): a NaN / Inf raises ``ValueError`` naming the tensor
    and its file."""
    sd = Checkpoint()
    if spec.weight_format == "safetensors":
        for f in spec.weights:
            sd.add(_load_safetensors(f), f)
    else:
        warnings.warn(
            f"{spec.path}: loading pytorch_model.bin (pickle); convert the folder to safetensors for safe, fast loads",
            stacklevel=3,
        )
        for f in spec.weights:
            sd.add(load_pickle_weights(f), f)
    for name in M3_HEAD_FILES:
        f = spec.path / f"{name}.pt"
        if f.exists():
            head = load_pickle_weights(f, what="a state dict of tensors (a Linear's weight and bias)")
            sd.add({f"{name}.{k}": v for k, v in head.items()}, f)
    if spec.multi_vector is not None and spec.multi_vector.dense is not None:
        sd.add(_read_multi_vector_dense(spec.multi_vector.dense), spec.multi_vector.dense)
    for key, t in sd.items():
        check_finite(t, f"tensor {key!r} of {sd.files[key]}")
    return sd


def _load_safetensors(f: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(f))
    except (SafetensorError, OSError) as e:
        raise _bad_safetensors(f, e) from None


_CONVERT_HINT = ("convert it once, only if you trust its source: load it with transformers "
                 "(AutoModel.from_pretrained(folder)) and save it with save_pretrained(out, safe_serialization=True), "
                 "or torch.load(file, weights_only=False) and safetensors.torch.save_file(state_dict, "
                 "'model.safetensors'); then load the folder with model.safetensors")


def load_pickle_weights(f: Path, what: str = "a state dict of tensors", mmap: bool = False, *,
                        data: bytes | None = None, convert: str = _CONVERT_HINT) -> dict[str, torch.Tensor]:
    """A pickle (``torch.save``) weights file through torch's safe loader (``weights_only=True``): tensors and
    plain containers only. A file that needs anything else is refused for safety, and one torch cannot read at all
    is named as corrupt, each with a ``ValueError`` naming the file (``convert``: how to turn it into safetensors).
    ``mmap``: map the tensors' data rather than read it (a file of the older, non-zip format is read); ``data``: the
    file's bytes, already read by the caller."""
    source = f if data is None else io.BytesIO(data)
    try:
        try:
            sd = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap and data is None)
        except RuntimeError:
            if not mmap or data is not None:
                raise
            sd = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only load failed" in str(e).lower():
            first = str(e).strip().splitlines()[-1][:200]
            raise ValueError(f"{f} is refused for safety: it is a pickle file that holds more than tensors "
                             f"({first}), and unpickling it could run arbitrary code. Prefill-lab reads pickle "
                             f"weights only through torch's weights_only loader; {convert}") from None
        raise _bad_pickle(f, e) from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise _bad_pickle(f, e) from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ValueError(f"{f} should hold {what}, got {type(sd).__name__}")
    return sd


def _bad_pickle(f: Path, e: Exception) -> ValueError:
    return ValueError(f"{f} is not a readable PyTorch weights file ({type(e).__name__}: {str(e)[:200]}): it is "
                      "truncated or corrupt. Download or save it again, preferably as safetensors")


_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "sentencepiece.bpe.model",
                    "spiece.model")


def _check_tokenizer_files(p: Path) -> None:
    """The tokenizer file transformers reads, checked so a broken one fails naming it: ``tokenizer.json`` a JSON
    object; without it, the vocabulary / SentencePiece files present not empty."""
    tok = p / "tokenizer.json"
    if tok.is_file():
        with open(tok, "rb") as f:
            start = f.read(4096).lstrip()
        if not start.startswith(b"{"):  # not an object: parsed in full only then, for the message
            try:
                _read_json(tok, dict, "a JSON object (the fast tokenizer: its model, vocabulary and rules)")
            except ValueError as e:
                raise ValueError(f"{e}; download or save the tokenizer again (tokenizer.save_pretrained)") from None
        return
    for name in _TOKENIZER_FILES[1:]:
        f = p / name
        if f.is_file():
            with open(f, "rb") as fh:
                if not fh.read(4096).strip():
                    raise ValueError(f"{f} is empty ({f.stat().st_size} bytes): the tokenizer has no vocabulary; "
                                     "download or save the tokenizer again (tokenizer.save_pretrained)")


def load_tokenizer(spec: ModelSpec):
    from transformers import AutoTokenizer

    if not any((spec.path / f).exists() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {str(spec.path)!r}: expected one of {', '.join(_TOKENIZER_FILES)} next to config.json"
        )
    _check_tokenizer_files(spec.path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(spec.path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"no usable tokenizer in {str(spec.path)!r} (tokenizer.json or vocab files): {e}"
        ) from e
    if spec.multi_vector is not None and spec.multi_vector.prefix_tokens:
        register_prefix_tokens(tokenizer, spec.multi_vector.prefix_tokens)
    return tokenizer


class KeyTracker(dict):
    """A state dict that records which keys a loader read (``[]`` / ``get``), so ``warn_unexpected`` can name the
    tensors it left unread, and that knows their files (``in_file``)."""

    def __init__(self, sd: dict, source: dict | None = None):
        super().__init__(sd)
        self.used: set[str] = set()
        # tensor -> file of the ``Checkpoint`` these tensors came from (``source``, else ``sd``), for ``in_file``
        self.files: dict[str, Path] = getattr(sd if source is None else source, "files", {})

    def __getitem__(self, key):
        self.used.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.used.add(key)
        return super().get(key, default)


def warn_unexpected(sd: KeyTracker, family: str, ignore: tuple[str, ...] = ()) -> None:
    """Warn, as transformers reports UNEXPECTED keys, about checkpoint tensors the loader never read (``ignore``:
    prefixes the family documents as unused, such as BERT's pooler)."""
    extra = sorted(k for k in sd if k not in sd.used and not k.startswith(ignore))
    if extra:
        shown = ", ".join(extra[:6]) + (f" ... ({len(extra)} in all)" if len(extra) > 6 else "")
        warnings.warn(f"{family} checkpoint has {len(extra)} weight(s) this config.json does not use: {shown}. "
                      "transformers reports these as UNEXPECTED; check that the config matches the weights "
                      "(num_hidden_layers, architecture)", stacklevel=4)

