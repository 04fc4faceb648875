"""How an engine's texts become a ``Pass`` (``lab.engine.call``): the input processor, the framing, the embedding
head and the pooler, all read from the engine's resolved knobs (``Engine.resolved``); and how passes run as one call
(``run_passes``: waves tokenized ahead, the executor's steps, the outputs placed in input order, one ``Stats``).

``Engine.embed_pass`` is ``embed_pass`` here; ``lab.engine.windows`` and ``lab.engine.rerank`` build their passes from
the same parts, so every call kind tokenizes, frames and pools as ``embed`` does.

    >>> p = embed_pass(eng, texts, instruction=None)           # the pass eng.embed(texts) runs
    >>> eng.run_passes([p], "embed")[0]                        # (len(texts), dim) float32
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lab.engine import framing
from lab.engine.call import Call, ExecSettings, OutputBuffer, Pass, Stats
from lab.engine.inputs import InputProcessor, Request
from lab.engine.knobs import Resolved
from lab.engine.scheduler import WAVE_SIZE, prefetch_waves
from lab.outputs import kinds as outputs
from lab.outputs import multivector
from lab.outputs.heads import EmbeddingHead, Pooler
from lab.outputs.kinds import output_pooler
from lab.outputs.pooling import pooling_method
from lab.outputs.quantize import check_precision


def processor(engine, r: Resolved, max_length: int | None = None) -> InputProcessor:
    """The engine's input processor under ``r`` (``max_length``: a per-call cap instead of the engine's)."""
    return InputProcessor(engine.tokenizer, max_length or r.max_length, append_eos=r.append_eos)


def framing_for(engine, r: Resolved) -> framing.Framing:
    """How the engine's inputs are framed under ``r`` (rule, template, chat template, EOS text;
    ``lab.engine.framing``)."""
    name = engine.llm2vec.name
    names = [name] if name else []
    eos = framing.eos_text(names, engine.spec.config.get("model_type")) if r.pooling == "eos_token" else ""
    return framing.Framing(
        rule=r.instruction_pooling,
        template=r.template,
        eos=eos,
        chat=framing.chat_template(names) if r.instruction_pooling == "llm2vec" else None,
    )


def embedding_head(engine, r: Resolved) -> EmbeddingHead:
    """The engine's embedding head: matryoshka ``truncate_dim``, then normalize as ``r`` says."""
    return EmbeddingHead(engine.model.hidden_size, truncate_dim=r.truncate_dim, normalize=r.normalize)


def embed_pass(
    engine,
    texts: list[str],
    instruction: str | None,
    pooling: str | None = None,
    *,
    head=None,
    include: bool | None = None,
    output="dense",
    task: str | None = None,
    instructions: list[str] | None = None,
) -> Pass:
    """The pass ``embed`` runs over ``texts`` with ``instruction`` (a resolved instruction text or ``None``), for
    ``run_passes`` (``Engine.embed_pass``). ``pooling``: a method name, default the engine's; ``head``: a
    ``lab.outputs.heads.Head``, default the engine's ``EmbeddingHead``; ``include``: pool the instruction, default
    ``include_instruction``; ``output``: as ``embed``'s, checked here; ``task``: a ColBERT folder's,
    ``lab.outputs.multivector``, which then sets the lengths, the query expansion and pools the prompt;
    ``instructions``: one per text (``[instruction, text]`` inputs), replacing ``instruction``."""
    r = engine.resolved
    names = outputs.parse_output(output)[0]
    mv = engine.spec.multi_vector if "colbert" in names else None
    proc = processor(
        engine, r, None if mv is None else multivector.max_length(mv, task, r.max_length, engine.knobs["max_length"])
    )
    include = True if mv is not None else r.include_instruction if include is None else include
    method = pooling_method(framing.kernel_pooling(pooling or r.pooling))
    if r.template is not None and set(names) - {"dense", "tokens"}:
        raise ValueError(
            f"the template knob applies to dense and token outputs, not output={output!r}; set "
            "template=None for sparse / ColBERT outputs"
        )
    proc.framing = framing_for(engine, r)
    pooler = output_pooler(
        output,
        Pooler(method, embedding_head(engine, r) if head is None else head),
        model=engine.model,
        spec=engine.spec,
        tokenizer=engine.tokenizer,
        task=task,
    )
    expand = mv is not None and task == "query" and mv.query_expansion is not None
    if expand:
        fill = multivector.expansion_token_id(mv, engine.tokenizer, causal=r.causal)

    def tokenize(chunk: list[str], first: int) -> list[Request]:
        per_item = None if instructions is None else instructions[first : first + len(chunk)]
        reqs = proc.process(
            engine.cut_documents(chunk),
            first_index=first,
            instruction=instruction,
            include_instruction=include,
            instructions=per_item,
        )
        return multivector.expand(reqs, mv, fill) if expand else reqs

    prefixed = instruction or instructions is not None or r.template is not None
    return Pass(texts, tokenize, pooler, shared_prefix=bool(prefixed and not include))


