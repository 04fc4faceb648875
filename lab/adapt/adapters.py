"""PEFT LoRA adapter folders, read and checked for ``Engine(path, adapters=[...])`` and ``configure(adapters=...)``.

An adapter folder is what peft's ``save_pretrained`` writes: ``adapter_config.json`` and ``adapter_model.safetensors``
(or ``adapter_model.bin``). ``read_adapter`` reads one into a ``LoraAdapter``: one ``LoraModule`` per LoRA pair, the
``scale * B @ A`` a transformers ``nn.Linear`` weight gets, in float32, with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` under ``use_rslora``; ``r`` and ``lora_alpha`` per module from ``rank_pattern`` /
``alpha_pattern``, matched as peft matches them). ``lab.adapt.merge`` adds them to a model's weights;
``lab.adapt.key_scope`` tells and rewrites the scope of their keys (both scopes peft saves are read here).

A folder with ``llm2vec_config.json`` beside the adapter gives knob defaults as llm2vec reads them
(``lab.engine.llm2vec``). ``Engine(folder)`` on an adapter folder (alone, or LLM2Vec's ``-mntp`` layout:
``config.json`` + tokenizer + adapter, no weights) loads the base its ``adapter_config.json`` names
(``resolve_base``) with the adapter first.

Everything is read and checked before any weight changes, so a bad adapter raises and leaves the model as it was:
``adapter_config.json``'s values (types, ``r`` > 0, finite ``lora_alpha``) and the weights file (readable, every
tensor finite). Supported: plain LoRA (``bias="none"``). Refused with a clear error: other peft types (IA3, prompt
tuning, ...), DoRA, trained biases, ``lora_bias``, LoRA on embeddings or ``lm_head``, full weights
(``modules_to_save``).

    >>> ads = [read_adapter("runs/mntp"), read_adapter("runs/simcse")]
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lab._warn import warn
from lab.models.checks import check_finite
from lab.models.folder import has_model_weights, load_pickle_weights
from lab.models.hub import looks_like_hub_id, snapshot_of
from lab.models.hub import resolve as hub_resolve

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the wrapped model's module names

_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_GENERIC_NAMES = {"adapter", "adapters", "lora", "peft", "model", "final", "output", "outputs", "checkpoint"}
_UNSUPPORTED_FLAGS = (  # adapter_config.json keys whose non-default values change what a merge would be
    ("use_dora", "DoRA (use_dora=true): its magnitude vector rescales every merged column"),
    ("lora_bias", "a trained bias on lora_B (lora_bias=true)"),
    ("use_qalora", "QA-LoRA (use_qalora=true): its A sees pooled inputs"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens): it applies only after the invocation"),
    ("layer_replication", "layer_replication: it changes the model's layer stack"),
    ("target_parameters", "LoRA on nn.Parameters (target_parameters)"),
    ("trainable_token_indices", "trainable token embeddings (trainable_token_indices)"),
    ("arrow_config", "Arrow routing among LoRA experts (arrow_config)"),
    ("kasa_config", "KaSA (kasa_config): it also truncates the base weight's singular values"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
    ("monteclora_config", "MonteCLoRA (monteclora_config)"),
)
_MERGE_HINT = (
    "merge it with peft instead (PeftModel.from_pretrained(base, folder).merge_and_unload()."
    "save_pretrained(out)) and load the merged folder as the model"
)


@dataclass(frozen=True)
class LoraModule:
    """One LoRA pair: ``delta = scale * B @ A`` added to the transformers Linear named ``module``."""

    module: str  # peft's name of the module in the model it wrapped (rank_pattern matches this)
    A: torch.Tensor  # (r, in_features) float32
    B: torch.Tensor  # (out_features, r) float32
    scale: float


@dataclass
class LoraAdapter:
    """A LoRA adapter folder, read and checked (but not yet matched against a base model)."""

    path: Path
    config: dict
    digest: str  # sha256 of adapter_config.json and the weights file
    modules: list[LoraModule] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The folder's name (with its parent's for generic names such as ``adapter`` or ``checkpoint-500``)."""
        return adapter_name(self.path)

    @property
    def id(self) -> str:
        """``name-<first 10 hex digits of the content hash>``: two folders with one name still differ."""
        return f"{self.name}-{self.digest[:10]}"


def adapter_name(path: str | os.PathLike) -> str:
    """An adapter folder's name: its hub id for a hub cache snapshot, else the folder's name (with its parent's for
    generic names such as ``adapter`` or ``checkpoint-500``)."""
    snap = snapshot_of(path)
    if snap is not None:
        return snap[0]
    p = Path(path).expanduser()
    p = p.resolve() if p.exists() else p
    generic = p.name.lower() in _GENERIC_NAMES or p.name.lower().startswith("checkpoint-")
    return f"{p.parent.name}/{p.name}" if generic and p.parent.name else p.name


