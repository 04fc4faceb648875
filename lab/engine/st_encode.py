"""sentence-transformers compatibility: ``Engine.encode`` / ``encode_query`` / ``encode_document`` take
``SentenceTransformer.encode``'s arguments and return what it returns, so a script written for
sentence-transformers runs on the engine by changing one line.

What maps to what (checked against sentence-transformers on the same folder, ``tests/test_encode.py``):

- ``prompt`` / ``prompt_name`` (a key of ``Engine.prompts``: sentence-transformers' empty ``query`` and
  ``document`` prompts updated with the folder's ``config_sentence_transformers.json`` ``prompts``) become the
  call's ``instruction``; with neither, the engine's ``instruction`` knob, else the folder's ``default_prompt_name``
  (``call_prompt``: what ``Engine.embed`` uses). ``encode_query`` without a prompt uses the ``instruction`` knob
  when it is set (the knob is the query side's instruction, as ``score`` applies it), else the ``query`` prompt;
  ``encode_document`` uses the folder's document prompt and never the knob (``score`` embeds documents without
  it). The Pooling config's ``include_prompt`` (knob ``include_instruction``) decides whether its tokens are pooled.
- The engine's other knobs apply as in ``Engine.embed``: ``pooling``, ``normalize``, ``max_length``, ``layer``,
  ``dtype``, ``bidirectional``, ``chunked_prefill``; ``long_inputs="chunk"`` splits sentence embeddings' long inputs
  into windows as ``embed`` does (``lab.engine.windows.dense_pass``) and is refused for ``token_embeddings`` and a
  ColBERT folder's vectors (per-token outputs have no window average), as ``embed`` refuses them.
- The order of the post-processing is sentence-transformers': the model's own modules (pooling, then ``Normalize``
  when the folder has one, or the ``normalize`` knob), then ``truncate_dim`` (the argument, else the engine's
  ``truncate_dim`` knob), then ``normalize_embeddings``, then ``precision`` (``lab.outputs.quantize``, ranges from the
  call's own embeddings). ``Engine.embed`` instead truncates before it normalizes (unit-length matryoshka vectors).
- ``output_value="token_embeddings"``: every token's final hidden state, specials and prompt tokens included
  (a list of ``(L_i, dim)`` tensors, as sentence-transformers returns).
- ``batch_size`` is accepted and checked but does not schedule: the engine packs by its token budget
  (``max_batch_tokens``). ``device`` must be the engine's (it is fixed at load). ``pool`` / a list of devices
  (multi-process encoding) are refused: the engine shares each step among its CPU workers already, and
  ``lab.distributed`` spreads work over processes or machines.
- A single string returns one vector (1-D), as sentence-transformers does (``embed`` always returns 2-D).
- A ColBERT folder (``lab.outputs.multivector``) answers as ``MultiVectorEncoder.encode`` does: a list of ``(L_i, d)``
  tensors (numpy arrays with ``convert_to_numpy=True``; one matrix for a single string), ``task`` (``query`` /
  ``document``, set by ``encode_query`` / ``encode_document``), ``normalize_embeddings`` per token and
  ``truncate_dim`` (cut, then L2-normalized per token); ``convert_to_tensor``, ``precision`` and
  ``output_value`` other than ``token_embeddings`` are refused (``tests/test_multivector.py``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from lab.engine import windows
from lab.engine.inputs import check_texts
from lab.engine.knobs import plain_scalar
from lab.outputs.heads import EmbeddingHead, TokensHead
from lab.outputs.quantize import check_precision, quantize_embeddings

__all__ = ["OUTPUT_VALUES", "call_prompt", "encode", "forward", "resolve_prompt", "task_kw"]

OUTPUT_VALUES = ("sentence_embedding", "token_embeddings")


class _ModelDefault:
    """``encode``'s ``output_value`` when not given: the model type's default (``sentence_embedding``;
    ``token_embeddings`` for a ColBERT folder, as ``MultiVectorEncoder.encode``)."""

    def __repr__(self) -> str:
        return "<the model's default>"


MODEL_DEFAULT = _ModelDefault()
DOCUMENT_PROMPTS = ("document", "passage", "corpus")  # encode_document's prompt names, first present wins


def resolve_prompt(
    prompts: dict[str, str], default_name: str | None, prompt: str | None, prompt_name: str | None
) -> str | None:
    """The prompt text a call uses: ``prompt`` itself, else ``prompts[prompt_name]``, else the default prompt,
    else ``None``. ``prompt`` and ``prompt_name`` together are refused (sentence-transformers warns and drops the
    name; an error is clearer)."""
    if prompt is not None and prompt_name is not None:
        raise ValueError("pass either prompt= (the text) or prompt_name= (a key of the model's prompts), not both")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
        return prompt
    if prompt_name is not None:
        if prompt_name not in prompts:
            have = f"its prompts are {sorted(prompts)}" if prompts else "it has none"
            raise ValueError(
                f"unknown prompt_name {prompt_name!r}: the model folder's "
                f"config_sentence_transformers.json names the prompts, and {have}; or pass prompt="
            )
        return prompts[prompt_name]
    return prompts.get(default_name) if default_name is not None else None


def call_instruction(spec, knob: str | None, instruction, prompt_name: str | None, *, given: bool) -> str | None:
    """The instruction an ``embed`` / ``score`` / ``tokenize`` call runs with (``Engine``'s ``instruction=`` /
    ``prompt_name=``; ``given``: whether the call passed ``instruction``): ``prompt_name``'s prompt, else
    ``instruction``, else the ``instruction`` knob, else the folder's default prompt (``default_prompt_name``), as
    sentence-transformers resolves prompts."""
    if prompt_name is not None:
        if given:
            raise ValueError(
                "pass either instruction= (the text) or prompt_name= (a key of the model's prompts), not both"
            )
        return resolve_prompt(spec.prompts, None, None, prompt_name)
    instr = instruction if given else knob
    if instr is not None and not isinstance(instr, str):
        raise TypeError(f"instruction must be a string or None, got {type(instr).__name__}")
    if instr is None and not given:
        return resolve_prompt(spec.prompts, spec.default_prompt_name, None, None)
    return instr


def call_prompt(engine, prompt: str | None, prompt_name: str | None) -> str | None:
    """The instruction text an ``encode`` call runs with: ``prompt``, else ``prompts[prompt_name]`` (both given are
    refused, ``resolve_prompt``), else the engine's ``instruction`` knob, else the folder's default prompt: the
    order ``Engine.embed`` resolves its instruction in."""
    knob = engine.knobs["instruction"]
    if prompt is None and prompt_name is None and knob is not None:
        return knob
    return resolve_prompt(engine.prompts, engine.spec.default_prompt_name, prompt, prompt_name)


def query_prompt_name(engine, prompt: str | None, prompt_name: str | None) -> str | None:
    """``encode_query``'s prompt name: the given one; else none when the engine's ``instruction`` knob is set (the
    knob then applies, ``call_prompt``); else ``query`` when the model has it."""
    if prompt is None and prompt_name is None and engine.knobs["instruction"] is None and "query" in engine.prompts:
        return "query"
    return prompt_name


def document_prompt_name(prompts: dict[str, str], prompt: str | None, prompt_name: str | None) -> str | None:
    """``encode_document``'s prompt name: the given one, else the first of ``document``, ``passage``, ``corpus``."""
    if prompt is None and prompt_name is None:
        return next((name for name in DOCUMENT_PROMPTS if name in prompts), None)
    return prompt_name