def check_embed(rows: int, output, precision: str, long_inputs: str, *, per_item_instructions: bool) -> None:
    """``Engine.embed``'s argument checks, before any work: the outputs and ``precision`` go together, and
    ``long_inputs='chunk'`` (one dense vector averaged over windows) has dense outputs and one instruction."""
    names = outputs.parse_output(output)[0]
    check_precision(precision, rows=rows if names == ("dense",) else None)
    if precision != "float32" and "sparse" in names:
        raise ValueError(
            "precision applies to dense, token and ColBERT vectors, not to sparse weights; ask for "
            "output='sparse' separately with precision='float32'"
        )
    if long_inputs == "chunk" and names != ("dense",):
        raise ValueError(
            f"long_inputs='chunk' averages one dense vector per window; output={output!r} needs "
            "long_inputs='truncate' (or embed_chunks for vectors per span of a long document)"
        )
    if per_item_instructions and long_inputs == "chunk":
        raise ValueError(
            "[instruction, text] inputs need long_inputs='truncate' (windows of a split input share "
            "one instruction); pass instruction=... with plain texts instead"
        )


def exec_settings(knobs: Mapping, r: Resolved, items: int) -> ExecSettings:
    """How the executor runs a call of ``items`` inputs under the knobs in force and what they resolve to (``r``)."""
    return ExecSettings(
        causal=r.causal,
        backend=r.attention_backend,
        workers=r.cpu_workers,
        num_layers=r.layer,
        max_batch_tokens=knobs["max_batch_tokens"],
        max_num_seqs=knobs["max_num_seqs"],
        chunked_prefill=knobs["chunked_prefill"],
        prefix_cache=knobs["prefix_cache"],
        items=items,
    )


def run_passes(
    engine, passes: list[Pass], desc: str, show_progress: bool | None, *, split: int, warned: set
) -> tuple[list, Stats]:
    """``Engine.run_passes``: each pass's outputs in its input order, and the call's ``Stats`` (``warned``: the
    engine's record of the truncations and splits it has warned about, per ``max_length``; ``lab.engine.call``)."""
    r = engine.resolved
    items = sum(len(p.items) for p in passes)
    settings = exec_settings(engine.knobs, r, items)
    stats = Stats(
        path="packed" if engine.model.packed else "transformers-fallback (padded)",
        backend=r.attention_backend,
        adapters=tuple(r.adapters),
        split=split,
        model=engine.model_name,
        revision=engine.revision,
    )
    results = []
    call = Call(stats, total=items, desc=desc, show_progress=show_progress, warned=warned, max_length=r.max_length)
    with call, torch.inference_mode():
        for p in passes:
            out = OutputBuffer(len(p.items), p.pooler.shape)
            for requests in prefetch_waves(p.items, p.tokenize, WAVE_SIZE):
                for reqs, rows in engine.executor.run(
                    requests, p.pooler, settings, stats, shared_prefix=p.shared_prefix
                ):
                    out.place(reqs, rows)
                    call.served(reqs)
            results.append(out.result())
    return results, stats