def is_adapter_folder(path: str | os.PathLike) -> bool:
    """A folder holding a PEFT adapter and no model weights of its own: ``adapter_config.json`` and no
    ``config.json``, or ``adapter_config.json`` beside a ``config.json`` and tokenizer but no weights (LLM2Vec's
    published ``-mntp`` layout)."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / ADAPTER_CONFIG).is_file() and not has_model_weights(p)


def split_adapter_model(model: str, adapters: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """``Engine(model=<adapter folder>)``: the base folder its ``adapter_config.json`` names
    (``base_model_name_or_path``, found by ``resolve_base``), with the adapter put first in ``adapters``. A base
    that is itself such a folder resolves in turn (an LLM2Vec ``-supervised`` adapter naming its ``-mntp`` folder).
    Other paths come back unchanged. Raises ``ValueError`` naming the base when it is not found locally."""
    seen: set[Path] = set()
    while is_adapter_folder(model):
        p = Path(model).expanduser().resolve()
        if p in seen:
            raise ValueError(
                f"{str(model)!r}: the adapters' base_model_name_or_path entries form a cycle "
                f"({', '.join(str(s) for s in seen)}); point one of them at the base model folder"
            )
        seen.add(p)
        base = resolve_base(model)
        _check_same_family(Path(model).expanduser(), base)
        model, adapters = str(base), (str(model), *adapters)
    return model, adapters


def resolve_base(adapter: str | os.PathLike) -> Path:
    """The local folder of an adapter's ``base_model_name_or_path``. An absolute (or ``~``) path is taken as it is;
    a relative one is looked up next to the adapter folder first (``../Llama-3-8B`` beside ``-mntp``), then from
    the current directory (where transformers and peft look); a hub id (``org/name``) that neither holds resolves
    through the Hugging Face cache (``lab.models.hub.resolve``: fetched when the hub can be reached, the cached
    snapshot offline). A base found nowhere raises ``ValueError`` naming it, where it was looked for and the fix."""
    p = Path(adapter).expanduser()
    config = read_config(p)
    base = config.get("base_model_name_or_path")
    fix = f"Engine(base_folder, adapters=[{str(adapter)!r}])"
    if not base or not isinstance(base, str):
        raise ValueError(
            f"{str(adapter)!r} holds only a LoRA adapter and its adapter_config.json names no base model "
            f"(base_model_name_or_path); pass the base model folder with the adapter: {fix}"
        )
    b = Path(base).expanduser()
    tried = [b] if b.is_absolute() else [p / b, Path.cwd() / b]
    for cand in tried:
        if cand.is_dir():
            return cand.resolve()
    why = ""
    if looks_like_hub_id(base):
        try:
            return hub_resolve(base, what=f"the base model of {str(adapter)!r}").folder
        except (FileNotFoundError, ValueError, PermissionError, ConnectionError) as e:
            why = f" As a hub id: {e}."
    raise ValueError(
        f"{str(adapter)!r} holds only a LoRA adapter; its base {base!r} (base_model_name_or_path in "
        f"{p / ADAPTER_CONFIG}) is not a local folder; looked in {', '.join(str(t) for t in tried)}.{why} Download "
        f"the base model and either set base_model_name_or_path to its folder (absolute, or relative to the adapter "
        f"folder) or pass its folder with the adapter: {fix}"
    )


def _check_same_family(adapter: Path, base: Path) -> None:
    """An adapter folder with its own ``config.json`` (LLM2Vec's ``-mntp`` layout) must describe its base's kind of
    model: a ``model_type`` that differs from the base's means the base is the wrong folder."""
    if not (adapter / "config.json").is_file() or not (base / "config.json").is_file():
        return
    try:
        mine = json.loads((adapter / "config.json").read_text()).get("model_type")
        theirs = json.loads((base / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError):
        return
    if mine and theirs and mine != theirs:
        raise ValueError(
            f"{str(adapter)!r} describes a {mine!r} model (config.json) but its base {str(base)!r} is a "
            f"{theirs!r} model; point base_model_name_or_path in {adapter / ADAPTER_CONFIG} at the base "
            "model it was trained on"
        )


def adapter_keys(path: str | os.PathLike) -> list[str]:
    """The tensor names of an adapter folder's weights file (safetensors: from its header); a truncated or corrupt
    file raises ``ValueError`` naming it."""
    p = Path(path).expanduser()
    st = p / WEIGHT_FILES[0]
    if st.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(st), framework="pt") as f:
                return list(f.keys())
        except SafetensorError as e:
            raise _bad_weights(st, st.stat().st_size, e) from None
    return list(read_weights(p)[0])


def read_adapter(path: str | os.PathLike) -> LoraAdapter:
    """Read and check one PEFT LoRA folder (weights in float32, on CPU). Raises ``FileNotFoundError`` /
    ``ValueError`` naming what is wrong and how to fix it."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(
            f"adapter folder {str(p)!r} does not exist; adapters are PEFT LoRA folders "
            "(peft's save_pretrained writes adapter_config.json + adapter_model.safetensors)"
        )
    config = read_config(p)
    where = f"adapter {str(p)!r}"
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(
            f"{where} is a {peft_type} adapter (peft_type); only LORA adapters are supported "
            "(merged as W += scale * B @ A)"
        )
    for key, what in _UNSUPPORTED_FLAGS:
        if config.get(key):
            raise ValueError(f"{where} uses {what}, which is not supported (plain LoRA only); {_MERGE_HINT}")
    bias = config.get("bias", "none")
    if bias not in ("none", None):
        raise ValueError(
            f"{where} trains biases (bias={bias!r}), which is not supported: only LoRA A/B weights are "
            f"merged (bias='none'); {_MERGE_HINT}"
        )
    if config.get("fan_in_fan_out"):
        # peft resets it to False for torch.nn.Linear targets (all of ours) and warns; do the same
        warn(
            f"{where}: fan_in_fan_out is set to True but the target modules are torch.nn.Linear; "
            "setting fan_in_fan_out to False (as peft does)",
        )
    sd, digest = read_weights(p)
    return LoraAdapter(path=p, config=config, digest=digest, modules=_lora_modules(sd, config, where))


def read_config(p: Path) -> dict:
    cfg = p / ADAPTER_CONFIG
    if not cfg.is_file():
        if (p / "config.json").exists():
            raise FileNotFoundError(
                f"{str(p)!r} is a model folder, not an adapter (no {ADAPTER_CONFIG}): pass it as the model, and as "
                "adapters the folders PEFT LoRA adapters were saved to (adapter_config.json + "
                "adapter_model.safetensors)"
            )
        raise FileNotFoundError(
            f"no {ADAPTER_CONFIG} in {str(p)!r}: adapters are PEFT LoRA folders (peft's "
            "save_pretrained writes adapter_config.json + adapter_model.safetensors)"
        )
    try:
        config = json.loads(cfg.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg} is not valid JSON: {e}") from e
    _check_config(config, cfg)
    return config


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _finite_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_config(config, cfg: Path) -> None:
    """The values a merge reads from ``adapter_config.json``, of the types peft writes: an object; ``r`` a positive
    integer; ``lora_alpha`` a finite number; ``rank_pattern`` / ``alpha_pattern`` objects mapping module patterns
    to such values; ``use_rslora`` true or false. ``ValueError`` naming the file and the key otherwise."""
    if not isinstance(config, dict):
        raise ValueError(  # noqa: TRY004 (a malformed file, not a wrong argument type)
            f"{cfg} should hold a JSON object of LoRA settings (peft's LoraConfig), got a {type(config).__name__}"
        )
    if "r" in config and not _positive_int(config["r"]):
        raise ValueError(f"{cfg}: r (the LoRA rank) must be a positive integer, got {config['r']!r}")
    if "lora_alpha" in config and not _finite_number(config["lora_alpha"]):
        raise ValueError(
            f"{cfg}: lora_alpha must be a finite number (the merge scales B @ A by lora_alpha / r), got "
            f"{config['lora_alpha']!r}"
        )
    for key, valid, what in (
        ("rank_pattern", _positive_int, "a positive integer rank"),
        ("alpha_pattern", _finite_number, "a finite lora_alpha"),
    ):
        pattern = config.get(key)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            raise ValueError(  # noqa: TRY004 (a malformed file, not a wrong argument type)
                f"{cfg}: {key} must be an object mapping module names / patterns to {what}, got {pattern!r}"
            )
        for name, value in pattern.items():
            if not valid(value):
                raise ValueError(f"{cfg}: {key}[{name!r}] must be {what}, got {value!r}")
            try:
                re.compile(_pattern_regex(name))
            except re.error as e:
                raise ValueError(
                    f"{cfg}: {key} has the key {name!r}, which is not a valid regular expression ({e}); "
                    "peft matches these keys as regular expressions against the end of module names: "
                    "fix the pattern, or escape its special characters (re.escape) to match a name "
                    "literally"
                ) from None
    if not isinstance(config.get("use_rslora", False), bool):
        raise ValueError(f"{cfg}: use_rslora must be true or false, got {config['use_rslora']!r}")  # noqa: TRY004


def _bad_weights(f: Path, size: int, e: Exception) -> ValueError:
    return ValueError(
        f"{f} is not a valid safetensors file ({size} bytes; {e}): it is truncated or corrupt. Save the adapter again"
    )


def read_weights(p: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The adapter's tensors and the content hash of its config and weights. A truncated or corrupt weights file,
    a pickle that holds more than tensors, or a non-finite tensor raises ``ValueError`` naming the file (and the
    tensor)."""
    h = hashlib.sha256((p / ADAPTER_CONFIG).read_bytes())
    for name in WEIGHT_FILES:
        f = p / name
        if f.is_file():
            data = f.read_bytes()
            h.update(data)
            if name.endswith(".safetensors"):
                from safetensors import SafetensorError
                from safetensors.torch import load

                try:
                    sd = load(data)
                except SafetensorError as e:
                    raise _bad_weights(f, len(data), e) from None
            else:
                sd = load_pickle_weights(
                    f,
                    "a state dict of LoRA tensors",
                    data=data,
                    convert=(
                        "save the adapter again with peft's save_pretrained(out, safe_serialization=True) "
                        "(adapter_model.safetensors)"
                    ),
                )
            for key, t in sd.items():
                check_finite(t, f"tensor {key!r} of {f}")
            return sd, h.hexdigest()
    raise FileNotFoundError(
        f"no adapter weights in {str(p)!r}: expected {' or '.join(WEIGHT_FILES)} next to {ADAPTER_CONFIG}"
    )


def _lora_modules(sd: dict[str, torch.Tensor], config: dict, where: str) -> list[LoraModule]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    extras = []
    for key, t in sd.items():
        m = _LORA_KEY.match(key)
        if m is None:
            extras.append(key)
            continue
        module = m["module"].removeprefix(PEFT_PREFIX)
        pairs.setdefault(module, {})[m["ab"]] = t
    if extras:  # name the most telling one (a LoRA-on-embedding key rather than the embedding peft saved with it)
        ranked = [_describe_extra(k) for k in sorted(extras, key=_natural)]
        described = min(ranked, key=lambda d: d[0])[1]
        raise ValueError(
            f"{where} holds {described}, which is not supported: only LoRA A/B weights of Linear "
            f"layers are merged; {_MERGE_HINT}"
        )
    if not pairs:
        raise ValueError(f"{where} holds no LoRA weights (no *.lora_A.weight / *.lora_B.weight keys)")
    r0, alpha0 = config.get("r", 8), config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    out = []
    for module, ab in sorted(pairs.items(), key=lambda kv: _natural(kv[0])):
        if set(ab) != {"A", "B"}:
            raise ValueError(
                f"{where}: module {module!r} has lora_{'A' if 'A' in ab else 'B'} but no "
                f"lora_{'B' if 'A' in ab else 'A'} weights; the adapter file is incomplete"
            )
        a, b = ab["A"].float(), ab["B"].float()
        r = rank_pattern.get(pattern_key(rank_pattern, module), r0)
        alpha = alpha_pattern.get(pattern_key(alpha_pattern, module), alpha0)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(
                f"{where}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"which do not fit rank r={r} from adapter_config.json (expected lora_A (r, in) and "
                "lora_B (out, r))"
            )
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        if not math.isfinite(scale):
            raise ValueError(
                f"{where}: module {module!r} has the scale lora_alpha / r = {alpha} / {r}, which is not "
                "finite; fix lora_alpha / r in adapter_config.json"
            )
        out.append(LoraModule(module=module, A=a, B=b, scale=scale))
    return out


def _pattern_regex(key: str) -> str:
    """The regular expression peft builds from a ``rank_pattern`` / ``alpha_pattern`` key."""
    return rf"(.*\.)?({key})$"


def pattern_key(pattern_keys, module: str) -> str:
    """peft's ``get_pattern_key``: the first pattern that matches the end of ``module`` at a dot boundary."""
    for key in pattern_keys:
        if re.match(_pattern_regex(key), module):
            return key
    return module


def _describe_extra(key: str) -> tuple[int, str]:
    """What a non-LoRA key in an adapter file means, most telling first (rank 0): LoRA on an embedding rather than
    the embedding weight peft saved along with it."""
    if "lora_embedding" in key:
        return 0, f"LoRA on an embedding layer ({key})"
    if "lora_magnitude_vector" in key:
        return 0, f"a DoRA magnitude vector ({key})"
    if ".lora_B" in key and key.endswith(".bias"):
        return 0, f"a lora_B bias ({key}, lora_bias=true)"
    if "trainable_tokens" in key:
        return 0, f"trainable token embeddings ({key})"
    if any(n in key for n in ("lm_head", "embed_tokens", "word_embeddings", "wte")):
        return 1, (
            f"weights of the embeddings / lm_head ({key}: peft saves them with LoRA on embeddings / lm_head "
            "or a resized vocabulary)"
        )
    if key.endswith(".bias"):
        return 2, f"a trained bias ({key})"
    return 3, f"full weights of a module ({key}: modules_to_save, or a saved embedding / lm_head)"


def _natural(name: str) -> list:
    """Sort key: ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
