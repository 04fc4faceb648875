"""How an input's text becomes the string that is tokenized, and which of its tokens are pooled.

Two rules decide the pooled tokens of an input with an instruction (the ``instruction_pooling`` knob):

- ``"exact"``: the instruction is prepended as given (``instruction + text``) and the tokens it contributes when
  tokenized alone (with the tokenizer's leading specials) are not pooled, as sentence-transformers'
  ``include_prompt=False`` counts them (``InputProcessor.instruction_length``).
- ``"llm2vec"``: llm2vec's embed mask, as llm2vec 0.2.3 builds it: the input is
  ``instruction.strip() + " " + text`` (the text alone without an instruction), wrapped in the chat template of
  the base model when the name llm2vec chooses it by (``lab.engine.llm2vec``) is one it knows (``CHAT_TEMPLATES``),
  followed by the EOS text under ``eos_token`` pooling (``eos_text``); the pooled tokens are the last ``n`` of the
  tokenized input, ``n`` = the tokens of the text part (the text and whatever the wrapping put after it) tokenized
  alone without special tokens. When the instruction's last character merges with the text's first into one token
  (byte-level BPE: ``" "`` + ``"Drug"`` -> ``"ĠDrug"``), that token is pooled under this rule and not under
  ``"exact"``. Without an instruction the rule still pools the last ``n`` tokens, so a tokenizer's BOS is not pooled.

A ``template`` (a string with one or two ``{text}`` fields) renders the text before either rule applies: echo
embeddings (``"Rewrite the sentence: {text}, rewritten sentence: {text}"``, the text twice, pooling the second
copy; Springer et al. 2024) and prompt-based last-token embeddings (PromptEOL:
``'This sentence : "{text}" means in one word:"'`` with ``lasttoken`` pooling). The pooled span is then the tokens
whose characters overlap the last occurrence of the text (by the tokenizer's character offsets), ``lasttoken``
pooling reading the sequence's last token.

    >>> Framing(rule="llm2vec").join("Retrieve similar text: ", "A cat")
    ('Retrieve similar text: A cat', 'A cat', 23)
"""

from __future__ import annotations

from dataclasses import dataclass

INSTRUCTION_POOLING = ("exact", "llm2vec")
TEXT_FIELD = "{text}"
# llm2vec's separator between instruction and text (never tokenized: the two parts are joined around it)
LLM2VEC_SEPARATOR = "!@#$%^&*()"

# the base models whose chat template llm2vec 0.2.3 applies, by the name the model was loaded under:
# name -> (before, after); llm2vec strips the joined input first. Meta-Llama-3-8B-Instruct's input gets nothing more
# (no EOS text), the others may get the EOS text after the template.
CHAT_TEMPLATES: dict[str, tuple[str, str]] = {
    "meta-llama/Meta-Llama-3-8B-Instruct": ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
    "mistralai/Mistral-7B-Instruct-v0.2": ("[INST] ", " [/INST]"),
    "meta-llama/Llama-2-7b-chat-hf": ("[INST] ", " [/INST]"),
    "google/gemma-2-9b-it": ("<bos><start_of_turn>user\n", "<end_of_turn>"),
    "Qwen/Qwen2-1.5B-Instruct": ("<|im_start|>user\n", "<|im_end|>"),
    "Qwen/Qwen2-7B-Instruct": ("<|im_start|>user\n", "<|im_end|>"),
}
_ENDS_WITHOUT_EOS = ("meta-llama/Meta-Llama-3-8B-Instruct",)
# the EOS text llm2vec appends under eos_token pooling: by base name first, then by the config's model type
EOS_TEXT_BY_NAME = {"meta-llama/Meta-Llama-3-8B": "<|end_of_text|>"}
EOS_TEXT_BY_TYPE = {"llama": " </s>", "mistral": " </s>", "gemma": "<eos>", "qwen2": "<|endoftext|>"}


def kernel_pooling(name: str) -> str:
    """The pooling method that runs for a ``pooling`` knob value (llm2vec's ``eos_token`` reads the last token)."""
    return "lasttoken" if name == "eos_token" else name