def task_kw(spec, task: str, kwargs: dict) -> dict:
    """``encode_query`` / ``encode_document``'s arguments: a ColBERT folder's calls carry their ``task``."""
    return {"task": task, **kwargs} if spec.multi_vector is not None else kwargs


def _check_long_inputs(engine, what: str) -> None:
    """``long_inputs="chunk"`` averages one vector per window: per-token outputs cannot follow it."""
    if engine.knobs["long_inputs"] == "chunk":
        raise ValueError(
            f"long_inputs='chunk' averages one sentence embedding per window of max_length="
            f"{engine.resolved.max_length} tokens; {what} are per-token and cannot be averaged: set "
            "long_inputs='truncate' (engine.configure(long_inputs='truncate')) for them"
        )


def _check_options(*, batch_size, output_value, device, engine_device, pool, kwargs, values=OUTPUT_VALUES) -> None:
    if kwargs:
        raise TypeError(
            f"encode() got arguments it does not take: {sorted(kwargs)} (the engine's knobs are set with "
            "Engine(...) or engine.configure(...))"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"batch_size must be a positive integer, got {batch_size!r} (it is accepted for "
            "compatibility; the engine schedules by max_batch_tokens)"
        )
    if output_value not in values:
        raise ValueError(f"output_value must be one of {', '.join(map(repr, values))}, got {output_value!r}")
    if pool is not None or isinstance(device, list | tuple):
        raise ValueError(
            "multi-process encoding (pool= or a list of devices) is not supported: the engine already "
            "shares each packed step among its CPU workers (knob cpu_workers); to spread work over "
            "processes or machines use lab.distributed.RayEngine"
        )
    if device is not None:
        want = torch.device(device)
        if want.type != engine_device.type or (want.index is not None and want != engine_device):
            raise ValueError(
                f"encode(device={device!r}): this engine runs on {engine_device} (fixed at load); "
                f"create Engine(path, device={str(want)!r}) to run there"
            )


