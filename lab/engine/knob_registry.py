"""The knob registry: every knob's name, default, check, one-line doc, the call kinds that honour it and its panel
widget, in one table (``KNOBS``). ``lab.engine.knobs.Knobs`` holds values for exactly these names; ``configure``
checks a value with its knob's ``check``; the panel (``lab.eval.panel``) builds a widget for each knob with a
``widget``; the README's knob table and the Engine's docstring list ``KNOBS`` in order (``knob_docs``).

A new knob is one ``register(Knob(...))``: ``Engine(..., name=value)``, ``configure(name=value)``, the panel and
the docs table then take it. What the knob does is the code that reads ``eng.knobs[name]`` /
``eng.resolved``.

    >>> register(Knob("my_scale", 1, check=positive_int("my_scale"), doc="scales my head's output.",
    ...               widget=Widget("int", "my scale", minimum=1, maximum=8)))
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lab.engine.framing import INSTRUCTION_POOLING, check_template
from lab.outputs.pooling import knob_values as pooling_values

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LONG_INPUTS = ("truncate", "chunk")
EVERY = "every call"  # the call kinds that honour a knob (``Knob.calls``): the README table's column
DENSE = "dense outputs: embed, encode, bi-encoder score / rerank"
EMBEDDING = "embedding calls (not cross-encoder / LLM pair scoring)"
CAUSAL = "every call, under causal attention"
AT_LOAD = "fixed at load"


@dataclass(frozen=True)
class Widget:
    """How the panel shows a knob (``lab.eval.panel`` builds it; this module imports no widget library).

    ``kind``: ``dropdown`` (``options()`` the values; a knob whose default is ``None`` gets a first "model default
    (<resolved>)" entry), ``checkbox`` (a ``None`` knob shows ``resolved[shows]``, negated when ``invert``, and
    goes back to ``None`` when ticked to that), ``int`` (``minimum`` .. ``maximum`` by ``step``; ``zero_is_none``:
    0 means ``None``) or ``text`` (empty means ``None``)."""

    kind: str
    label: str
    options: Callable[[], tuple] | None = None
    shows: str | None = None  # the Resolved field a None knob shows
    invert: bool = False
    minimum: int = 0
    maximum: int = 1 << 30
    step: int = 1
    zero_is_none: bool = False
    placeholder: str = ""
    tooltip: str = ""

    def __post_init__(self):
        if self.kind not in ("dropdown", "checkbox", "int", "text"):
            raise ValueError(f"unknown widget kind {self.kind!r}; valid: dropdown, checkbox, int, text")
        if self.kind == "dropdown" and self.options is None:
            raise ValueError(f"the dropdown widget {self.label!r} needs options (a function returning the values)")


@dataclass(frozen=True)
class Knob:
    """One knob. ``type``: its annotation in ``Engine``'s signature; ``check(value)`` returns the value as stored
    (``dtype`` aliases and ``adapters`` lists made canonical) or raises ``TypeError`` / ``ValueError`` naming the knob,
    the value and the valid ones; ``calls``: the call kinds that honour it; ``widget``: its panel widget (``None``:
    not on the panel); ``live``: ``configure`` may change it (``device`` and ``revision`` are fixed at load)."""

    name: str
    default: object
    check: Callable[[object], object]
    doc: str
    type: str = "object"  # the annotation the Engine's signature shows
    calls: str = EVERY
    widget: Widget | None = None
    live: bool = True


KNOBS: dict[str, Knob] = {}  # name -> knob, in the order the docs, the Engine's signature and the panel list them


def register(knob: Knob) -> Knob:
    """Add ``knob`` to ``KNOBS`` (replacing a knob of its name): ``Engine``, ``configure``, the panel and the docs
    table then take it. Returns it."""
    if not isinstance(knob, Knob):
        raise TypeError(f"a knob must be a lab.engine.knob_registry.Knob, got {type(knob).__name__}")
    if not knob.name.isidentifier() or knob.name.startswith("_"):
        raise ValueError(f"a knob's name must be a public Python identifier (a keyword argument), got {knob.name!r}")
    KNOBS[knob.name] = knob
    return knob


def knob_docs(indent: str = "        ") -> str:
    """``KNOBS``' docs as a docstring section (what ``Engine.__doc__`` ends with), wrapped at 119 columns."""
    import textwrap

    return "\n".join(
        textwrap.fill(
            f"{k.name}: {k.doc}", 119, initial_indent=indent, subsequent_indent=indent + "    ", break_on_hyphens=False
        )
        for k in KNOBS.values()
    )


