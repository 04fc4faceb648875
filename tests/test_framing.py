"""Input framing (``lab.engine.framing``): llm2vec's pooling rule, its EOS text and chat templates, ``[instruction,
text]`` inputs, and the ``template`` knob (echo, PromptEOL).

Each rule is checked against a plain re-implementation of llm2vec 0.2.3's published rule written here (it imports
nothing of ours), on a byte-level BPE tokenizer ("Ġ") and a SentencePiece-style one ("▁", a BOS added), with
instructions ending in a space, a newline and a colon; the embeddings against transformers' own forward over the
same input, pooling the same positions.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from lab import Engine
from tests.test_engine_decoder import hf_hidden
from tests.tiny_models import _CORPUS, tiny_llama

SEP = "!@#$%^&*()"
TEXTS = [
    "Drug prices rose sharply.",
    "quick brown fox",
    "The quick brown fox",
    "x",
    "What is the capital of France?",
    "  Paris is the capital  ",
    "Embeddings map text to vectors; rerankers score a query.",
]
INSTRUCTIONS = ["Retrieve semantically similar text: ", "Represent the query\n", "Question:"]


def llm2vec_reference(
    tok,
    instruction: str,
    text: str,
    *,
    name: str = "",
    model_type: str = "llama",
    pooling_mode: str = "mean",
    max_length: int = 512,
) -> tuple[list[int], list[int]]:
    """llm2vec 0.2.3's input and embed mask, from its published rule: ``(input ids, pooled positions)``."""
    s = (instruction.strip() + " " + SEP + text) if instruction else SEP + text
    if name == "meta-llama/Meta-Llama-3-8B-Instruct":
        s = "<|start_header_id|>user<|end_header_id|>\n\n" + s.strip() + "<|eot_id|>"
    else:
        if name in ("mistralai/Mistral-7B-Instruct-v0.2", "meta-llama/Llama-2-7b-chat-hf"):
            s = "[INST] " + s.strip() + " [/INST]"
        if pooling_mode == "eos_token":
            if model_type in ("llama", "mistral"):
                s = s.strip() + " </s>"
            elif model_type == "qwen2":
                s = s.strip() + "<|endoftext|>"
    pieces = s.split(SEP)
    ids = tok("".join(pieces), truncation=True, max_length=max_length)["input_ids"]
    second = pieces[1] if len(pieces) > 1 else ""
    n = len(tok(second, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"])
    return ids, list(range(len(ids) - n, len(ids))) if n else list(range(len(ids)))


def sentencepiece_tokenizer():
    """A Llama-style tokenizer: BPE over "▁"-marked words, ``<s>`` prepended to every input."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("framing"))


@pytest.fixture(scope="module", params=["bytelevel", "sentencepiece"])
def folder(request, base, tmp_path_factory):
    if request.param == "bytelevel":
        return base
    out = tmp_path_factory.mktemp("sp") / "llama-sp"
    shutil.copytree(base, out)
    for f in out.glob("*token*"):
        f.unlink()
    sentencepiece_tokenizer().save_pretrained(out)
    return out


def pooled_positions(req) -> list[int]:
    end = req.length if req.pool_end is None else req.pool_end
    return list(range(req.pool_start, end))


@pytest.mark.parametrize("instruction", INSTRUCTIONS)
def test_llm2vec_rule_pools_llm2vecs_tokens(folder, instruction):
    eng = Engine(str(folder), pooling="mean", instruction_pooling="llm2vec")
    for req, text in zip(eng.tokenize(TEXTS, instruction=instruction), TEXTS):
        ids, positions = llm2vec_reference(eng.tokenizer, instruction, text)
        assert req.ids.tolist() == ids, text
        assert pooled_positions(req) == positions, text
    pairs = eng.tokenize([[instruction, t] for t in TEXTS[::-1]])  # llm2vec's input form, reversed order
    for req, text in zip(pairs, TEXTS[::-1]):
        ids, positions = llm2vec_reference(eng.tokenizer, instruction, text)
        assert (req.ids.tolist(), pooled_positions(req)) == (ids, positions), text


def test_without_instruction_llm2vec_pools_the_text_tokens_only(folder):
    eng = Engine(str(folder), pooling="mean", instruction_pooling="llm2vec")
    for req, text in zip(eng.tokenize(TEXTS), TEXTS):
        assert pooled_positions(req) == llm2vec_reference(eng.tokenizer, "", text)[1], text


def test_the_rules_differ_where_the_instruction_merges_with_the_text(base):
    """A byte-level BPE merges the instruction's trailing space into the text's first token: llm2vec pools it."""
    eng = Engine(str(base), pooling="mean")
    exact = eng.tokenize(TEXTS, instruction="Query: ")
    eng.configure(instruction_pooling="llm2vec")
    llm2vec = eng.tokenize(TEXTS, instruction="Query: ")
    assert any(a.pool_start == b.pool_start + 1 for a, b in zip(exact, llm2vec))
    assert all(a.ids.tolist() == b.ids.tolist() for a, b in zip(exact, llm2vec))


@pytest.mark.parametrize("causal", [True, False])
def test_llm2vec_rule_embeddings_equal_transformers(base, causal):
    eng = Engine(str(base), pooling="mean", instruction_pooling="llm2vec", bidirectional=not causal, normalize=False)
    order = [3, 0, 5, 2, 6, 1, 4]
    got = eng.embed([[INSTRUCTIONS[i % 3], TEXTS[i]] for i in order])
    refs = [llm2vec_reference(eng.tokenizer, INSTRUCTIONS[i % 3], TEXTS[i]) for i in order]
    hidden = hf_hidden(str(base), [ids for ids, _ in refs], causal)
    want = np.stack([h[pos].mean(0).numpy() for h, (_, pos) in zip(hidden, refs)])
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.99999


def test_eos_token_pooling_appends_llm2vecs_eos_text(base):
    eng = Engine(str(base), pooling="eos_token", instruction_pooling="llm2vec", normalize=False)
    assert eng.resolved.append_eos is False  # llm2vec appends its EOS text, never an EOS token id
    reqs = eng.tokenize(TEXTS, instruction=INSTRUCTIONS[0])
    refs = [llm2vec_reference(eng.tokenizer, INSTRUCTIONS[0], t, pooling_mode="eos_token") for t in TEXTS]
    assert [r.ids.tolist() for r in reqs] == [ids for ids, _ in refs]
    got = eng.embed(TEXTS, instruction=INSTRUCTIONS[0])
    want = np.stack([h[-1].numpy() for h in hf_hidden(str(base), [ids for ids, _ in refs], True)])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_chat_template_of_a_base_llm2vec_names(base, tmp_path):
    """A folder whose config says it was saved from Mistral-7B-Instruct-v0.2 gets llm2vec's [INST] wrapping."""
    out = tmp_path / "named"
    shutil.copytree(base, out)
    config = json.loads((out / "config.json").read_text())
    config["_name_or_path"] = "mistralai/Mistral-7B-Instruct-v0.2"
    (out / "config.json").write_text(json.dumps(config))
    eng = Engine(str(out), pooling="mean", instruction_pooling="llm2vec")
    for req, text in zip(eng.tokenize(TEXTS, instruction=INSTRUCTIONS[2]), TEXTS):
        ids, positions = llm2vec_reference(
            eng.tokenizer, INSTRUCTIONS[2], text, name="mistralai/Mistral-7B-Instruct-v0.2"
        )
        assert (req.ids.tolist(), pooled_positions(req)) == (ids, positions)
    eng.configure(instruction_pooling="exact")  # the exact rule frames nothing
    assert eng.tokenize(["a"])[0].ids.tolist() == eng.tokenizer("a")["input_ids"]


def test_default_rule_follows_the_folder(base, tmp_path):
    assert Engine(str(base)).resolved.instruction_pooling == "exact"
    out = tmp_path / "l2v"
    shutil.copytree(base, out)
    (out / "llm2vec_config.json").write_text(json.dumps({"pooling_mode": "mean", "skip_instruction": True}))
    eng = Engine(str(out))
    assert eng.resolved.instruction_pooling == "llm2vec" and eng.resolved["instruction_pooling"] == "llm2vec"
    eng.configure(instruction_pooling="exact")
    assert eng.resolved.instruction_pooling == "exact"


# ----------------------------------------------------------------------------------------------- template knob
ECHO = "Rewrite the sentence: {text}, rewritten sentence: {text}"
PROMPT_EOL = 'This sentence : "{text}" means in one word:"'


def span_positions(tok, full: str, start: int, end: int) -> list[int]:
    enc = tok(full, return_offsets_mapping=True)
    return [j for j, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < end and b > start]


def template_reference(tok, template: str, text: str, instruction: str = "") -> tuple[list[int], list[int]]:
    head, _, tail = template.rpartition("{text}")
    full = instruction + head.replace("{text}", text) + text + tail
    start = len(instruction) + len(head.replace("{text}", text))
    return tok(full)["input_ids"], span_positions(tok, full, start, start + len(text))


@pytest.mark.parametrize("instruction", ["", "Query: "])
@pytest.mark.parametrize("settings", [{}, {"chunked_prefill": 5}, {"prefix_cache": False}, {"cpu_workers": 2}])
def test_echo_pools_the_second_copy(base, instruction, settings):
    eng = Engine(str(base), pooling="mean", template=ECHO, normalize=False, append_eos=False, **settings)
    order = [5, 2, 0, 3]
    got = eng.embed([TEXTS[i] for i in order], instruction=instruction or None)
    refs = [template_reference(eng.tokenizer, ECHO, TEXTS[i], instruction) for i in order]
    hidden = hf_hidden(str(base), [ids for ids, _ in refs], True)
    want = np.stack([h[pos].mean(0).numpy() for h, (_, pos) in zip(hidden, refs)])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert all(len(pos) < len(ids) / 2 for ids, pos in refs)  # one copy of two, not the whole input


def test_prompteol_reads_the_last_token(base):
    eng = Engine(str(base), pooling="lasttoken", template=PROMPT_EOL, normalize=False, append_eos=False)
    got = eng.embed(TEXTS)
    ids = [eng.tokenizer(PROMPT_EOL.replace("{text}", t))["input_ids"] for t in TEXTS]
    want = np.stack([h[-1].numpy() for h in hf_hidden(str(base), ids, True)])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    eng.configure(template=None)
    assert not np.allclose(eng.embed(TEXTS), got, atol=1e-3)  # live: the knob changes the input


def test_template_with_tokens_output_returns_the_span(base):
    eng = Engine(str(base), pooling="mean", template=PROMPT_EOL, normalize=False, append_eos=False)
    tokens = eng.embed(TEXTS[:2], output="tokens")
    dense = eng.embed(TEXTS[:2])
    for t, d, text in zip(tokens, dense, TEXTS):
        _, pos = template_reference(eng.tokenizer, PROMPT_EOL, text)
        assert len(t) == len(pos)
        np.testing.assert_allclose(t.mean(0), d, atol=1e-5)


def test_template_errors_name_the_fix(base):
    with pytest.raises(ValueError, match="once .* or twice"):
        Engine(str(base), template="no field")
    with pytest.raises(TypeError, match="template must be a string"):
        Engine(str(base), template=3)
    with pytest.raises(ValueError, match="long_inputs='chunk'"):
        Engine(str(base), template=ECHO, long_inputs="chunk")
    with pytest.raises(ValueError, match="unknown instruction_pooling"):
        Engine(str(base), instruction_pooling="sbert")
    limit = len(Engine(str(base)).tokenizer(ECHO.replace("{text}", "short"))["input_ids"]) + 2
    eng = Engine(str(base), template=ECHO, max_length=limit)
    with pytest.raises(ValueError, match=rf"text 1 is cut by max_length={limit}"):
        eng.embed(["short", "a much longer text that the limit cuts before its second copy"])
    with pytest.raises(ValueError, match="embed_chunks"):
        eng.embed_chunks(["a document"])
    assert eng.knobs["template"] == ECHO  # the failed calls changed nothing


def test_instruction_pairs_input_checks(base):
    eng = Engine(str(base), pooling="mean")
    pairs = eng.embed([["Query: ", "a"], ["Query: ", "b"]])
    np.testing.assert_allclose(pairs, eng.embed(["a", "b"], instruction="Query: "), atol=1e-6)
    with pytest.raises(TypeError, match="not both"):
        eng.embed(["a", ["Query: ", "b"]])
    with pytest.raises(TypeError, match=r"texts\[1\] must be an \[instruction, text\] pair"):
        eng.embed([["Query: ", "a"], ["Query: ", "b", "c"]])
