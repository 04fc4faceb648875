"""Knob values (``Knobs``: one per knob of the registry, ``lab.engine.knob_registry.KNOBS``), the combinations
that conflict, and how the knobs resolve on a model (``resolve`` -> ``Resolved``: each value in force and where it
came from).

``None`` always means "the model's own default" (``resolve``: an LLM2Vec layout's, the model folder's
sentence-transformers configs', else the model kind's). Every knob but ``device`` and ``revision`` can change live
through ``Engine.configure`` without reloading weights (``dtype`` re-casts them).

    >>> k = Knobs(pooling="mean"); k = k.replace(bidirectional=True); k.validate()
    >>> r = resolve(k, facts, layout); r.pooling, r.causal, r.sources["pooling"]      # ('mean', False, 'user')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from lab._warn import warn
from lab.engine import knob_registry
from lab.engine.knob_registry import DTYPES
from lab.engine.llm2vec import DEFAULT_SOURCE as LLM2VEC_DEFAULT_SOURCE

if TYPE_CHECKING:
    from lab.engine.llm2vec import Layout
    from lab.models.spec import ModelSpec


class Knobs(Mapping):
    """The value of every registered knob (``lab.engine.knob_registry.KNOBS``): a frozen mapping with attribute
    access (``k.pooling``, ``k["pooling"]``). Knobs left out take their registered default; ``replace`` checks each
    changed value with its knob's ``check`` and the combinations with ``validate``."""

    __slots__ = ("_values",)

    def __init__(self, **values):
        registry = _known(values)
        object.__setattr__(self, "_values", {name: values.get(name, k.default) for name, k in registry.items()})

    def __getattr__(self, name: str):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        if name in knob_registry.KNOBS:  # registered after these values were made: its default
            return knob_registry.KNOBS[name].default
        raise AttributeError(f"no knob {name!r}; valid knobs: {', '.join(knob_registry.KNOBS)}")

    def __setattr__(self, name: str, value) -> None:
        raise dataclasses.FrozenInstanceError(f"knobs are frozen: use knobs.replace({name}=...)")

    def __getitem__(self, name: str):
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def __reduce__(self):
        return _knobs, (dict(self._values),)

    def __repr__(self) -> str:
        return "Knobs(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    def replace(self, **changes) -> Knobs:
        """These knobs with ``changes`` (each checked by its knob; numpy scalars from sweeps taken as Python ones),
        validated as a whole."""
        registry = _known(changes)
        values = {**self._values}
        for name, value in changes.items():
            values[name] = registry[name].check(plain_scalar(value))
        new = Knobs(**values)
        new.validate()
        return new

    def validate(self) -> None:
        """Raise ``ValueError`` / ``TypeError`` naming the bad knob, the valid values and the fix: each value by its
        knob's check, then the combinations that conflict."""
        for name, knob in knob_registry.KNOBS.items():
            knob.check(self._values.get(name, knob.default))
        if self.template is not None and self.long_inputs == "chunk":
            raise ValueError(
                "template conflicts with long_inputs='chunk': a window of a split input holds no whole "
                "copy of the template; use long_inputs='truncate' (or template=None)"
            )
        if self.chunked_prefill is not None and self.bidirectional:
            raise ValueError(
                "chunked_prefill conflicts with bidirectional=True: bidirectional attention needs the whole "
                "sequence at once (every token attends to later tokens). Use chunked_prefill=None, or "
                "bidirectional=False for causal chunked prefill"
            )


def _knobs(values: dict) -> Knobs:
    return Knobs(**values)


def _known(names) -> dict:
    """The registry (``lab.engine.knob_registry.KNOBS``, read at each call: a test may swap in a scratch copy), once
    every name in ``names`` is checked to be a knob of it."""
    registry = knob_registry.KNOBS
    unknown = sorted(set(names) - set(registry))
    if unknown:
        raise TypeError(f"unknown knob(s) {', '.join(unknown)}; valid knobs: {', '.join(registry)}")
    return registry


MODEL_DEFAULT = "model default"
USER = "user"
TEMPLATE = "template (its words are never the text)"
ST_POOLING = "sentence-transformers Pooling"


