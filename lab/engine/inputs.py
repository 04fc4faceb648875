"""Input processing: validation, tokenization, instructions and truncation records -> ``Request`` objects.

Truncation follows sentence-transformers (the tokenizer's own ``truncation=True`` at ``max_length``, so special
tokens survive). Whether an input was cut is found by tokenizing at ``max_length + 1`` first: only the inputs that
really overflow are tokenized again, so nothing is tokenized twice in the common case and every cut is counted.

An instruction is prepended to the text; its tokens are attended to but excluded from pooling (``pool_start``),
as llm2vec's embed mask and sentence-transformers' ``include_prompt=False`` do.

    >>> proc = InputProcessor(tokenizer, max_length=256)
    >>> reqs = proc.process(["a text", "another"], first_index=0)
    >>> batch = pack(reqs, causal=False, device=torch.device("cpu"), backend="torch")    # one flat step
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lab.engine.framing import Framing
from lab.ops.batch import KVStep, PackedBatch


@dataclass
class Request:
    """One input after tokenization. ``index`` is its position in the caller's list."""

    index: int
    ids: np.ndarray  # (L,) int64
    token_type_ids: np.ndarray | None = None
    pool_start: int = 0  # tokens before this are an instruction: attended, not pooled
    truncated: bool = False
    key_len: int | None = None  # only the first key_len tokens are attended to (None: all; lab.outputs.multivector)
    pool_end: int | None = None  # the pooled span ends here (None: at the sequence's end; a ``template``'s text)

    @property
    def length(self) -> int:
        return len(self.ids)


def pack(
    requests: list[Request], *, causal: bool, device, backend: str, skip: int = 0, kv: KVStep | None = None
) -> PackedBatch:
    """The flat model inputs of ``requests`` on ``device``, the one packing rule of both execution paths: each
    request's tokens after its first ``skip`` (a shared prefix computed elsewhere, whose positions they continue;
    its keys / values in ``kv``), pooling windows shifted to match (the prefix is never pooled: ``skip <=
    pool_start``), and the attended key length of a request that limits it (``Request.key_len``)."""
    key_lens = [r.key_len for r in requests] if any(r.key_len is not None for r in requests) else None
    return PackedBatch.build(
        [r.ids[skip:] for r in requests],
        causal=causal,
        device=device,
        backend=backend,
        token_type_ids=[None if r.token_type_ids is None else r.token_type_ids[skip:] for r in requests],
        pool_start=[r.pool_start - skip for r in requests],
        position_offsets=[skip] * len(requests) if skip else None,
        kv=kv,
        key_lens=key_lens,
        pool_end=[None if r.pool_end is None else r.pool_end - skip for r in requests],
    )


def check_texts(texts, what: str = "texts") -> list[str]:
    """Validate the user's list of strings, all of it, before any model work; errors name the bad item and the fix.

    Refused: a bare ``str`` / ``bytes``, containers whose iteration is not the texts in order (a ``dict`` iterates
    its keys, a pandas ``DataFrame`` its column names, a ``set`` in hash order), non-string items (``bytes`` named
    as such) and text that cannot be encoded (a lone surrogate)."""
    kind = type(texts).__name__
    if isinstance(texts, str):
        raise TypeError(f"{what} must be a list of strings, got a single str; wrap it: [{texts[:30]!r}]")
    if isinstance(texts, (bytes, bytearray)):
        raise TypeError(f"{what} must be a list of strings, got {kind}; decode it first: [data.decode('utf-8')]")
    if isinstance(texts, Mapping) or hasattr(texts, "columns"):
        hint = "df[column].tolist()" if hasattr(texts, "columns") else "list(d.values())"
        raise TypeError(
            f"{what} must be a list of strings, got a {kind} (iterating it gives its keys / column "
            f"names, not the texts); pass {hint}"
        )
    if isinstance(texts, (set, frozenset)):
        raise TypeError(
            f"{what} must be a list of strings, got a {kind}, which has no order to keep; pass sorted(texts) or a list"
        )
    if not isinstance(texts, Sequence):
        try:
            texts = list(texts)
        except TypeError:
            raise TypeError(f"{what} must be a list of strings, got {kind}") from None
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            hint = "; decode it first (.decode('utf-8'))" if isinstance(t, (bytes, bytearray)) else ""
            raise TypeError(f"{what}[{i}] is {type(t).__name__}, not str; every item must be a string{hint}")
        check_encodable(t, f"{what}[{i}]")
    return list(texts)