def knob_signature(function, *, after: str) -> inspect.Signature:
    """``function``'s signature with its ``**knobs`` replaced by every knob of ``KNOBS`` (keyword-only, with its
    default and type) right after its parameter ``after``: what ``help`` and IDEs show for ``Engine``."""
    own = list(inspect.signature(function).parameters.values())
    knobs = [
        inspect.Parameter(k.name, inspect.Parameter.KEYWORD_ONLY, default=k.default, annotation=k.type)
        for k in KNOBS.values()
    ]
    at = [p.name for p in own].index(after) + 1
    rest = [p for p in own[at:] if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return inspect.Signature([*own[:at], *knobs, *rest])


# ------------------------------------------------------------------------------------------------------- checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(name: str, lo: int, *, optional: bool = False) -> Callable[[object], object]:
    """An int >= ``lo`` (``None`` too when ``optional``)."""

    def check(v):
        if v is None and optional:
            return v
        if not _is_int(v) or v < lo:
            what = f"{'positive' if lo else 'non-negative'} int" + (" or None" if optional else "")
            raise ValueError(f"{name} must be a {what}, got {v!r}")
        return v

    return check


def positive_int(name: str) -> Callable[[object], object]:
    """The check of a knob that takes a positive int."""
    return _int(name, 1)


def _optional_bool(name: str) -> Callable[[object], object]:
    def check(v):
        if v is not None and not isinstance(v, bool):
            raise TypeError(f"{name} must be True, False or None (model default), got {v!r}")
        return v

    return check


def _prefix_cache(v):
    if not isinstance(v, bool):
        raise TypeError(f"prefix_cache must be True or False, got {v!r}")
    return v


def _pooling(v):
    if v is not None and v not in pooling_values():
        raise ValueError(f"unknown pooling {v!r}; valid: {', '.join(pooling_values())} (or None)")
    return v


def _instruction_pooling(v):
    if v is not None and v not in INSTRUCTION_POOLING:
        raise ValueError(
            f"unknown instruction_pooling {v!r}; valid: {', '.join(map(repr, INSTRUCTION_POOLING))} "
            "or None (the model's default)"
        )
    return v


def _template(v):
    check_template(v)
    return v


def _attention_backend(v):
    if v not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {v!r}; valid: {', '.join(ATTENTION_BACKENDS)}")
    return v


def _long_inputs(v):
    if v not in LONG_INPUTS:
        raise ValueError(f"unknown long_inputs {v!r}; valid: {', '.join(map(repr, LONG_INPUTS))}")
    return v


def _instruction(v):
    if v is not None and not isinstance(v, str):
        raise TypeError(f"instruction must be a string or None, got {type(v).__name__}")
    return v


def _cpu_workers(v):
    if v is not None and (not _is_int(v) or v < 1):
        raise ValueError(f"cpu_workers must be a positive int or None (one per intra-op thread), got {v!r}")
    return v


def _layer(v):  # the range depends on the model: checked by lab.engine.knobs.check_for_model
    if v is not None and not _is_int(v):
        raise TypeError(
            f"layer must be an int (1-based; 0 = the embedding output; negative counts from the end, "
            f"-1 = last) or None (the last layer), got {v!r}"
        )
    return v


def _revision(v):
    if v is not None and (not isinstance(v, str) or not v.strip()):
        raise TypeError(
            f"revision must be a branch, tag or commit name (a non-empty string) or None (main), got {v!r}"
        )
    return v


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


# ------------------------------------------------------------------------------------------------------ the table
for _knob in (
    Knob(
        "pooling",
        None,
        _pooling,
        type="str | None",
        calls=DENSE,
        widget=Widget("dropdown", "pooling", options=pooling_values, shows="pooling"),
        doc=(
            "``cls``, ``mean``, ``max``, ``lasttoken``, ``weightedmean``, or llm2vec's ``eos_token`` (``lasttoken`` "
            "after the EOS text llm2vec appends for the base: `` </s>`` for Llama / Mistral, ``<eos>`` Gemma, "
            "``<|endoftext|>`` Qwen2); ``None`` = the model's own: an LLM2Vec layout's (``llm2vec_config.json``'s "
            "``pooling_mode``, else llm2vec's ``mean``; ``lab.engine.llm2vec``), else the sentence-transformers "
            "Pooling config, else ``lasttoken`` for decoders and ``mean`` for encoders. ``eng.resolved.sources`` says "
            "which."
        ),
    ),
    Knob(
        "normalize",
        None,
        _optional_bool("normalize"),
        type="bool | None",
        calls=DENSE,
        doc=("L2-normalize embeddings; ``None`` = whether the model folder has a Normalize module."),
    ),
    Knob(
        "truncate_dim",
        None,
        _int("truncate_dim", 1, optional=True),
        type="int | None",
        calls=DENSE,
        doc=("matryoshka dimension (applied before normalize)."),
    ),
    Knob(
        "max_length",
        None,
        _int("max_length", 1, optional=True),
        type="int | None",
        calls=EVERY,
        doc=(
            "longest input in tokens (longer ones are truncated and counted in ``stats.truncated``, or split as "
            "``long_inputs`` says); ``None`` = an LLM2Vec layout's (``llm2vec_config.json``, else llm2vec's 512), "
            "else sentence_bert_config's ``max_seq_length``, capped by the tokenizer's and the model's limits."
        ),
    ),
    Knob(
        "max_batch_tokens",
        16384,
        _int("max_batch_tokens", 1),
        type="int",
        calls=EVERY,
        widget=Widget("int", "batch token budget", minimum=1, maximum=1 << 24, step=1024),
        doc=("the scheduler's token budget per packed step."),
    ),
    Knob(
        "max_num_seqs",
        256,
        _int("max_num_seqs", 1),
        type="int",
        calls=EVERY,
        doc=("the most sequences in one packed step."),
    ),
    Knob(
        "dtype",
        "auto",
        normalize_dtype,
        type="str",
        calls=EVERY,
        widget=Widget("dropdown", "dtype", options=lambda: ("auto", *DTYPES)),
        doc=("``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``bfloat16``, ``float16``."),
    ),
    Knob(
        "device",
        "auto",
        normalize_device,
        type="str",
        calls=AT_LOAD,
        live=False,
        doc=("``auto``, ``cpu``, ``cuda``, ``cuda:N`` (fixed at load)."),
    ),
    Knob(
        "revision",
        None,
        _revision,
        type="str | None",
        calls=AT_LOAD,
        live=False,
        doc=(
            "for a model named by hub id (``org/name``): a branch, a tag or a commit (``None`` = ``main``), resolved "
            "through huggingface_hub's cache (``lab.models.hub``); fixed at load. ``eng.model_name`` / "
            "``eng.revision`` say what loaded (the id and the snapshot's commit). Adapters by id take theirs as "
            "``org/name@rev``."
        ),
    ),
    Knob(
        "bidirectional",
        None,
        _optional_bool("bidirectional"),
        type="bool | None",
        calls=EVERY,
        widget=Widget("checkbox", "bidirectional attention", shows="causal", invert=True),
        doc=(
            "``None`` = the model's own attention (bidirectional for an LLM2Vec layout, as "
            "``LLM2Vec.from_pretrained`` enables it; causal for other decoders); ``True``/``False`` override."
        ),
    ),
    Knob(
        "chunked_prefill",
        None,
        _int("chunked_prefill", 1, optional=True),
        type="int | None",
        calls=CAUSAL,
        widget=Widget(
            "int",
            "chunked prefill",
            minimum=0,
            maximum=1 << 20,
            step=64,
            zero_is_none=True,
            tooltip="tokens per chunk, 0 = off (causal only)",
        ),
        doc=(
            "tokens per chunk for long inputs under causal attention (``None`` = off); runs layer by layer, holding "
            "hidden states + one layer's K/V per long input (``lab.engine.kv_path``)."
        ),
    ),
    Knob(
        "instruction",
        None,
        _instruction,
        type="str | None",
        calls="embed, encode_query, the queries of score / rerank",
        widget=Widget("text", "instruction", placeholder="none (attended, not pooled)"),
        doc=(
            "text prepended to every input, attended to; pooled or not as ``include_instruction`` says. ``score`` / "
            "``rerank`` and ``encode_query`` apply it to queries, ``encode_document`` to no document; a call's own "
            "``instruction=`` / ``prompt=`` / ``prompt_name=`` replaces it."
        ),
    ),
    Knob(
        "include_instruction",
        None,
        _optional_bool("include_instruction"),
        type="bool | None",
        calls=EMBEDDING,
        doc=(
            "pool the instruction's tokens too; ``None`` = an LLM2Vec layout's (``skip_instruction`` negated, "
            "llm2vec's default ``False``), else the model's Pooling config (sentence-transformers' "
            "``include_prompt``, which pools them unless it says false), else ``False``; under a ``template``, "
            "``False`` (its words are never the text)."
        ),
    ),
    Knob(
        "instruction_pooling",
        None,
        _instruction_pooling,
        type="str | None",
        calls=EMBEDDING,
        doc=(
            "which tokens of an input with an instruction are pooled (``lab.engine.framing``): ``llm2vec`` (llm2vec's "
            "embed mask: the input is ``instruction.strip() + ' ' + text``, in the base model's chat template where "
            "llm2vec applies one, and the last n tokens are pooled, n = the text tokenized alone without special "
            "tokens) or ``exact`` (the instruction as given, its own tokens not pooled, as sentence-transformers "
            "counts a prompt); ``None`` = ``llm2vec`` for an LLM2Vec layout (``lab.engine.llm2vec``: "
            "``llm2vec_config.json``, a published ``-mntp`` folder, an adapter llm2vec or ``lab.adapt`` wrote), else "
            "``exact`` (sentence-transformers models, encoders and decoders alike). Under ``long_inputs='chunk'`` the "
            "windows of a split input pool their own text tokens."
        ),
    ),
    Knob(
        "template",
        None,
        _template,
        type="str | None",
        calls="dense and token outputs",
        doc=(
            'a string with one ``{text}`` field (a prompt, e.g. PromptEOL ``\'This sentence : "{text}" means in one '
            "word:\"'`` with ``lasttoken`` pooling) or two (echo embeddings: the text twice, the second copy pooled); "
            "the pooled span is the tokens overlapping the text's last copy (by character offsets), ``lasttoken`` "
            "reading the input's last token. Dense and token outputs; composes with ``instruction``, chunked prefill "
            "and the prefix cache; ``long_inputs='chunk'`` refuses it."
        ),
    ),
    Knob(
        "append_eos",
        None,
        _optional_bool("append_eos"),
        type="bool | None",
        calls=EMBEDDING,
        doc=("append EOS when the tokenizer does not (``None`` = on for decoders with lasttoken pooling)."),
    ),
    Knob(
        "prefix_cache",
        True,
        _prefix_cache,
        type="bool",
        calls=CAUSAL,
        doc=("reuse the shared instruction prefix's K/V under causal attention."),
    ),
    Knob(
        "attention_backend",
        "auto",
        _attention_backend,
        type="str",
        calls=EVERY,
        doc=("``auto`` (triton on CUDA, torch on CPU), ``torch`` or ``triton``."),
    ),
    Knob(
        "cpu_workers",
        None,
        _cpu_workers,
        type="int | None",
        calls=EVERY,
        doc=(
            "on CPU, split each packed step across this many worker threads, each running its share of the sequences "
            "with ``torch.get_num_threads() // cpu_workers`` intra-op threads (``None`` = one worker per intra-op "
            "thread; ``1`` = the whole step on all threads). See ``lab.runtime.runner``."
        ),
    ),
    Knob(
        "adapters",
        (),
        normalize_adapters,
        type="list[str] | tuple[str, ...]",
        calls=EVERY,
        doc=(
            "PEFT LoRA folders (``adapter_config.json`` + ``adapter_model.safetensors``) merged into the weights in "
            "this order, each on top of the last (``lab.adapt.merge``); live: ``configure(adapters=[...])`` "
            "re-merges from the float32 master copy and ``[]`` restores the base weights exactly. Packed models only; "
            "DoRA, trained biases and LoRA on embeddings / ``lm_head`` are refused."
        ),
    ),
    Knob(
        "layer",
        None,
        _layer,
        type="int | None",
        calls=EVERY,
        doc=(
            "pool the hidden states after this layer, running only the layers up to it (a shorter forward, not a "
            "slice of the full one): 1-based, ``0`` = the embedding output, negative counts from the end (``-1`` = "
            "the last), ``None`` = the last. Equals transformers' ``output_hidden_states=True`` -> "
            "``hidden_states[layer]``. Decoders (pre-norm): the final RMSNorm is applied only at the last layer, as "
            "in transformers (below it, the un-normed residual stream); encoders (post-norm): each layer's output."
        ),
    ),
    Knob(
        "long_inputs",
        "truncate",
        _long_inputs,
        type="str",
        calls=DENSE,
        doc=(
            "what happens to an input past ``max_length``: ``truncate`` (cut, counted in ``stats.truncated``) or "
            "``chunk`` (split into ``max_length`` windows, each pooled, averaged weighted by its tokens, then the "
            "head: matryoshka, normalize; counted in ``stats.split``; ``lab.engine.windows``). ``chunk`` applies to "
            "every dense call (``embed``, ``encode*``, bi-encoder ``score`` / ``rerank``); cross-encoder / LLM pair "
            "scoring refuses a pair past ``max_length`` under it, per-token and sparse outputs refuse it."
        ),
    ),
    Knob(
        "doc_max_length",
        None,
        _int("doc_max_length", 0, optional=True),
        type="int | None",
        calls=EVERY,
        doc=(
            "llm2vec's cut of long documents (``lab.engine.llm2vec.cut_document``): a text whose tokens (special "
            "tokens left out, counted up to ``max_length``) exceed it keeps its first ``int(words x doc_max_length / "
            "tokens)`` words, repeated until it fits; instructions are never cut. ``None`` = an LLM2Vec layout's "
            "(``llm2vec_config.json``, else llm2vec's 400), off for other models; ``0`` = off. Every call kind; under "
            "``long_inputs='chunk'`` the cut comes first and the windows split what is left."
        ),
    ),
):
    register(_knob)