def _sentences(sentences) -> tuple[list[str], bool]:
    """The checked list of texts, and whether one bare string was given (its result is unwrapped)."""
    single = isinstance(sentences, str)
    return check_texts([sentences] if single else sentences, "sentences"), single


def _check_truncate_dim(truncate_dim) -> None:
    if truncate_dim is not None and (
        isinstance(truncate_dim, bool) or not isinstance(truncate_dim, int) or truncate_dim < 1
    ):
        raise ValueError(f"truncate_dim must be a positive integer, got {truncate_dim!r}")


def forward(
    engine, texts: list[str], prompt: str | None, kind: str, show_progress: bool | None, task: str | None = None
):
    """``encode``'s forward on ``engine`` (its public seam, ``Engine.embed_pass`` / ``Engine.run_passes``): sentence
    embeddings before truncation (pooled, normalized when the model normalizes; long inputs split as the
    ``long_inputs`` knob says, ``lab.engine.windows.dense_pass``), every token's hidden state (prompt and specials
    included) for ``kind="token_embeddings"``, or a ColBERT folder's vectors for ``kind="colbert"`` (``task``:
    ``lab.outputs.multivector``)."""
    if kind == "colbert":
        p = engine.embed_pass(texts, prompt, output="colbert", task=task)
    elif kind == "token_embeddings":
        p = engine.embed_pass(texts, prompt, "tokens", head=TokensHead(), include=True)
    else:
        dense = windows.dense_pass(
            engine, texts, prompt, head=EmbeddingHead(engine.model.hidden_size, normalize=engine.resolved.normalize)
        )
        return dense.finish(engine.run_passes([dense.run], "encode", show_progress, split=dense.split)[0])
    return engine.run_passes([p], "encode", show_progress)[0]


