"""The rows of ``evals/llm2vec_parity.py``: ``Variant`` (what one comparison loads and how each side is called),
``published`` (a plain row over the published layout) and ``VARIANTS`` (the settings-given rows, then the plain ones:
the published layout, ``llm2vec_config.json`` in either folder, SciFact documents, each chat template of
``TEMPLATED``, the layout by hub id)."""

from __future__ import annotations

from dataclasses import dataclass, field

BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# the base names llm2vec 0.2.3's prepare_for_tokenization wraps in a chat template
TEMPLATED = (
    "meta-llama/Meta-Llama-3-8B-Instruct",
    "mistralai/Mistral-7B-Instruct-v0.2",
    "meta-llama/Llama-2-7b-chat-hf",
    "google/gemma-2-9b-it",
    "Qwen/Qwen2-1.5B-Instruct",
    "Qwen/Qwen2-7B-Instruct",
)


@dataclass(frozen=True)
class Variant:
    """One comparison. ``model``: ``base`` or ``mntp`` (the -mntp folder); ``peft``: ``None`` or ``simcse`` (the
    adapter stacked on it); ``scope``: ``bare`` (rescoped adapters) or ``causal`` (``causal_scoped`` copies);
    ``instruction``: the instruction of every input (llm2vec's ``[instruction, text]``; the Engine's
    ``instruction=``); ``knobs``: more Engine knobs for this row.

    ``plain`` rows are called as llm2vec's users call it: ``LLM2Vec.from_pretrained(mntp, peft_model_name_or_path=
    supervised)`` with no encoder settings and no ``enable_bidirectional`` / ``merge_peft``, and ``Engine(mntp,
    adapters=[supervised])`` with no knob but ``dtype`` and ``device``; their folders are the published layout
    (``published_folders``): ``name_or_path`` is the -mntp ``config.json``'s ``_name_or_path``, ``mntp_config`` /
    ``peft_config`` the ``llm2vec_config.json`` written in the -mntp / supervised folder (``None``: none, as
    published), ``hub`` the hub ids both sides name them by (``(mntp id, base id)``, from a hub cache) instead of
    local paths, ``texts`` the inputs (``sts`` sentences or ``scifact`` abstracts)."""

    name: str
    model: str = "base"
    peft: str | None = None
    bidirectional: bool = True
    scope: str = "bare"
    instruction: str = ""
    knobs: dict = field(default_factory=dict)
    plain: bool = False
    name_or_path: str = BASE_ID
    mntp_config: dict | None = None
    peft_config: dict | None = None
    hub: tuple[str, str] | None = None
    texts: str = "sts"


def published(name: str, **kw) -> Variant:
    """A ``plain`` row over the published layout: the -mntp folder with the supervised (SimCSE) adapter on it."""
    return Variant(name, model="mntp", peft=kw.pop("peft", "simcse"), plain=True, **kw)


INSTRUCTION = "Retrieve semantically similar text: "
# a non-default llm2vec_config.json: every setting changed
ODD_CONFIG = {"pooling_mode": "eos_token", "max_length": 128, "doc_max_length": 64, "skip_instruction": False}

VARIANTS = [
    Variant("causal base", bidirectional=False),
    Variant("bidirectional base"),
    Variant("bidirectional + MNTP", model="mntp"),
    Variant("bidirectional + MNTP + SimCSE", model="mntp", peft="simcse"),
    Variant("control: MNTP + SimCSE in the ForCausalLM scope", model="mntp", peft="simcse", scope="causal"),
    # llm2vec's instruction handling: its embed mask is the Engine's instruction_pooling="llm2vec"
    Variant(
        "bidirectional + MNTP + SimCSE, instruction",
        model="mntp",
        peft="simcse",
        instruction=INSTRUCTION,
        knobs={"instruction_pooling": "llm2vec"},
    ),
    # as llm2vec's users call it, no settings on either side: the published layout by local path
    published("published: -mntp + supervised, no llm2vec_config.json"),
    published("published: -mntp + supervised, no llm2vec_config.json, instruction", instruction=INSTRUCTION),
    # llm2vec_config.json in one folder: read from the supervised folder when one is given, else the -mntp folder
    published("config in -mntp only, supervised given (ignored)", mntp_config=ODD_CONFIG, instruction=INSTRUCTION),
    published(
        "config in -mntp only, no supervised (applies)", peft=None, mntp_config=ODD_CONFIG, instruction=INSTRUCTION
    ),
    published(
        "config in supervised only: weighted_mean, max_length 128, skip_instruction false",
        peft_config={"pooling_mode": "weighted_mean", "max_length": 128, "skip_instruction": False},
        instruction=INSTRUCTION,
    ),
    published(
        "config in supervised only: eos_token", peft_config={"pooling_mode": "eos_token"}, instruction=INSTRUCTION
    ),
    # documents over doc_max_length: llm2vec's word cut
    published("SciFact, doc_max_length 400 (default)", texts="scifact"),
    published(
        "SciFact, doc_max_length 64 (supervised config)",
        texts="scifact",
        peft_config={"doc_max_length": 64},
        instruction=INSTRUCTION,
    ),
    published(
        "SciFact, doc_max_length 200, max_length 128 (supervised config)",
        texts="scifact",
        peft_config={"doc_max_length": 200, "max_length": 128},
    ),
    # the chat templates llm2vec chooses by the -mntp config.json's _name_or_path (SmolLM2's weights under each name)
    *(published(f"template: {t}", name_or_path=t, instruction=INSTRUCTION) for t in TEMPLATED),
    published(
        "template: mistralai/Mistral-7B-Instruct-v0.2, eos_token",
        name_or_path="mistralai/Mistral-7B-Instruct-v0.2",
        peft_config={"pooling_mode": "eos_token"},
        instruction=INSTRUCTION,
    ),
    published(
        "template: meta-llama/Meta-Llama-3-8B-Instruct, eos_token",
        name_or_path="meta-llama/Meta-Llama-3-8B-Instruct",
        peft_config={"pooling_mode": "eos_token"},
        instruction=INSTRUCTION,
    ),
    # the published layout by hub id, from a hub cache (HF_HUB_CACHE, offline)
    published(
        "hub ids: -mntp + supervised",
        hub=("McGill-NLP/LLM2Vec-SmolLM2-135M-Instruct-mntp", BASE_ID),
        instruction=INSTRUCTION,
    ),
    published(
        "hub ids: Meta-Llama-3-8B-Instruct",
        name_or_path="meta-llama/Meta-Llama-3-8B-Instruct",
        hub=("McGill-NLP/LLM2Vec-Meta-Llama-3-8B-Instruct-mntp", "meta-llama/Meta-Llama-3-8B-Instruct"),
        instruction=INSTRUCTION,
    ),
    # the -mntp config.json and the adapter's base disagree on the name: which one llm2vec's template follows
    published(
        "hub ids: -mntp _name_or_path Meta-Llama-3-8B-Instruct, base SmolLM2",
        name_or_path="meta-llama/Meta-Llama-3-8B-Instruct",
        hub=("McGill-NLP/LLM2Vec-SmolLM2-named-Llama-3-mntp", BASE_ID),
        instruction=INSTRUCTION,
    ),
]
