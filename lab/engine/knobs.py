"""The knob table, in one place: names, types, defaults, validation, which combinations conflict, and how the
knobs resolve on a model (``resolve`` -> ``Resolved``: each value in force and where it came from).

``None`` always means "the model's own default" (``resolve``: an LLM2Vec layout's, the model folder's
sentence-transformers configs', else the model kind's). Every knob but
``device`` and ``revision`` can change live through ``Engine.configure`` without reloading weights (``dtype``
re-casts them).

    >>> k = Knobs(pooling="mean"); k = k.replace(bidirectional=True); k.validate()
    >>> r = resolve(k, facts, layout); r.pooling, r.causal, r.sources["pooling"]      # ('mean', False, 'user')
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from lab.engine.framing import INSTRUCTION_POOLING, check_template
from lab.engine.llm2vec import DEFAULT_SOURCE as LLM2VEC_DEFAULT_SOURCE
from lab.outputs.pooling import knob_values as pooling_values

if TYPE_CHECKING:
    from lab.engine.llm2vec import Layout
    from lab.models.spec import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LONG_INPUTS = ("truncate", "chunk")

KNOB_DOCS: dict[str, str] = {  # one line of help per knob: Engine's docstring, the README table, the panel
    "pooling": (
        "``cls``, ``mean``, ``max``, ``lasttoken``, ``weightedmean``, or llm2vec's ``eos_token`` (``lasttoken`` after "
        "the EOS text llm2vec appends for the base: `` </s>`` for Llama / Mistral, ``<eos>`` Gemma, ``<|endoftext|>`` "
        "Qwen2); ``None`` = the model's own: an LLM2Vec layout's (``llm2vec_config.json``'s ``pooling_mode``, else "
        "llm2vec's ``mean``; ``lab.engine.llm2vec``), else the sentence-transformers Pooling config, else "
        "``lasttoken`` for decoders and ``mean`` for encoders. ``eng.resolved.sources`` says which."
    ),
    "normalize": (
        "L2-normalize embeddings; ``None`` = whether the model folder has a Normalize module."
    ),
    "truncate_dim": (
        "matryoshka dimension (applied before normalize)."
    ),
    "max_length": (
        "longest input in tokens (longer ones are truncated and counted in ``stats.truncated``, or split as "
        "``long_inputs`` says); ``None`` = an LLM2Vec layout's (``llm2vec_config.json``, else llm2vec's 512), else "
        "sentence_bert_config's ``max_seq_length``, capped by the tokenizer's and the model's limits."
    ),
    "max_batch_tokens": (
        "the scheduler's token budget per packed step."
    ),
    "max_num_seqs": (
        "the most sequences in one packed step."
    ),
    "dtype": (
        "``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``bfloat16``, ``float16``."
    ),
    "device": (
        "``auto``, ``cpu``, ``cuda``, ``cuda:N`` (fixed at load)."
    ),
    "revision": (
        "for a model named by hub id (``org/name``): a branch, a tag or a commit (``None`` = ``main``), resolved "
        "through huggingface_hub's cache (``lab.models.hub``); fixed at load. ``eng.model_name`` / ``eng.revision`` "
        "say what loaded (the id and the snapshot's commit). Adapters by id take theirs as ``org/name@rev``."
    ),
    "bidirectional": (
        "``None`` = the model's own attention (bidirectional for an LLM2Vec layout, as ``LLM2Vec.from_pretrained`` "
        "enables it; causal for other decoders); ``True``/``False`` override."
    ),
    "chunked_prefill": (
        "tokens per chunk for long inputs under causal attention (``None`` = off); runs layer by layer, holding "
        "hidden states + one layer's K/V per long input (``lab.engine.kv_path``)."
    ),
    "instruction": (
        "text prepended to every input, attended to; pooled or not as ``include_instruction`` says. ``score`` / "
        "``rerank`` and ``encode_query`` apply it to queries, ``encode_document`` to no document; a call's own "
        "``instruction=`` / ``prompt=`` / ``prompt_name=`` replaces it."
    ),
    "instruction_pooling": (
        "which tokens of an input with an instruction are pooled (``lab.engine.framing``): ``llm2vec`` (llm2vec's "
        "embed mask: the input is ``instruction.strip() + ' ' + text``, in the base model's chat template where "
        "llm2vec applies one, and the last n tokens are pooled, n = the text tokenized alone without special tokens) "
        "or ``exact`` (the instruction as given, its own tokens not pooled, as sentence-transformers counts a "
        "prompt); ``None`` = ``llm2vec`` for an LLM2Vec layout (``lab.engine.llm2vec``: ``llm2vec_config.json``, a "
        "published ``-mntp`` folder, an adapter llm2vec or ``lab.adapt`` wrote), else ``exact`` "
        "(sentence-transformers models, encoders and decoders alike). Under ``long_inputs='chunk'`` the "
        "windows of a split input pool their own text tokens."
    ),
    "template": (
        "a string with one ``{text}`` field (a prompt, e.g. PromptEOL ``'This sentence : \"{text}\" means in one "
        "word:\"'`` with ``lasttoken`` pooling) or two (echo embeddings: the text twice, the second copy pooled); "
        "the pooled span is the tokens overlapping the text's last copy (by character offsets), ``lasttoken`` "
        "reading the input's last token. Dense and token outputs; composes with ``instruction``, chunked prefill "
        "and the prefix cache; ``long_inputs='chunk'`` refuses it."
    ),
    "include_instruction": (
        "pool the instruction's tokens too; ``None`` = an LLM2Vec layout's (``skip_instruction`` negated, llm2vec's "
        "default ``False``), else the model's Pooling config (sentence-transformers' ``include_prompt``, which pools "
        "them unless it says false), else ``False``; under a ``template``, ``False`` (its words are never the text)."
    ),
    "append_eos": (
        "append EOS when the tokenizer does not (``None`` = on for decoders with lasttoken pooling)."
    ),
    "prefix_cache": (
        "reuse the shared instruction prefix's K/V under causal attention."
    ),
    "attention_backend": (
        "``auto`` (triton on CUDA, torch on CPU), ``torch`` or ``triton``."
    ),
    "cpu_workers": (
        "on CPU, split each packed step across this many worker threads, each running its share of the sequences with "
        "``torch.get_num_threads() // cpu_workers`` intra-op threads (``None`` = one worker per intra-op thread; "
        "``1`` = the whole step on all threads). See ``lab.runtime.runner``."
    ),
    "layer": (
        "pool the hidden states after this layer, running only the layers up to it (a shorter forward, not a slice of "
        "the full one): 1-based, ``0`` = the embedding output, negative counts from the end (``-1`` = the last), "
        "``None`` = the last. Equals transformers' ``output_hidden_states=True`` -> ``hidden_states[layer]``. "
        "Decoders (pre-norm): the final RMSNorm is applied only at the last layer, as in transformers (below it, the "
        "un-normed residual stream); encoders (post-norm): each layer's output."
    ),
    "adapters": (
        "PEFT LoRA folders (``adapter_config.json`` + ``adapter_model.safetensors``) merged into the weights in this "
        "order, each on top of the last (``lab.adapt.adapters``); live: ``configure(adapters=[...])`` re-merges from "
        "the float32 master copy and ``[]`` restores the base weights exactly. Packed models only; DoRA, trained "
        "biases and LoRA on embeddings / ``lm_head`` are refused."
    ),
    "long_inputs": (
        "what happens to an input past ``max_length``: ``truncate`` (cut, counted in ``stats.truncated``) or "
        "``chunk`` (split into ``max_length`` windows, each pooled, averaged weighted by its tokens, then the head: "
        "matryoshka, normalize; counted in ``stats.split``; ``lab.engine.windows``). ``chunk`` applies to every dense "
        "call (``embed``, ``encode*``, bi-encoder ``score`` / ``rerank``); cross-encoder / LLM pair scoring refuses "
        "a pair past ``max_length`` under it, per-token and sparse outputs refuse it."
    ),
    "doc_max_length": (
        "llm2vec's cut of long documents (``lab.engine.llm2vec.cut_document``): a text whose tokens (special tokens "
        "left out, counted up to ``max_length``) exceed it keeps its first ``int(words x doc_max_length / tokens)`` "
        "words, repeated until it fits; instructions are never cut. ``None`` = an LLM2Vec layout's "
        "(``llm2vec_config.json``, else llm2vec's 400), off for other models; ``0`` = off. Every call kind; under "
        "``long_inputs='chunk'`` the cut comes first and the windows split what is left."
    ),
}


def knobs_doc(indent: str = "        ") -> str:
    """``KNOB_DOCS`` as a docstring section (what ``Engine.__doc__`` ends with), wrapped at 119 columns."""
    import textwrap

    return "\n".join(textwrap.fill(f"{name}: {text}", 119, initial_indent=indent, subsequent_indent=indent + "    ",
                                   break_on_hyphens=False) for name, text in KNOB_DOCS.items())



@dataclass(frozen=True)
class Knobs:
    """Engine settings researchers flip live. See the README's knob table for each one's meaning."""

    pooling: str | None = None
    normalize: bool | None = None
    truncate_dim: int | None = None
    max_length: int | None = None
    max_batch_tokens: int = 16384
    max_num_seqs: int = 256
    dtype: str = "auto"
    device: str = "auto"
    revision: str | None = None  # hub branch, tag or commit of a model named by hub id (fixed at load)
    bidirectional: bool | None = None
    chunked_prefill: int | None = None
    instruction: str | None = None
    include_instruction: bool | None = None  # None: the model's Pooling config (include_prompt), else False
    # "llm2vec" | "exact"; None: llm2vec for LLM2Vec folders (lab.engine.framing)
    instruction_pooling: str | None = None
    template: str | None = None  # "{text}" template: a prompt, or echo with two fields (lab.engine.framing)
    append_eos: bool | None = None
    prefix_cache: bool = True
    attention_backend: str = "auto"
    cpu_workers: int | None = None
    adapters: tuple[str, ...] = ()  # PEFT LoRA folders merged in this order (lab.adapt.adapters)
    layer: int | None = None  # pool the hidden states after this layer (None = last; 0 = embeddings; -1 = last)
    long_inputs: str = "truncate"  # inputs past max_length: "truncate" or "chunk" (lab.engine.windows)
    doc_max_length: int | None = None  # llm2vec's word cut of long texts (None: the model's; 0: off)

    def replace(self, **changes) -> Knobs:
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(
                f"unknown knob(s) {', '.join(unknown)}; valid knobs: {', '.join(f.name for f in fields(self))}"
            )
        changes = {k: plain_scalar(v) for k, v in changes.items()}  # numpy scalars from sweeps (np.arange, pandas)
        if "dtype" in changes:
            changes["dtype"] = normalize_dtype(changes["dtype"])
        if "adapters" in changes:
            changes["adapters"] = normalize_adapters(changes["adapters"])
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    def validate(self) -> None:
        """Raise ``ValueError`` / ``TypeError`` naming the bad knob, the valid values and the fix."""
        if self.pooling is not None and self.pooling not in pooling_values():
            raise ValueError(f"unknown pooling {self.pooling!r}; valid: {', '.join(pooling_values())} (or None)")
        if self.instruction_pooling is not None and self.instruction_pooling not in INSTRUCTION_POOLING:
            raise ValueError(f"unknown instruction_pooling {self.instruction_pooling!r}; valid: "
                             f"{', '.join(map(repr, INSTRUCTION_POOLING))} or None (the model's default)")
        check_template(self.template)
        if self.template is not None and self.long_inputs == "chunk":
            raise ValueError("template conflicts with long_inputs='chunk': a window of a split input holds no whole "
                             "copy of the template; use long_inputs='truncate' (or template=None)")
        for name in ("normalize", "bidirectional", "append_eos", "include_instruction"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"{name} must be True, False or None (model default), got {v!r}")
        if not isinstance(self.prefix_cache, bool):
            raise TypeError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")
        for name, lo in (("truncate_dim", 1), ("max_length", 1), ("chunked_prefill", 1), ("doc_max_length", 0)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
                raise ValueError(f"{name} must be a {'positive' if lo else 'non-negative'} int or None, got {v!r}")
        for name in ("max_batch_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        v = self.cpu_workers
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"cpu_workers must be a positive int or None (one per intra-op thread), got {v!r}")
        v = self.layer  # the range depends on the model: checked by the Engine
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise TypeError(
                f"layer must be an int (1-based; 0 = the embedding output; negative counts from the end, -1 = last) "
                f"or None (the last layer), got {v!r}"
            )
        normalize_dtype(self.dtype)
        normalize_device(self.device)
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision.strip()):
            raise TypeError(f"revision must be a branch, tag or commit name (a non-empty string) or None (main), "
                            f"got {self.revision!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention_backend {self.attention_backend!r}; valid: {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.long_inputs not in LONG_INPUTS:
            raise ValueError(f"unknown long_inputs {self.long_inputs!r}; valid: {', '.join(map(repr, LONG_INPUTS))}")
        if self.instruction is not None and not isinstance(self.instruction, str):
            raise TypeError(f"instruction must be a string or None, got {type(self.instruction).__name__}")
        if self.chunked_prefill is not None and self.bidirectional:
            raise ValueError(
                "chunked_prefill conflicts with bidirectional=True: bidirectional attention needs the whole "
                "sequence at once (every token attends to later tokens). Use chunked_prefill=None, or "
                "bidirectional=False for causal chunked prefill"
            )


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
        return cls(hidden=model.hidden_size, is_decoder=bool(model.is_decoder), num_layers=model.num_layers,
                   positions=model.max_positions or spec.config.get("max_position_embeddings"),
                   default_causal=bool(model.default_causal), spec=spec,
                   specials=len(tokenizer("", add_special_tokens=True)["input_ids"]),
                   tokenizer_max=tok_max if tok_max and tok_max < 1_000_000 else None)


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
        return "Resolved({" + ", ".join(
            f"{k!r}: {v!r}" + (f" ({self.sources[k]})" if k in self.sources else "") for k, v in self.items()) + "})"


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
        include = ((bool(spec.include_prompt), ST_POOLING) if spec.include_prompt is not None
                   else (False, MODEL_DEFAULT))
    max_length = ((spec.max_seq_length, "sentence-transformers config") if spec.max_seq_length
                  else (None, MODEL_DEFAULT))
    return {
        "pooling": d.get("pooling", pooling),
        "include_instruction": include,
        "max_length": d.get("max_length", max_length),
        "doc_max_length": d.get("doc_max_length", (None, MODEL_DEFAULT)),
        "causal": ((False, LLM2VEC_DEFAULT_SOURCE) if lay.recognized and m.is_decoder
                   else (m.default_causal, MODEL_DEFAULT)),
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
    run = {"dtype": k.dtype, "device": k.device, "attention_backend": k.attention_backend,
           "cpu_workers": k.cpu_workers, "adapters": list(k.adapters), "cpu_paths": {}, "malloc_tuning": False,
           "instruction": k.instruction, **(runtime or {})}
    sources = {name: USER if getattr(k, "bidirectional" if name == "causal" else name) is not None else src
               for name, (_, src) in found.items()}
    return Resolved(
        pooling=pooling, normalize=value("normalize"), truncate_dim=k.truncate_dim, max_length=max_length,
        causal=value("causal"), chunked_prefill=k.chunked_prefill,
        include_instruction=bool(value("include_instruction")),
        append_eos=(k.append_eos if k.append_eos is not None
                    else m.is_decoder and pooling == "lasttoken" and rule == "exact"),
        instruction_pooling=rule, template=k.template, layer=layer, long_inputs=k.long_inputs,
        doc_max_length=value("doc_max_length") or None, sources=sources,
        defaults={name: v for name, (v, _) in found.items()}, **run)


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
                raise ValueError(f"max_length={k.max_length} but this model has {m.positions} positions; valid: "
                                 f"1..{m.positions} (or None for the model's own limit)")
            warnings.warn(f"max_length={k.max_length} is past this decoder's max_position_embeddings={m.positions}: "
                          "RoPE beyond the trained length usually degrades embeddings", stacklevel=5)
        if k.max_length <= m.specials:
            raise ValueError(f"max_length={k.max_length} leaves no room for text: the tokenizer adds {m.specials} "
                             f"special token(s) to every input; use max_length >= {m.specials + 1}")
    if k.layer is not None:
        n = m.num_layers
        if n is None:
            raise ValueError(f"layer={k.layer} but this model does not report its number of layers; use layer=None")
        if not -n <= k.layer <= n:
            raise ValueError(f"layer={k.layer} but this model has {n} layers; valid: 0..{n}, -{n}..-1, or None")
    if k.chunked_prefill is not None and not causal:
        raise ValueError("chunked_prefill needs causal attention, but this model runs bidirectionally: bidirectional "
                         "attention needs the whole sequence at once. Set bidirectional=False or chunked_prefill=None")


def plain_scalar(value):
    """A numpy scalar as the Python value it holds (``np.int64(16)`` -> ``16``, ``np.float32`` -> ``float``,
    ``np.bool_`` -> ``bool``, so that a bool stays refused where an int is asked); anything else unchanged."""
    import numpy as np

    if isinstance(value, np.generic) and isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return value


def normalize_adapters(adapters) -> tuple[str, ...]:
    """A tuple of adapter folder paths (``None`` = none); a bare string is one folder."""
    if adapters is None:
        return ()
    if isinstance(adapters, (str, os.PathLike)):
        adapters = [adapters]
    if not isinstance(adapters, (list, tuple)):
        raise TypeError(f"adapters must be a list of PEFT LoRA folders, got {type(adapters).__name__}")
    for a in adapters:
        if not isinstance(a, (str, os.PathLike)):
            raise TypeError(f"adapters must be folder paths (str or os.PathLike), got {type(a).__name__} ({a!r})")
    return tuple(os.fspath(a) for a in adapters)


def normalize_dtype(dtype) -> str:
    """Canonical dtype name; accepts ``torch.dtype`` objects and short aliases (bf16, fp32, ...)."""
    if isinstance(dtype, torch.dtype):
        for name, d in DTYPES.items():
            if d == dtype:
                return name
    if isinstance(dtype, str):
        dtype = DTYPE_ALIASES.get(dtype, dtype)
        if dtype == "auto" or dtype in DTYPES:
            return dtype
    raise ValueError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(DTYPES)}")


def normalize_device(device) -> str:
    if isinstance(device, torch.device):
        device = str(device)
    if isinstance(device, str) and (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
        return device
    raise ValueError(f"unknown device {device!r}; valid: auto, cpu, cuda, cuda:N")


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