def encode(
    engine,
    *,
    sentences,
    prompt_name: str | None = None,
    prompt: str | None = None,
    batch_size: int = 32,
    show_progress_bar: bool | None = None,
    output_value=MODEL_DEFAULT,
    precision: str = "float32",
    convert_to_numpy: bool | None = None,
    convert_to_tensor: bool = False,
    device=None,
    normalize_embeddings: bool = False,
    truncate_dim: int | None = None,
    pool=None,
    chunk_size: int | None = None,  # multi-process only: accepted, unused (pool is refused)
    kwargs: dict | None = None,
):
    """``SentenceTransformer.encode`` on ``engine`` (``Engine.encode``'s arguments; ``kwargs``: the rest), over
    ``forward``, which gives the model's sentence embeddings (``(N, dim)`` float32: pooled, normalized when the model
    normalizes) or its token embeddings (a list of ``(L_i, dim)`` float32 tensors); ``MultiVectorEncoder.encode``
    for a ColBERT folder. The model's prompts, default prompt, device, size and knobs (``instruction`` when no
    prompt is given, ``truncate_dim``, ``long_inputs``, ...) are the engine's. See the module docstring for what maps
    to what."""
    batch_size, truncate_dim = plain_scalar(batch_size), plain_scalar(truncate_dim)  # numpy ints from sweeps
    engine_device, dim, default_truncate_dim = engine.device, engine.model.hidden_size, engine.knobs["truncate_dim"]
    multi_vector = engine.spec.multi_vector is not None
    kwargs = dict(kwargs or {})
    if "inputs" in kwargs:  # sentence-transformers >= 5's name for sentences
        if sentences is not None:
            raise TypeError("encode() got both sentences and inputs; pass one")
        sentences = kwargs.pop("inputs")
    if output_value is MODEL_DEFAULT:
        output_value = "token_embeddings" if multi_vector else "sentence_embedding"
    if multi_vector:
        task = kwargs.pop("task", None)
        if task not in (None, "query", "document"):
            raise ValueError(f"task must be 'query', 'document' or None, got {task!r}")
        if convert_to_tensor or precision != "float32":
            raise ValueError(
                "a multi-vector (ColBERT) model returns a list of per-token matrices: there is no "
                "convert_to_tensor (nothing to stack) and no precision (quantize the matrices with "
                "lab.outputs.quantize.quantize_embeddings); drop the argument"
            )
        _check_options(
            batch_size=batch_size,
            output_value=output_value,
            device=device,
            engine_device=engine_device,
            pool=pool,
            kwargs=kwargs,
            values=("token_embeddings",),
        )
        _check_long_inputs(engine, "a ColBERT folder's vectors")
        return _encode_colbert(
            engine,
            sentences,
            call_prompt(engine, prompt, prompt_name),
            task,
            show_progress_bar,
            bool(convert_to_numpy),
            normalize_embeddings,
            truncate_dim,
        )
    convert_to_numpy = True if convert_to_numpy is None else convert_to_numpy
    _check_options(
        batch_size=batch_size,
        output_value=output_value,
        device=device,
        engine_device=engine_device,
        pool=pool,
        kwargs=kwargs,
    )
    text = call_prompt(engine, prompt, prompt_name)
    sentences, single = _sentences(sentences)
    tokens = output_value == "token_embeddings"
    if tokens:
        _check_long_inputs(engine, "output_value='token_embeddings'")
    check_precision(precision, rows=None if tokens else len(sentences))
    if tokens:
        convert_to_tensor = convert_to_numpy = False  # a list of per-text tensors, as sentence-transformers returns
    if convert_to_tensor:
        convert_to_numpy = False
    truncate_dim = default_truncate_dim if truncate_dim is None else truncate_dim
    _check_truncate_dim(truncate_dim)
    if truncate_dim is not None and truncate_dim > dim:
        raise ValueError(f"truncate_dim={truncate_dim} exceeds the embedding size {dim}")
    if not sentences:  # sentence-transformers' empty results
        return (
            []
            if not (convert_to_numpy or convert_to_tensor)
            else (torch.tensor([]) if convert_to_tensor else np.array([]))
        )
    out = forward(engine, sentences, text, output_value, show_progress_bar)
    if tokens:  # tensors, or numpy arrays once quantized (as sentence-transformers returns them)
        mats = [torch.as_tensor(np.asarray(m)) for m in out]
        if precision != "float32":
            mats = quantize_embeddings([m.numpy() for m in mats], precision)
        return mats[0] if single else mats
    emb = torch.as_tensor(np.asarray(out, dtype=np.float32))
    if truncate_dim is not None:
        emb = emb[:, :truncate_dim]
    if normalize_embeddings:
        emb = F.normalize(emb, p=2, dim=1)
    result = emb.numpy() if precision == "float32" or len(emb) == 0 else quantize_embeddings(emb, precision)
    if convert_to_tensor:
        result = torch.as_tensor(result)
    elif not convert_to_numpy:
        result = list(torch.as_tensor(result))
    return result[0] if single else result


def _encode_colbert(engine, sentences, prompt, task, show_progress_bar, convert_to_numpy, normalize, truncate_dim):
    """``MultiVectorEncoder.encode``'s results from ``forward(engine, texts, prompt, "colbert", show_progress,
    task)``."""
    sentences, single = _sentences(sentences)
    _check_truncate_dim(truncate_dim)
    mats = (
        [torch.as_tensor(m) for m in forward(engine, sentences, prompt, "colbert", show_progress_bar, task)]
        if sentences
        else []
    )
    if normalize:
        mats = [F.normalize(m, p=2, dim=-1) for m in mats]
    if truncate_dim is not None:
        mats = [F.normalize(m[..., :truncate_dim], p=2, dim=-1) for m in mats]
    out = [m.numpy() for m in mats] if convert_to_numpy else mats
    return out[0] if single else out
