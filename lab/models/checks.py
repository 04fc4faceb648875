"""Checks of a model folder's values before anything is built or merged, each failing with a ``ValueError`` that
names the file and the key or tensor and says what was expected: config values that cannot be right
(``check_config``), a config that asks for more than the checkpoint holds (``check_against_checkpoint``), a tensor of
another shape than the config implies (``check_shape``) and non-finite weights (``check_finite``).

    >>> check_config(config, folder / "config.json")
    >>> check_against_checkpoint(config, tensors, "model.safetensors", folder / "config.json")
    >>> check_finite(weight, "tensor 'encoder.layer.0.output.dense.weight' of model.safetensors")
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

# config keys that are sizes: a positive integer where present (None: the family's default)
_POSITIVE_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)
# the most elements one weight matrix may have: 2**33 (8.6e9), 32 GiB in float32 (the engine's master copy). The
# largest matrices of released models, embedding tables of 256k tokens x 16k-18k columns, hold 4-5e9 elements, so
# every real config passes with room; a config past it is a typo (intermediate_size=10**9 asks 1.5 TB beside a
# 384-wide model), and is refused from its sizes alone, before any memory is asked for
MAX_MATRIX_ELEMENTS = 1 << 33
# config keys that are epsilons added under a square root: a finite number >= 0
_EPSILONS = ("layer_norm_eps", "rms_norm_eps")


def is_int(value) -> bool:
    """An ``int`` that is not a ``bool`` (JSON ``true`` is not a size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_config(config: dict, path: Path) -> None:
    """The sizes every packed architecture needs, present and consistent, and the values that cannot be right
    (epsilons below 0, ``rope_theta`` or a RoPE scaling ``factor`` not above 0, sizes whose products no memory
    holds) refused naming the key: checked before any model is built, not at the first embed."""
    if config.get("model_type") is None and not config.get("architectures"):
        raise ValueError(f"{path} names neither model_type nor architectures; it is not a transformers config")
    for key in _POSITIVE_SIZES:
        if config.get(key) is not None and (not is_int(config[key]) or config[key] < 1):
            raise ValueError(f"{path}: {key} must be a positive integer, got {config[key]!r}")
    if config.get("type_vocab_size") is not None and (
        not is_int(config["type_vocab_size"]) or config["type_vocab_size"] < 0
    ):
        raise ValueError(f"{path}: type_vocab_size must be an integer >= 0, got {config['type_vocab_size']!r}")
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if hidden and heads and config.get("head_dim") is None and hidden % heads:
        raise ValueError(
            f"{path}: hidden_size={hidden} is not divisible by num_attention_heads={heads} (and no "
            "head_dim is given); the weights cannot be split into heads"
        )
    kv = config.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ValueError(
            f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}; "
            "grouped-query attention shares each key/value head among a whole number of query heads"
        )
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    matrices = (
        ("vocab_size", "hidden_size"),
        ("max_position_embeddings", "hidden_size"),
        ("intermediate_size", "hidden_size"),
        ("type_vocab_size", "hidden_size"),
    )
    for a, b in matrices:
        if config.get(a) and config.get(b) and config[a] * config[b] > MAX_MATRIX_ELEMENTS:
            raise ValueError(
                f"{path}: {a}={config[a]} and {b}={config[b]} ask for a weight matrix of "
                f"{config[a] * config[b]:.3g} elements, {_float32_size(config[a] * config[b])} in "
                f"float32 (the limit is {MAX_MATRIX_ELEMENTS:.3g} elements, "
                f"{_float32_size(MAX_MATRIX_ELEMENTS)}); the sizes cannot be right: fix {a} (or {b}) "
                "in config.json"
            )
    if heads and head_dim and hidden and heads * head_dim * hidden > MAX_MATRIX_ELEMENTS:
        n = heads * head_dim * hidden
        raise ValueError(
            f"{path}: num_attention_heads={heads} x head_dim={head_dim} x hidden_size={hidden} asks "
            f"for a query projection of {n:.3g} elements, {_float32_size(n)} in float32 (the limit is "
            f"{MAX_MATRIX_ELEMENTS:.3g} elements); the sizes cannot be right: fix them in config.json"
        )
    for key in _EPSILONS:
        if key in config and config[key] is not None and (not is_number(config[key]) or config[key] < 0):
            raise ValueError(
                f"{path}: {key} must be a finite number >= 0 (it is added to the variance under a "
                f"square root), got {config[key]!r}"
            )
    check_rope(config, path)


def _float32_size(elements: int) -> str:
    """The memory ``elements`` float32 values take, in GiB or TiB."""
    gib = elements * 4 / 2**30
    return f"{gib / 1024:.3g} TiB" if gib >= 1024 else f"{gib:.3g} GiB"