@dataclass(frozen=True)
class ModelFacts:
    """What a loaded model and its folder say, for the knobs whose value or range depends on the model
    (``resolve``, ``check_for_model``)."""

    hidden: int  # embedding size
    positions: int | None  # position embeddings (None: not stated)
    is_decoder: bool
    default_causal: bool  # the attention the model runs with when the knobs leave it alone
    num_layers: int | None
    specials: int  # special tokens the tokenizer adds to every input
    tokenizer_max: int | None  # the tokenizer's model_max_length (None: not stated, or a placeholder)
    spec: ModelSpec  # the sentence-transformers configs: pooling, include_prompt, max_seq_length, normalize

    @classmethod
    def of(cls, model, tokenizer, spec: ModelSpec) -> ModelFacts:
        """The facts of a loaded model (``lab.models.base.PackedModel`` or the transformers fallback), its tokenizer
        and its folder's ``spec``."""
        tok_max = getattr(tokenizer, "model_max_length", None)
        return cls(
            hidden=model.hidden_size,
            is_decoder=bool(model.is_decoder),
            num_layers=model.num_layers,
            positions=model.max_positions or spec.config.get("max_position_embeddings"),
            default_causal=bool(model.default_causal),
            spec=spec,
            specials=len(tokenizer("", add_special_tokens=True)["input_ids"]),
            tokenizer_max=tok_max if tok_max and tok_max < 1_000_000 else None,
        )


@dataclass(frozen=True)
class Resolved(Mapping):
    """The knob values an engine runs with, from ``resolve``: each field the value in force, ``sources`` where each
    value the model decides came from (``"user"``, ``"llm2vec_config.json in <folder>"``, ``"llm2vec default"``,
    ``"sentence-transformers Pooling"``, ``"sentence-transformers config"``, ``"model default"``), ``defaults``
    what the model and its adapters set those knobs to when they are left at ``None``. Also a read-only mapping of
    the values (``eng.resolved["pooling"]``).

        >>> r = eng.resolved; r.pooling, r.sources["pooling"]          # ('mean', 'llm2vec default')
    """

    pooling: str
    normalize: bool
    truncate_dim: int | None
    max_length: int
    causal: bool
    dtype: str
    device: str
    attention_backend: str
    chunked_prefill: int | None
    instruction: str | None
    include_instruction: bool
    append_eos: bool
    instruction_pooling: str
    template: str | None
    cpu_workers: int
    layer: int | None  # the layers that run (0 = the embeddings; the model's count when the knob is None)
    long_inputs: str
    adapters: list[str]
    cpu_paths: dict[str, str]
    malloc_tuning: bool
    doc_max_length: int | None  # llm2vec's document cut in force (None: off)
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)
    defaults: Mapping[str, object] = dataclasses.field(default_factory=dict, compare=False)

    def __getitem__(self, name):
        if name not in _RESOLVED_VALUES:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self):
        return iter(_RESOLVED_VALUES)

    def __len__(self) -> int:
        return len(_RESOLVED_VALUES)

    def __repr__(self) -> str:
        return (
            "Resolved({"
            + ", ".join(
                f"{k!r}: {v!r}" + (f" ({self.sources[k]})" if k in self.sources else "") for k, v in self.items()
            )
            + "})"
        )


_RESOLVED_VALUES = tuple(f.name for f in fields(Resolved) if f.name not in ("sources", "defaults"))


def model_defaults(k: Knobs, lay: Layout, m: ModelFacts) -> dict[str, tuple]:
    """knob -> (value, source) for the knobs whose default the model decides, under the knobs ``k`` (their adapters
    give ``lay``, llm2vec's reading of the folders)."""
    d, spec = lay.defaults, m.spec
    if spec.pooling is not None:
        pooling = (spec.pooling, ST_POOLING)
    else:
        pooling = ("lasttoken" if m.is_decoder else "mean", MODEL_DEFAULT)
    if k.template is not None:  # a template's words are never the text: not pooled unless the knob says so
        include = (False, TEMPLATE)
    elif "include_instruction" in d:
        include = d["include_instruction"]
    else:
        include = (
            (bool(spec.include_prompt), ST_POOLING) if spec.include_prompt is not None else (False, MODEL_DEFAULT)
        )
    max_length = (
        (spec.max_seq_length, "sentence-transformers config") if spec.max_seq_length else (None, MODEL_DEFAULT)
    )
    return {
        "pooling": d.get("pooling", pooling),
        "include_instruction": include,
        "max_length": d.get("max_length", max_length),
        "doc_max_length": d.get("doc_max_length", (None, MODEL_DEFAULT)),
        "causal": (
            (False, LLM2VEC_DEFAULT_SOURCE) if lay.recognized and m.is_decoder else (m.default_causal, MODEL_DEFAULT)
        ),
        "instruction_pooling": ("llm2vec", LLM2VEC_DEFAULT_SOURCE) if lay.recognized else ("exact", MODEL_DEFAULT),
        "normalize": (True, "sentence-transformers Normalize") if spec.normalize else (False, MODEL_DEFAULT),
    }