def check_inputs(texts, what: str = "texts") -> tuple[list[str], list[str] | None]:
    """``check_texts`` that also takes llm2vec's ``[instruction, text]`` items: ``(texts, instructions)``, the
    second ``None`` for plain strings. Every item is one kind or the other (a mix is refused, naming the first
    odd item)."""
    if (
        isinstance(texts, Sequence)
        and not isinstance(texts, (str, bytes))
        and texts
        and all(isinstance(t, (list, tuple)) for t in texts)
    ):
        for i, t in enumerate(texts):
            if len(t) != 2 or not all(isinstance(x, str) for x in t):
                raise TypeError(
                    f"{what}[{i}] must be an [instruction, text] pair of two strings (llm2vec's input "
                    f"form), got {type(t).__name__} of {len(t)} item(s)"
                )
        instructions = check_texts([t[0] for t in texts], f"{what}' instructions")
        return check_texts([t[1] for t in texts], what), instructions
    if isinstance(texts, Sequence) and not isinstance(texts, (str, bytes)):
        for i, t in enumerate(texts):
            if isinstance(t, (list, tuple)):
                raise TypeError(
                    f"{what}[{i}] is a {type(t).__name__} while others are strings: pass either strings "
                    "or [instruction, text] pairs, not both"
                )
    return check_texts(texts, what), None