def check_rope(config: dict, path: Path) -> None:
    """``rope_theta`` (top level or inside ``rope_parameters`` / ``rope_scaling``) and a scaling ``factor``: finite
    numbers above 0 where present."""
    for section in ("rope_parameters", "rope_scaling"):
        params = config.get(section)
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"{path}: {section} must be a JSON object of RoPE settings or null, got {params!r}")
    places = [("rope_theta", config)] + [
        (f"{s}.{k}", config[s])
        for s in ("rope_parameters", "rope_scaling")
        if isinstance(config.get(s), dict)
        for k in ("rope_theta", "factor")
    ]
    for name, where in places:
        key = name.rsplit(".", 1)[-1]
        value = where.get(key)
        if value is not None and (not is_number(value) or value <= 0):
            kind = where.get("rope_type", where.get("type", "")) if where is not config else ""
            what = f" ({kind} scaling)" if kind else ""
            raise ValueError(f"{path}: {name}{what} must be a finite number above 0, got {value!r}")


# per-layer tensors of the packed families: BERT's encoder.layer.<i>. and the decoders' layers.<i>.
_LAYER_KEY = re.compile(r"(?:^|\.)layers?\.(\d+)\.")
# the word embedding of the packed families: (rows, columns) = (vocab_size, hidden_size)
_EMBEDDING_KEYS = ("embeddings.word_embeddings.weight", "embed_tokens.weight")


def check_against_checkpoint(
    config: dict, tensors: dict[str, tuple[tuple[int, ...], Path]], files: str, cfg_file: Path
) -> None:
    """Before a packed model is built: every layer ``num_hidden_layers`` asks for has weights among ``tensors``
    (name -> ``(shape, file)``; ``files`` names them in messages), the first missing one named, and the word
    embedding has the shape ``(vocab_size, hidden_size)``."""
    n = config.get("num_hidden_layers")
    if isinstance(n, int):
        present: dict[int, str] = {}  # layer -> the prefix its keys have before the index ("encoder.layer.")
        for key in tensors:
            m = _LAYER_KEY.search(key)
            if m is not None:
                present.setdefault(int(m[1]), key[: m.start(1)])
        missing = next((i for i in range(n) if i not in present), None)
        if missing is not None:
            example = f"{next(iter(present.values()), 'layers.')}{missing}."
            held = f"it holds layers 0-{max(present)}" if present else "it holds no per-layer weights at all"
            raise ValueError(
                f"{cfg_file}: num_hidden_layers={n}, but {files} has no weights of layer {missing} (no "
                f"'{example}*' tensors; {held}); set num_hidden_layers to the checkpoint's layer count "
                f"({len(present)}) or use the weights this config belongs to"
            )
    emb = next(((k, v) for k, v in tensors.items() if k.endswith(_EMBEDDING_KEYS)), None)
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    if emb is not None and isinstance(vocab, int) and isinstance(hidden, int):
        key, (shape, f) = emb
        if shape != (vocab, hidden):
            raise ValueError(
                f"{cfg_file}: vocab_size={vocab} and hidden_size={hidden} ask for a word embedding of "
                f"shape ({vocab}, {hidden}), but {f} holds '{key}' of shape {shape}; the config does not "
                "belong to these weights"
            )


def file_of(sd, key: str) -> Path | None:
    """The file tensor ``key`` came from, when ``sd`` has ``files`` (a ``lab.models.folder.Checkpoint``, or a
    ``KeyTracker`` over one); ``key`` may have lost a prefix (``bert.``, ``model.``) on the way."""
    files = getattr(sd, "files", None) or {}
    if key in files:
        return files[key]
    return next((f for k, f in files.items() if k.endswith("." + key)), None)


def in_file(sd, key: str) -> str:
    """`` in <file>`` for error messages about tensor ``key`` (empty when the file is not known)."""
    f = file_of(sd, key)
    return f" in {f}" if f is not None else ""


def check_finite(
    t: torch.Tensor, what: str, fix: str = "The weights are corrupt: download or save them again"
) -> None:
    """Raise ``ValueError`` when floating tensor ``t`` holds a NaN or an infinity, naming ``what`` and the first
    such element, and saying ``fix`` (one pass over ``t``)."""
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return
    bad = (~torch.isfinite(t)).nonzero()
    where = tuple(bad[0].tolist())
    value = t[where].item() if where else t.item()
    raise ValueError(
        f"{what} holds {len(bad)} non-finite value(s) (NaN / Inf; the first, {value}, at index {where}); "
        f"with it every embedding would be NaN. {fix}"
    )


def check_shape(sd, key: str, tensor: torch.Tensor, expected: tuple[int, ...], what: str = "") -> torch.Tensor:
    """``tensor`` (checkpoint tensor ``key``) when its shape is ``expected``, else a ``ValueError`` naming the
    tensor, its file and the shape config.json implies (``what``: which sizes give it)."""
    if tuple(tensor.shape) != tuple(expected):
        because = f" ({what})" if what else ""
        raise ValueError(
            f"checkpoint tensor {key!r}{in_file(sd, key)} has shape {tuple(tensor.shape)}, but "
            f"config.json implies {tuple(expected)}{because}; the config does not belong to these "
            "weights"
        )
    return tensor