def resolve(k: Knobs, m: ModelFacts, lay: Layout, runtime: Mapping | None = None) -> Resolved:
    """The values the knobs ``k`` run with on the model ``m`` (``lay``: llm2vec's reading of its folders under
    ``k.adapters``): a knob that is set wins; one left at ``None`` takes the model's default (``model_defaults``:
    an LLM2Vec layout's, the sentence-transformers configs', the model kind's), each with its source. ``runtime``:
    the values the engine's runtime decides (``dtype``, ``device``, ``attention_backend``, ``cpu_workers``,
    ``adapters``, ``cpu_paths``, ``malloc_tuning``, ``instruction``), as they are; left out, the knobs' own."""
    found = model_defaults(k, lay, m)

    def value(name):
        set_to = getattr(k, "bidirectional" if name == "causal" else name)
        if name == "causal" and set_to is not None:
            return not set_to
        return set_to if set_to is not None else found[name][0]

    pooling, rule = value("pooling"), value("instruction_pooling")
    if k.max_length is not None:
        max_length = k.max_length
    else:
        limits = [x for x in (found["max_length"][0], m.tokenizer_max, m.positions) if x]
        max_length = min(limits) if limits else 512
    n = m.num_layers
    layer = n if k.layer is None else (n + 1 + k.layer if k.layer < 0 else k.layer)  # -1 = n (the last), -n = 1
    run = {
        "dtype": k.dtype,
        "device": k.device,
        "attention_backend": k.attention_backend,
        "cpu_workers": k.cpu_workers,
        "adapters": list(k.adapters),
        "cpu_paths": {},
        "malloc_tuning": False,
        "instruction": k.instruction,
        **(runtime or {}),
    }
    sources = {
        name: USER if getattr(k, "bidirectional" if name == "causal" else name) is not None else src
        for name, (_, src) in found.items()
    }
    return Resolved(
        pooling=pooling,
        normalize=value("normalize"),
        truncate_dim=k.truncate_dim,
        max_length=max_length,
        causal=value("causal"),
        chunked_prefill=k.chunked_prefill,
        include_instruction=bool(value("include_instruction")),
        append_eos=(
            k.append_eos if k.append_eos is not None else m.is_decoder and pooling == "lasttoken" and rule == "exact"
        ),
        instruction_pooling=rule,
        template=k.template,
        layer=layer,
        long_inputs=k.long_inputs,
        doc_max_length=value("doc_max_length") or None,
        sources=sources,
        defaults={name: v for name, (v, _) in found.items()},
        **run,
    )


def check_for_model(k: Knobs, m: ModelFacts, causal: bool) -> None:
    """``truncate_dim`` within the embedding size; ``max_length`` within the positions the model has (encoders;
    decoders past them get a warning) and longer than the special tokens; ``layer`` within the layers;
    ``chunked_prefill`` only under causal attention (``causal``: the attention ``k`` runs with). Errors name the
    valid values."""
    if k.truncate_dim is not None and k.truncate_dim > m.hidden:
        raise ValueError(f"truncate_dim={k.truncate_dim} exceeds the embedding size {m.hidden}; valid: 1..{m.hidden}")
    if k.max_length is not None:
        if m.positions and k.max_length > m.positions:
            if not m.is_decoder:
                raise ValueError(
                    f"max_length={k.max_length} but this model has {m.positions} positions; valid: "
                    f"1..{m.positions} (or None for the model's own limit)"
                )
            warn(
                f"max_length={k.max_length} is past this decoder's max_position_embeddings={m.positions}: "
                "RoPE beyond the trained length usually degrades embeddings",
            )
        if k.max_length <= m.specials:
            raise ValueError(
                f"max_length={k.max_length} leaves no room for text: the tokenizer adds {m.specials} "
                f"special token(s) to every input; use max_length >= {m.specials + 1}"
            )
    if k.layer is not None:
        n = m.num_layers
        if n is None:
            raise ValueError(f"layer={k.layer} but this model does not report its number of layers; use layer=None")
        if not -n <= k.layer <= n:
            raise ValueError(f"layer={k.layer} but this model has {n} layers; valid: 0..{n}, -{n}..-1, or None")
    if k.chunked_prefill is not None and not causal:
        raise ValueError(
            "chunked_prefill needs causal attention, but this model runs bidirectionally: bidirectional "
            "attention needs the whole sequence at once. Set bidirectional=False or chunked_prefill=None"
        )


def plain_scalar(value):
    """A numpy scalar as the Python value it holds (``np.int64(16)`` -> ``16``, ``np.float32`` -> ``float``,
    ``np.bool_`` -> ``bool``, so that a bool stays refused where an int is asked); anything else unchanged."""
    import numpy as np

    if isinstance(value, np.generic) and isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return value


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu' or 'auto'")
    return d


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` -> float32 on CPU, bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]