def check_template(template) -> None:
    """A ``template`` knob value: ``None`` or a string with one or two ``{text}`` fields (``ValueError`` else)."""
    if template is None:
        return
    if not isinstance(template, str):
        raise TypeError(f"template must be a string with a {TEXT_FIELD} field, or None; got {type(template).__name__}")
    n = template.count(TEXT_FIELD)
    if n not in (1, 2):
        raise ValueError(
            f"template must contain {TEXT_FIELD} once (a prompt) or twice (echo: the text repeated, the "
            f"second copy pooled); {template!r} has it {n} times"
        )


def eos_text(names: list[str], model_type: str | None) -> str:
    """The text llm2vec appends under ``eos_token`` pooling for a base known by ``names`` ('' where it appends
    none)."""
    if any(n in _ENDS_WITHOUT_EOS for n in names):
        return ""
    for n in names:
        if n in EOS_TEXT_BY_NAME:
            return EOS_TEXT_BY_NAME[n]
    return EOS_TEXT_BY_TYPE.get(model_type or "", "")


def chat_template(names: list[str]) -> tuple[str, str] | None:
    """The chat template llm2vec applies to a base known by ``names`` (``CHAT_TEMPLATES``), or ``None``."""
    return next((CHAT_TEMPLATES[n] for n in names if n in CHAT_TEMPLATES), None)


@dataclass(frozen=True)
class Framing:
    """How one engine call turns (instruction, text) into the tokenized string and its pooled text part.

    ``rule``: ``"exact"`` or ``"llm2vec"`` (module docstring); ``template``: a ``{text}`` template or ``None``;
    ``chat``: the (before, after) chat template llm2vec applies for this base, or ``None``; ``eos``: the EOS text
    llm2vec appends under ``eos_token`` pooling (either rule; the llm2vec rule strips the input first), or ''."""

    rule: str = "exact"
    template: str | None = None
    chat: tuple[str, str] | None = None
    eos: str = ""

    @property
    def plain(self) -> bool:
        """Whether the text is tokenized as given, the instruction (if any) prepended token-exactly."""
        return self.rule == "exact" and self.template is None and not self.eos

    def render(self, text: str) -> tuple[str, int]:
        """``text`` through the template: the rendered string and where the last copy of ``text`` starts in it."""
        if self.template is None:
            return text, 0
        head, _, tail = self.template.rpartition(TEXT_FIELD)
        head = head.replace(TEXT_FIELD, text)
        return head + text + tail, len(head)

    def join(self, instruction: str | None, text: str) -> tuple[str, str, int]:
        """``(full, text_part, at)``: the string that is tokenized; the text part (under the llm2vec rule the part
        after llm2vec's separator, whose token count tokenized alone is the number of pooled tokens; under ``"exact"``
        the text); where the text part starts in ``full``. ``text`` is already rendered through the template."""
        if self.rule == "exact":
            return (instruction or "") + text + self.eos, text + self.eos, len(instruction or "")
        joined = f"{instruction.strip()} {LLM2VEC_SEPARATOR}{text}" if instruction else f"{LLM2VEC_SEPARATOR}{text}"
        if self.chat is not None:
            before, after = self.chat
            joined = before + joined.strip() + after
        if self.eos:
            joined = joined.strip() + self.eos
        parts = joined.split(LLM2VEC_SEPARATOR)
        return "".join(parts), parts[1] if len(parts) > 1 else "", len(parts[0])

    def text_span(self, instruction: str | None, text: str) -> tuple[str, int, int]:
        """``(full, start, end)``: the tokenized string and the characters of the last copy of ``text`` in it (the
        llm2vec join strips trailing whitespace: the span ends where the copy's kept characters end)."""
        rendered, at = self.render(text)
        full, part, offset = self.join(instruction, rendered)
        begin = offset + at
        kept = len(part) if self.rule == "exact" else len(rendered.rstrip()) if (self.chat or self.eos) else len(part)
        return full, begin, min(begin + len(text), offset + kept)
