"""Scoring and reranking (query, document) pairs with one ``Engine``: cross-encoders, LLM yes/no rerankers and
bi-encoders.

The modes are a registry (``SCORE_MODES``, name -> ``ScoreMode``: its check on the engine, the job it builds, the
options it takes); ``score(mode=...)`` takes its names, its errors list them, ``register_mode`` adds one.

Which mode runs (``default_mode``; ``mode=`` overrides it):

- ``cross-encoder``: the model has a sequence-classification head (``BertForSequenceClassification``,
  ``XLMRobertaForSequenceClassification`` such as bge-reranker-v2-m3, ...). Each pair is packed as one sequence
  (``[CLS] query [SEP] document [SEP]`` with token type ids, cut longest-first at ``max_length``), the first token's
  hidden state goes through the head; the default activation is the one ``sentence_transformers.CrossEncoder``
  uses for the checkpoint (its saved ``activation_fn``, else sigmoid for one label and identity for several).
- ``llm``: a decoder with LM logits and no sentence-transformers pooling config (an instruct / reranker LLM such as
  Qwen3-Reranker, not an embedding model). Each pair fills a prompt (``YesNoPrompt``; the tokenizer's chat template
  when it has one) and the score is ``softmax(logit_yes, logit_no)[yes]`` at the last position, as Qwen3-Reranker
  computes it. The prompt is tokenized as one string (so tokens equal those of the full text); only the ends of the
  document and query are cut to fit ``max_length``, longest first (the tokenizer's pair truncation: in practice
  the document) -- never the template, whose suffix is where the score is read.
  Pairs share the prompt's head, which the prefix cache computes once under causal attention.
- ``bi-encoder``: anything else. Queries and documents are embedded apart (each distinct text once) and scored by
  cosine similarity (or ``similarity="dot"``), so every embedding model can rerank too.
- ``late-interaction``, ``sparse``, ``m3`` (chosen with ``mode=``; models with the heads, ``lab.outputs.kinds``):
  queries and documents embedded apart as for ``bi-encoder``, one forward per side, scored (``lab.outputs.scoring``)
  by ColBERT MaxSim (FlagEmbedding's ``colbert_score``), by the dot product of lexical weights on shared token ids,
  or by bge-m3's weighted sum of the dense dot product, the sparse and the ColBERT score
  (``M3Embedder.compute_score``'s ``colbert+sparse+dense`` with its default weights, ``M3_WEIGHTS``).

The engine's knobs, per mode:

- ``bi-encoder``: every embedding knob, as ``Engine.embed`` applies it to each side (queries take the ``instruction``,
  documents none); ``long_inputs="chunk"`` splits a long query or document into windows whose vectors are averaged
  (``lab.engine.windows.dense_pass``), so the score is the cosine of the vectors ``embed`` gives.
- ``cross-encoder`` / ``llm``: a pair is one sequence whose score is read at one token (the classification head's
  first token, the yes/no logits at the last), so ``pooling``, ``normalize``, ``truncate_dim`` and
  ``include_instruction`` do not apply; ``instruction`` is prepended to the query (cross-encoder) or fills the
  prompt's ``{instruction}`` slot (llm); ``max_length``, ``layer``, ``dtype``, ``bidirectional`` and
  ``chunked_prefill`` apply to the forward. ``long_inputs="chunk"`` has no sound rule for one pair's windows (a
  score is not an average of its windows' scores), so a pair past ``max_length`` is refused under it, naming
  ``long_inputs`` and ``max_length``; pairs that fit score as under ``truncate``.
- ``late-interaction`` / ``sparse`` / ``m3``: per-token and lexical outputs have no window average, so
  ``long_inputs="chunk"`` is refused, as ``Engine.embed`` refuses those outputs under it.

``activation``: ``"default"`` (above; the bi-encoder's default is the raw similarity), ``None`` for raw scores
(head logits, ``logit_yes - logit_no``, or the similarity), ``"sigmoid"``, ``"softmax"`` (over labels), ``"tanh"``.

    >>> eng.score([("How many people live in Berlin?", "Berlin has 3.5M people."), ("...", "...")])   # (2,)
    >>> eng.rerank("How many people live in Berlin?", docs, top_k=3)       # DataFrame: rank, index, score, document
    >>> eng.score(pairs, mode="llm", prompt=YesNoPrompt(yes_token="Yes", no_token="No"))
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lab._warn import warn
from lab.engine.call import Pass
from lab.engine.inputs import InputProcessor, Request, check_encodable, check_texts
from lab.engine.windows import dense_pass
from lab.outputs.heads import ACTIVATIONS as HEAD_ACTIVATIONS
from lab.outputs.heads import ClassifierHead, Pooler, YesNoHead, activate
from lab.outputs.kinds import check_outputs
from lab.outputs.pooling import pooling_method
from lab.outputs.scoring import SCORE_OUTPUTS, pair_scores

ACTIVATIONS = ("default", *HEAD_ACTIVATIONS)  # "default": the mode's own (module doc)
SIMILARITIES = ("cosine", "dot")

# sentence-transformers stores a CrossEncoder's activation as a torch class path; the ones we apply ourselves
_ST_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": None, "Softmax": "softmax", "Tanh": "tanh"}


# ------------------------------------------------------------------------------------------------- validation
def check_pairs(pairs) -> tuple[list[str], list[str]]:
    """``[(query, document), ...]`` -> (queries, documents); errors name the bad index."""
    if isinstance(pairs, (str, bytes)):
        raise TypeError("pairs must be a list of (query, document) string pairs, got a single str")
    if not isinstance(pairs, Sequence):
        try:
            pairs = list(pairs)
        except TypeError:
            raise TypeError(f"pairs must be a list of (query, document) pairs, got {type(pairs).__name__}") from None
    queries, documents = [], []
    for i, p in enumerate(pairs):
        if not isinstance(p, (tuple, list, np.ndarray)) or len(p) != 2:
            what = (
                f"a {type(p).__name__} of length {len(p)}"
                if isinstance(p, (tuple, list, np.ndarray))
                else f"a {type(p).__name__}"
            )
            hint = " (to score one pair, wrap it: [(query, document)])" if isinstance(p, str) else ""
            raise TypeError(f"pairs[{i}] must be a (query, document) pair of two strings, got {what}{hint}")
        for j, part in enumerate(("query", "document")):
            if not isinstance(p[j], str):
                raise TypeError(f"pairs[{i}]'s {part} is {type(p[j]).__name__}, not str")
            check_encodable(p[j], f"pairs[{i}]'s {part}")
        queries.append(str(p[0]))
        documents.append(str(p[1]))
    return queries, documents


def check_top_k(top_k) -> int | None:
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k must be an int >= 1 or None, got {type(top_k).__name__}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for every document), got {top_k}")
    return int(top_k)


# ------------------------------------------------------------------------------------------------------ modes
def has_lm_head(engine) -> bool:
    return bool(engine.is_decoder and engine.model.has_lm_head)


def default_mode(engine) -> str:
    """``cross-encoder`` with a classification head; ``llm`` for a decoder with LM logits that the folders do not
    declare an embedding model (no sentence-transformers pooling config, not an LLM2Vec layout); else
    ``bi-encoder``."""
    if engine.is_cross_encoder:
        return "cross-encoder"
    if has_lm_head(engine) and engine.spec.pooling is None and not engine.llm2vec.recognized:
        return "llm"
    return "bi-encoder"


def resolve_mode(engine, mode: str | None) -> str:
    """``mode`` checked against ``SCORE_MODES`` and this engine (the mode's ``check``), or the default."""
    if mode is None:
        return default_mode(engine)
    if mode not in SCORE_MODES:
        raise ValueError(
            f"unknown mode {mode!r}; valid: {', '.join(map(repr, SCORE_MODES))} (or None for the default)"
        )
    SCORE_MODES[mode].check(engine)
    return mode


def _check_cross_encoder(engine) -> None:
    if not engine.is_cross_encoder:
        raise ValueError(
            f"{engine.model_name} has no sequence-classification head, so it cannot score as a cross-encoder. "
            "Use mode='bi-encoder' (embedding similarity)"
            + (" or mode='llm' (yes/no prompt)" if has_lm_head(engine) else "")
            + ", or load a *ForSequenceClassification checkpoint (a cross-encoder / reranker)"
        )


def _check_llm(engine) -> None:
    if not has_lm_head(engine):
        why = "it is not a decoder LLM" if not engine.is_decoder else "this checkpoint has no LM head weights"
        raise ValueError(
            f"mode='llm' needs a decoder with LM logits, but {why} ({engine.spec.architecture}); "
            f"use mode={default_mode(engine)!r}"
        )


def _outputs_check(mode: str) -> Callable[[object], None]:
    def check(engine) -> None:
        check_outputs(SCORE_OUTPUTS[mode], engine.model, engine.spec, purpose=f"mode={mode!r}")

    return check


# ------------------------------------------------------------------------------------------------ activation
def cross_encoder_activation(config: dict, num_labels: int) -> str | None:
    """The activation ``CrossEncoder.predict`` applies by default: the saved one, else sigmoid for one label."""
    saved = (config.get("sentence_transformers") or {}).get("activation_fn")
    saved = saved or config.get("sbert_ce_default_activation_function")
    if saved:
        name = str(saved).rsplit(".", 1)[-1]
        if name in _ST_ACTIVATIONS:
            return _ST_ACTIVATIONS[name]
        warn(
            f"the checkpoint's activation_fn {saved!r} is not one of {sorted(_ST_ACTIVATIONS)}; using "
            "sentence-transformers' default instead (pass activation= to choose)",
        )
    return "sigmoid" if num_labels == 1 else None


# ----------------------------------------------------------------------------------------------------- prompts
DEFAULT_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
DEFAULT_TEMPLATE = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
PLAIN_FRAME = "{system}\n\n{user}\n\nAnswer (yes or no):\n"  # when the tokenizer has no chat template


@dataclass(frozen=True)
class YesNoPrompt:
    """The prompt of an LLM yes/no reranker (defaults: Qwen3-Reranker's).

    ``template`` is the user message with ``{query}``, ``{document}`` and optionally ``{instruction}`` slots;
    ``system`` the system message. ``chat_template``: ``None`` = the tokenizer's chat template when it has one
    (system + user message, generation prompt added; Qwen3's thinking turned off), ``False`` = ``PLAIN_FRAME``.
    ``yes_token`` / ``no_token``: vocabulary entries (or ids) whose logits are compared at the last position.
    """

    system: str = DEFAULT_SYSTEM
    instruction: str = DEFAULT_INSTRUCTION
    template: str = DEFAULT_TEMPLATE
    yes_token: str | int = "yes"
    no_token: str | int = "no"
    chat_template: bool | None = None


_SLOT = re.compile(r"\{(query|document)\}")


def render(prompt: YesNoPrompt, tokenizer, instruction: str) -> tuple[str, bool]:
    """The full prompt text with literal ``{query}`` / ``{document}`` slots left in it, and whether it came from
    the tokenizer's chat template."""
    user = prompt.template.replace("{instruction}", instruction)
    for slot in ("{query}", "{document}"):
        if user.count(slot) != 1:
            raise ValueError(f"YesNoPrompt.template must contain {slot} exactly once: {prompt.template!r}")
    use_chat = prompt.chat_template
    if use_chat is None:
        use_chat = bool(getattr(tokenizer, "chat_template", None))
    if not use_chat:
        return (PLAIN_FRAME.format(system=prompt.system, user=user) if prompt.system else user + "\n"), False
    import jinja2

    kw = {"tokenize": False, "add_generation_prompt": True, "enable_thinking": False}
    messages = [{"role": "user", "content": user}]
    if prompt.system:
        try:
            system = [{"role": "system", "content": prompt.system}]
            return tokenizer.apply_chat_template(system + messages, **kw), True
        except jinja2.TemplateError:  # templates without a system role (Gemma): system text leads the user turn
            messages = [{"role": "user", "content": f"{prompt.system}\n\n{user}"}]
    return tokenizer.apply_chat_template(messages, **kw), True


def token_id(tokenizer, token: str | int, name: str) -> int:
    """A vocabulary entry (``"yes"``, ``"Ġyes"``) or text that is exactly one token, or an id."""
    if isinstance(token, (int, np.integer)) and not isinstance(token, bool):
        if not 0 <= token < len(tokenizer):
            raise ValueError(f"{name}={token} is outside the vocabulary (size {len(tokenizer)})")
        return int(token)
    vocab_id = tokenizer.convert_tokens_to_ids(token)
    if vocab_id is not None and vocab_id != tokenizer.unk_token_id:
        return int(vocab_id)
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise ValueError(
            f"{name}={token!r} is not a single token of this tokenizer (it tokenizes to {pieces}); "
            "pass a vocabulary entry or a token id"
        )
    return int(ids[0])


class YesNoLayout:
    """Tokenizes filled prompts and cuts the document / query ends to fit ``max_length``, keeping the template's
    head and suffix. Token ids equal ``tokenizer(full prompt text)`` whenever nothing is cut."""

    def __init__(self, tokenizer, prompt: YesNoPrompt, instruction: str, max_length: int):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("LLM reranking needs a fast tokenizer (tokenizer.json): it maps tokens to characters")
        self.tokenizer, self.max_length = tokenizer, max_length
        text, chat = render(prompt, tokenizer, instruction)
        parts = _SLOT.split(text)  # [const, slot, const, slot, const]
        self.consts, self.slots = parts[0::2], parts[1::2]
        if sorted(self.slots) != ["document", "query"]:
            raise ValueError(f"the rendered prompt must hold {{query}} and {{document}} once each, got {text!r}")
        self.yes_id = token_id(tokenizer, prompt.yes_token, "yes_token")
        self.no_id = token_id(tokenizer, prompt.no_token, "no_token")
        # a plain template gets the BOS the tokenizer would add (Llama, Gemma); chat templates write their own
        bos = tokenizer.bos_token_id
        self.bos = [bos] if (not chat and bos is not None and tokenizer("x")["input_ids"][:1] == [bos]) else []

    def requests(self, queries: list[str], documents: list[str], first_index: int = 0) -> list[Request]:
        """One ``Request`` per pair; ``pool_start`` = the tokens before the first slot (the shared head)."""
        texts, spans = [], []
        for q, d in zip(queries, documents):
            fill = {"query": q, "document": d}
            pieces, span, pos = [], {}, 0
            for i, const in enumerate(self.consts):
                pieces.append(const)
                pos += len(const)
                if i < len(self.slots):
                    s = fill[self.slots[i]]
                    span[self.slots[i]] = (pos, pos + len(s))
                    pieces.append(s)
                    pos += len(s)
            texts.append("".join(pieces))
            spans.append(span)
        enc = self.tokenizer(
            texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False, verbose=False
        )
        out = []
        for i, (ids, offsets, span) in enumerate(zip(enc["input_ids"], enc["offset_mapping"], spans)):
            ids = np.asarray(self.bos + ids, dtype=np.int64)
            starts = np.asarray([-1] * len(self.bos) + [a for a, _ in offsets], dtype=np.int64)
            head = int(np.searchsorted(starts, min(a for a, _ in span.values()), side="left"))
            keep, cut = self._fit(ids, starts, span)
            if cut:
                ids = ids[keep]
            out.append(Request(index=first_index + i, ids=ids, pool_start=min(head, len(ids) - 1), truncated=cut))
        return out

    def _fit(self, ids: np.ndarray, starts: np.ndarray, span: dict) -> tuple[np.ndarray, bool]:
        """Mask of tokens to keep: cut the ends of the query and document longest-first (the tokenizer's pair
        truncation: in practice the document) until ``max_length`` fits; the template is never cut."""
        over = len(ids) - self.max_length
        keep = np.ones(len(ids), dtype=bool)
        if over <= 0:
            return keep, False
        inside = {slot: np.nonzero((starts >= a) & (starts < b))[0] for slot, (a, b) in span.items()}
        nq, nd = len(inside["query"]), len(inside["document"])
        if over > nq + nd:
            raise ValueError(
                f"the prompt without query and document is {len(ids) - nq - nd} tokens, over "
                f"max_length={self.max_length}; raise max_length or shorten the YesNoPrompt"
            )
        total = nq + nd - over  # tokens of query + document that fit
        if nd - over >= nq:
            keep_d, keep_q = nd - over, nq
        elif nq - over >= nd:
            keep_d, keep_q = nd, nq - over
        else:  # both cut to about half; a tie is taken from the document, as transformers does
            keep_d = total // 2
            keep_q = total - keep_d
        keep[inside["document"][keep_d:]] = False
        keep[inside["query"][keep_q:]] = False
        return keep, True


# ------------------------------------------------------------------------------------------------- scoring
@dataclass(frozen=True)
class ScoreJob:
    """What ``Engine.score`` runs: ``passes`` (one for cross-encoder / LLM scoring; queries and documents for a
    bi-encoder) and ``combine``, which turns their outputs into scores in pair order."""

    passes: list[Pass]
    combine: Callable[[list], np.ndarray]
    split: int = 0  # inputs cut into windows (long_inputs="chunk"; Engine.run_passes' split=)


def score_job(
    engine,
    pairs,
    *,
    mode: str | None = None,
    activation="default",
    instruction: str | None = None,
    prompt: YesNoPrompt | None = None,
    similarity: str = "cosine",
) -> ScoreJob:
    """The passes and the combination that score ``pairs`` (``Engine.score``): everything is checked here, before
    any model work. The bi-encoder, late-interaction, sparse and m3 modes embed through the engine's public
    ``Engine.embed_pass``."""
    queries, documents = check_pairs(pairs)
    mode = resolve_mode(engine, mode)
    kind = SCORE_MODES[mode]
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; valid: {', '.join(map(repr, ACTIVATIONS))}")
    if prompt is not None and "prompt" not in kind.takes:
        raise ValueError(f"prompt= is for {_modes_taking('prompt')}; this call scores in mode={mode!r}")
    if similarity not in SIMILARITIES:
        raise ValueError(f"unknown similarity {similarity!r}; valid: {', '.join(SIMILARITIES)}")
    if similarity != "cosine" and "similarity" not in kind.takes:
        raise ValueError(
            f"similarity={similarity!r} is for {_modes_taking('similarity')}; this call scores in mode={mode!r}"
        )
    if activation == "softmax" and "softmax" not in kind.takes:
        raise ValueError(f"activation='softmax' needs several scores per pair; mode={mode!r} gives one")
    return kind.job(
        engine,
        mode,
        queries,
        documents,
        activation=activation,
        instruction=instruction,
        prompt=prompt,
        similarity=similarity,
    )


def _llm_job(engine, mode, queries, documents, *, activation, instruction, prompt, similarity) -> ScoreJob:
    """``query`` and ``document`` in a yes/no prompt; ``logit(yes) - logit(no)`` at the last token."""
    prompt = prompt or YesNoPrompt()
    layout = YesNoLayout(engine.tokenizer, prompt, instruction or prompt.instruction, engine.resolved.max_length)
    # the default is sigmoid(logit_yes - logit_no) == softmax over (yes, no): the yes probability
    head = YesNoHead(
        engine.model.lm_logits, layout.yes_id, layout.no_id, "sigmoid" if activation == "default" else activation
    )

    def tokenize(chunk: list[int], first: int) -> list[Request]:
        return layout.requests([queries[i] for i in chunk], [documents[i] for i in chunk], first_index=first)

    # every prompt starts with the same template: the prefix cache computes it once under causal attention
    return ScoreJob(
        [
            _pair_pass(
                engine,
                mode,
                list(range(len(queries))),
                tokenize,
                Pooler(pooling_method("lasttoken"), head),
                shared_prefix=True,
            )
        ],
        lambda outs: outs[0],
    )


def _cross_encoder_job(engine, mode, queries, documents, *, activation, instruction, prompt, similarity) -> ScoreJob:
    """``[CLS] query [SEP] document [SEP]`` sequences, first token through the classification head."""
    index = list(range(len(queries)))
    classifier = engine.model.classifier
    labels = classifier.num_labels
    default = cross_encoder_activation(engine.spec.config, labels)
    head = ClassifierHead(classifier, labels, default if activation == "default" else activation)
    if instruction:
        queries = [instruction + q for q in queries]
    proc = InputProcessor(engine.tokenizer, engine.resolved.max_length)  # the tokenizer adds [CLS] / [SEP] itself

    def tokenize(chunk: list[int], first: int) -> list[Request]:
        return proc.process([queries[i] for i in chunk], pairs=[documents[i] for i in chunk], first_index=first)

    def combine(outs: list) -> np.ndarray:
        return outs[0][:, 0] if labels == 1 else outs[0]

    return ScoreJob(
        [_pair_pass(engine, "cross-encoder", index, tokenize, Pooler(pooling_method("cls"), head))], combine
    )


def _pair_pass(engine, mode: str, index: list[int], tokenize, pooler: Pooler, *, shared_prefix: bool = False) -> Pass:
    """The pass of one-sequence-per-pair scoring. Under ``long_inputs="chunk"`` every pair is tokenized first and
    a pair past ``max_length`` is refused before any model work (see the module docstring); ``truncate`` cuts it."""
    if engine.knobs["long_inputs"] != "chunk":
        return Pass(index, tokenize, pooler, shared_prefix=shared_prefix)
    requests = tokenize(index, 0)
    long = [r.index for r in requests if r.truncated]
    if long:
        raise ValueError(
            f"long_inputs='chunk' does not apply to mode={mode!r}: a (query, document) pair is scored as one sequence "
            f"and a score is not an average of its windows' scores, but pairs[{long[0]}] ({len(long)} pair(s) in all) "
            f"is longer than max_length={engine.resolved.max_length} tokens. Set long_inputs='truncate' to cut "
            "such pairs (longest side first), raise max_length, or shorten the document"
        )
    return Pass(requests, lambda chunk, first: chunk, pooler, shared_prefix=shared_prefix)


def _bi_encoder_job(engine, mode, queries, documents, *, activation, instruction, prompt, similarity) -> ScoreJob:
    """Cosine (or dot) similarity of each query's and document's embeddings; distinct texts embed once, queries
    with ``instruction`` (attended, pooled per the ``include_instruction`` knob), documents without, each side as
    ``Engine.embed`` embeds it under the ``long_inputs`` knob (``lab.engine.windows.dense_pass``)."""
    activation = None if activation == "default" else activation
    uq, ud = list(dict.fromkeys(queries)), list(dict.fromkeys(documents))
    qi, di = {t: i for i, t in enumerate(uq)}, {t: i for i, t in enumerate(ud)}

    def combine(outs: list) -> np.ndarray:
        a = torch.from_numpy(outs[0][[qi[q] for q in queries]])  # (N, dim)
        b = torch.from_numpy(outs[1][[di[d] for d in documents]])
        if similarity == "cosine":
            a, b = torch.nn.functional.normalize(a, dim=-1), torch.nn.functional.normalize(b, dim=-1)
        return activate((a * b).sum(-1), activation).numpy()

    sides = [dense_pass(engine, uq, instruction), dense_pass(engine, ud, None)]
    return ScoreJob(
        [side.run for side in sides],
        lambda outs: combine([s.finish(o) for s, o in zip(sides, outs)]),
        split=sum(side.split for side in sides),
    )


def _outputs_job(engine, mode, queries, documents, *, activation, instruction, prompt, similarity) -> ScoreJob:
    """``late-interaction`` / ``sparse`` / ``m3``: the outputs the mode reads (``lab.outputs.scoring.SCORE_OUTPUTS``),
    one forward per side over the distinct texts (queries with ``instruction``), scored per pair."""
    if engine.knobs["long_inputs"] == "chunk":
        raise ValueError(
            f"long_inputs='chunk' averages one dense vector per window, but mode={mode!r} scores "
            f"per-token or lexical outputs ({', '.join(SCORE_OUTPUTS[mode])}), which have no window "
            "average; set long_inputs='truncate' for this mode (inputs are then cut at "
            f"max_length={engine.resolved.max_length})"
        )
    activation = None if activation == "default" else activation
    uq, ud = list(dict.fromkeys(queries)), list(dict.fromkeys(documents))
    qi, di = {t: i for i, t in enumerate(uq)}, {t: i for i, t in enumerate(ud)}
    outputs = SCORE_OUTPUTS[mode]

    def combine(outs: list) -> np.ndarray:
        q, d = outs  # dicts of outputs by name
        scores = pair_scores(mode, q, d, [qi[x] for x in queries], [di[x] for x in documents])
        return activate(torch.from_numpy(scores), activation).numpy()

    return ScoreJob(
        [engine.embed_pass(uq, instruction, output=outputs), engine.embed_pass(ud, None, output=outputs)], combine
    )


# ------------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class ScoreMode:
    """One way ``Engine.score`` scores pairs: ``check(engine)`` raises ``ValueError`` naming what this engine
    lacks for it; ``job(engine, mode, queries, documents, *, activation, instruction, prompt, similarity)`` builds
    its ``ScoreJob``; ``takes``: the options beyond ``activation`` that apply (``prompt``, ``similarity``,
    ``softmax``: several scores per pair)."""

    name: str
    check: Callable[[object], None]
    job: Callable[..., ScoreJob]
    takes: frozenset[str] = frozenset()


SCORE_MODES: dict[str, ScoreMode] = {}  # name -> mode: the values of ``score(mode=...)``, in the order errors list


def register_mode(mode: ScoreMode) -> ScoreMode:
    """Add ``mode`` to ``SCORE_MODES``: ``Engine.score(pairs, mode=mode.name)`` then runs it. Returns it."""
    if not isinstance(mode, ScoreMode):
        raise TypeError(f"a score mode must be a lab.engine.rerank.ScoreMode, got {type(mode).__name__}")
    SCORE_MODES[mode.name] = mode
    return mode


def _modes_taking(option: str) -> str:
    return " / ".join(f"mode={name!r}" for name, m in SCORE_MODES.items() if option in m.takes)


register_mode(ScoreMode("cross-encoder", _check_cross_encoder, _cross_encoder_job, frozenset({"softmax"})))
register_mode(ScoreMode("llm", _check_llm, _llm_job, frozenset({"prompt", "softmax"})))
register_mode(ScoreMode("bi-encoder", lambda engine: None, _bi_encoder_job, frozenset({"similarity"})))
for _name in SCORE_OUTPUTS:  # the modes that read embed outputs (lab.outputs.scoring)
    register_mode(ScoreMode(_name, _outputs_check(_name), _outputs_job))


def rerank(engine, query: str, documents, *, top_k: int | None = None, **score_kwargs):
    """Documents sorted best first: a DataFrame with ``rank`` (1 = best), ``index`` (into ``documents``),
    ``score`` and ``document``; ``top_k`` keeps the best ``k``. ``df.attrs["mode"]`` says how it scored."""
    import pandas as pd

    if not isinstance(query, str):
        raise TypeError(f"query must be a string, got {type(query).__name__}")
    documents = check_texts(documents, "documents")
    if not documents:
        raise ValueError("documents is empty; rerank needs at least one document")
    top_k = check_top_k(top_k)
    mode = resolve_mode(engine, score_kwargs.pop("mode", None))
    scores = engine.score([(query, d) for d in documents], mode=mode, **score_kwargs)
    if scores.ndim != 1:
        raise ValueError(
            f"rerank needs one score per document, but this model has {scores.shape[1]} labels; use "
            "score(...) and choose a label column (or activation='softmax' and a column)"
        )
    order = np.argsort(-scores, kind="stable")[:top_k]
    df = pd.DataFrame(
        {
            "rank": np.arange(1, len(order) + 1),
            "index": order,
            "score": scores[order],
            "document": [documents[i] for i in order],
        }
    )
    df.attrs["mode"] = mode
    return df