def check_encodable(text: str, where: str) -> None:
    """``text`` is valid Unicode (encodable as UTF-8); a ``ValueError`` naming ``where`` and the character if not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where} cannot be encoded as UTF-8 ({e.reason} at character {e.start}: "
            f"{text[max(0, e.start - 10) : e.start + 1]!r}); a lone surrogate usually means a "
            "wrongly decoded file: re-read it with errors='replace'"
        ) from None


class InputProcessor:
    """Tokenizes texts (optionally text pairs) into ``Request`` objects, recording truncation."""

    def __init__(self, tokenizer, max_length: int, *, append_eos: bool = False, framing: Framing | None = None):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.append_eos = append_eos and tokenizer.eos_token_id is not None
        self.framing = framing or Framing()
        self._layout: tuple[int, int] | None | bool = False  # special_layout, probed on first need
        self._n_prefix: int | None = None  # prefix_specials, probed on first need

    def _encode(self, texts: list[str], pairs: list[str] | None, max_length: int) -> dict:
        kw = {"truncation": True, "max_length": max_length, "return_attention_mask": False, "verbose": False}
        if pairs is not None:
            return self.tokenizer(texts, pairs, return_token_type_ids=True, **kw)
        return self.tokenizer(texts, return_token_type_ids=False, **kw)

    def tokenize(self, texts: list[str], pairs: list[str] | None = None) -> tuple[list[list[int]], list | None, list]:
        """Token ids (and type ids for pairs) truncated at ``max_length``; third item: which were cut."""
        return self._tokenize(texts, pairs)[:3]

    def _tokenize(self, texts: list[str], pairs: list[str] | None = None):
        """``tokenize``'s three items and which inputs got the EOS this processor appends (``append_eos``)."""
        limit = self.max_length - 1 if self.append_eos else self.max_length
        enc = self._encode(texts, pairs, limit + 1)
        ids, types = enc["input_ids"], enc.get("token_type_ids")
        cut = [i for i, x in enumerate(ids) if len(x) > limit]
        specials = self.special_layout() if cut and pairs is None else None
        if specials is not None and limit > sum(specials):  # drop the last text token, keep the specials
            n_suffix = specials[1]
            for i in cut:
                x = ids[i]
                ids[i] = x[: len(x) - n_suffix - 1] + x[len(x) - n_suffix :]
        elif cut:  # text pairs (or an unusual tokenizer): tokenize the overflowing inputs again, at the real limit
            again = self._encode([texts[i] for i in cut], [pairs[i] for i in cut] if pairs else None, limit)
            for j, i in enumerate(cut):
                ids[i] = again["input_ids"][j]
                if types is not None:
                    types[i] = again["token_type_ids"][j]
        appended = [False] * len(ids)
        if self.append_eos:
            eos = self.tokenizer.eos_token_id
            appended = [not (x and x[-1] == eos) for x in ids]
            ids = [x + [eos] if a else x for x, a in zip(ids, appended)]
        if any(not x for x in ids):  # "" with a tokenizer that adds no specials: one EOS token stands in for it
            filler = next(
                t
                for t in (
                    self.tokenizer.eos_token_id,
                    self.tokenizer.bos_token_id,
                    self.tokenizer.pad_token_id,
                    self.tokenizer.unk_token_id,
                    0,
                )
                if t is not None
            )
            ids = [x if x else [filler] for x in ids]
        truncated = [False] * len(ids)
        for i in cut:
            truncated[i] = True
        return ids, types, truncated, appended

    def special_layout(self) -> tuple[int, int] | None:
        """``(n_prefix, n_suffix)``: special tokens the tokenizer puts before and after a single text, when cutting
        the ``limit + 1`` encoding by its last text token equals encoding at ``limit`` (right-side truncation);
        else ``None``. Saves tokenizing every over-long input twice."""
        if self._layout is not False:
            return self._layout
        tok, layout = self.tokenizer, None
        probe = "hello world"
        body = tok(probe, add_special_tokens=False)["input_ids"]
        full = tok(probe, add_special_tokens=True)["input_ids"]
        if getattr(tok, "truncation_side", "right") == "right" and body:
            starts = [p for p in range(len(full) - len(body) + 1) if full[p : p + len(body)] == body]
            if len(starts) == 1:
                layout = (starts[0], len(full) - starts[0] - len(body))
        self._layout = layout
        return layout

    def instruction_length(self, instruction: str) -> int:
        """Tokens the instruction contributes at the front of ``instruction + text`` (no trailing specials)."""
        with_special = self.tokenizer(instruction, add_special_tokens=True)["input_ids"]
        bare_text = self.tokenizer("", add_special_tokens=True)["input_ids"]
        # specials the tokenizer appends after any text (e.g. [SEP], </s>) are not part of the instruction; the ones
        # it puts before (e.g. [CLS], <s>) are, even when the instruction tokenizes to nothing (whitespace), as
        # sentence-transformers' prompt_length counts them
        n_suffix = 0
        while n_suffix < min(len(bare_text) - self.prefix_specials(), len(with_special)) and (
            bare_text[len(bare_text) - 1 - n_suffix] == with_special[len(with_special) - 1 - n_suffix]
        ):
            n_suffix += 1
        return len(with_special) - n_suffix

    def prefix_specials(self) -> int:
        """Special tokens the tokenizer puts before a single text (probed once; 0 if the probe is inconclusive)."""
        if self._n_prefix is None:
            tok, probe = self.tokenizer, "hello world"
            body = tok(probe, add_special_tokens=False)["input_ids"]
            full = tok(probe, add_special_tokens=True)["input_ids"]
            starts = [p for p in range(len(full) - len(body) + 1) if body and full[p : p + len(body)] == body]
            self._n_prefix = starts[0] if len(starts) == 1 else 0
        return self._n_prefix

    def process(
        self,
        texts: list[str],
        *,
        first_index: int = 0,
        instruction: str | None = None,
        include_instruction: bool = False,
        pairs: list[str] | None = None,
        instructions: list[str | None] | None = None,
    ) -> list[Request]:
        """Requests for ``texts`` numbered from ``first_index``, framed as ``framing`` says
        (``lab.engine.framing``): the instruction (if any; ``instructions``: one per text, from ``[instruction,
        text]`` inputs) prepended, the text rendered through the template, the pooled span set by the rule."""
        if pairs is not None or (self.framing.plain and instructions is None):
            return self._process_plain(texts, first_index, instruction, include_instruction, pairs)
        per_item = instructions if instructions is not None else [instruction] * len(texts)
        f = self.framing
        if f.template is not None:
            spans = [f.text_span(ins or None, t) for ins, t in zip(per_item, texts)]
            fulls = [full for full, _, _ in spans]
        else:
            joined = [f.join(ins or None, t) for ins, t in zip(per_item, texts)]
            fulls = [full for full, _, _ in joined]
        ids, _, truncated, appended = self._tokenize(fulls)
        n_suffix = (self.special_layout() or (0, 0))[1]
        starts: list[int] = []
        ends: list[int | None] = []
        if f.template is not None:
            offsets = self._offsets(fulls)
            for i, ((_, begin, end), x, off, a) in enumerate(zip(spans, ids, offsets, appended)):
                inside = [j for j, (lo, hi) in enumerate(off) if hi > lo and lo < end and hi > begin]
                if not inside:  # an empty text: the whole input after its instruction
                    starts.append(0 if include_instruction else self._instruction_tokens(per_item[i], f))
                    ends.append(None)
                    continue
                kept = len(x) - n_suffix - int(a)  # the text tokens left after truncation
                if inside[-1] >= kept:
                    raise ValueError(
                        f"text {first_index + i} is cut by max_length={self.max_length} inside the template's last "
                        f"copy of the text (it needs {inside[-1] + 1 + n_suffix} tokens): raise max_length, shorten "
                        "the text, or use a template whose pooled copy comes first"
                    )
                starts.append(0 if include_instruction else inside[0])
                ends.append(inside[-1] + 1)
        elif f.rule == "exact":  # per-item instructions, token-exact
            for ins in per_item:
                starts.append(0 if include_instruction or not ins else self.instruction_length(ins))
                ends.append(None)
        else:  # llm2vec: the last n tokens, n = the text part's tokens alone (one batched call for all parts)
            parts = [part for _, part, _ in joined]
            counts = (
                self.tokenizer(
                    parts,
                    add_special_tokens=False,
                    truncation=True,
                    max_length=self.max_length,
                    return_attention_mask=False,
                    verbose=False,
                )["input_ids"]
                if parts
                else []
            )
            for part_ids, x, a in zip(counts, ids, appended):
                n = len(part_ids)
                starts.append(0 if include_instruction or n == 0 else max(len(x) - int(a) - n, 0))
                ends.append(len(x) - 1 if a else None)  # the EOS appended here is not llm2vec's: not pooled
        return [
            Request(
                index=first_index + i,
                ids=np.asarray(x, dtype=np.int64),
                pool_start=min(p, max(len(x) - 1, 0)),
                truncated=truncated[i],
                pool_end=None if e is None or e >= len(x) else e,
            )
            for i, (x, p, e) in enumerate(zip(ids, starts, ends))
        ]

    def _instruction_tokens(self, instruction: str | None, f: Framing) -> int:
        if not instruction:
            return 0
        return self.instruction_length(instruction if f.rule == "exact" else instruction.strip() + " ")

    def _offsets(self, fulls: list[str]) -> list[list[tuple[int, int]]]:
        """Character offsets of each token of ``fulls`` tokenized whole (specials ``(0, 0)``)."""
        try:
            enc = self.tokenizer(
                fulls, add_special_tokens=True, return_offsets_mapping=True, return_attention_mask=False, verbose=False
            )
        except NotImplementedError:
            raise ValueError(
                "the template knob finds the text's tokens by character offsets, which this (slow) "
                "tokenizer cannot give; use a fast tokenizer (tokenizer.json) or template=None"
            ) from None
        return [[tuple(o) for o in off] for off in enc["offset_mapping"]]

    def _process_plain(self, texts, first_index, instruction, include_instruction, pairs) -> list[Request]:
        """Requests for ``texts`` as given, the instruction (if any) prepended and excluded token-exactly."""
        pool_start = 0
        if instruction:
            texts = [instruction + t for t in texts]
            if not include_instruction:
                pool_start = self.instruction_length(instruction)
        ids, types, truncated = self.tokenize(texts, pairs)
        return [
            Request(
                index=first_index + i,
                ids=np.asarray(x, dtype=np.int64),
                token_type_ids=None if types is None else np.asarray(types[i], dtype=np.int64),
                pool_start=min(pool_start, max(len(x) - 1, 0)),
                truncated=truncated[i],
            )
            for i, x in enumerate(ids)
        ]
