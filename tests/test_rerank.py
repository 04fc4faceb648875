"""Engine.score / Engine.rerank: cross-encoders against sentence-transformers' CrossEncoder and transformers' logits,
LLM yes/no scores against a plain transformers computation of the same formula, bi-encoder scores against
sentence-transformers embeddings, the rerank table, and every error."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from tiny_encoders import tiny_encoder
from tiny_models import tiny_llama

from lab import Engine
from lab.engine.rerank import YesNoLayout, YesNoPrompt

ATOL = 1e-5  # float32
MAX_LEN = 48
PAIRS = [
    ("How many people live in Berlin?", "Berlin had a population of 3,520,031 registered inhabitants in 2019."),
    ("How many people live in Berlin?", "Berlin is well known for its museums."),
    ("what is a cat", ""),
    ("", "A document with an empty query."),
    ("Café crème?", "Naïve façade — 東京タワー и Москва."),
    ("The quick brown fox " * 20, "jumps over the lazy dog " * 20),  # both long: cut longest-first
    ("short query", "a very long document about rerankers and cross-encoders " * 12),  # only the document is cut
    ("a", "b"),
]


@pytest.fixture(
    scope="module",
    params=[("bert", 1), ("bert", 3), ("xlm-roberta", 1), ("xlm-roberta", 3)],
    ids=lambda p: f"{p[0]}-{p[1]}label",
)
def ce_folder(request, tmp_path_factory, minilm_path):
    kind, labels = request.param
    return tiny_encoder(tmp_path_factory.mktemp(f"{kind}{labels}"), minilm_path, kind, num_labels=labels)


def hf_logits(folder, pairs) -> np.ndarray:
    """transformers' own forward over the tokenizer's truncated pairs, one pair at a time (as lists: a lone
    ``text_pair=""`` would be read as no pair at all)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return np.concatenate(
            [
                model(**tok([q], [d], truncation=True, max_length=MAX_LEN, return_tensors="pt")).logits.numpy()
                for q, d in pairs
            ]
        )


@pytest.mark.filterwarnings("ignore:.*truncated")  # said once per max_length; stats.truncated counts every cut
def test_cross_encoder_matches_cross_encoder_predict_and_transformers(ce_folder):
    from sentence_transformers import CrossEncoder

    eng = Engine(str(ce_folder), max_length=MAX_LEN, max_batch_tokens=100)  # several packed batches
    labels = eng.model.classifier.num_labels
    assert eng.score_mode == "cross-encoder"
    order = list(range(len(PAIRS)))
    random.shuffle(order)  # scheduling sorts by length: the output must come back in input order anyway
    pairs = [PAIRS[i] for i in order]
    scores = eng.score(pairs)
    assert eng.stats.batches > 1 and eng.stats.truncated == 2
    expected = CrossEncoder(str(ce_folder), max_length=MAX_LEN, device="cpu").predict(pairs)
    assert scores.dtype == np.float32 and scores.shape == ((len(pairs),) if labels == 1 else (len(pairs), labels))
    np.testing.assert_allclose(scores, expected, atol=ATOL, rtol=0)
    raw = eng.score(pairs, activation=None)
    np.testing.assert_allclose(raw.reshape(len(pairs), labels), hf_logits(ce_folder, pairs), atol=ATOL, rtol=0)
    np.testing.assert_allclose(eng.score(PAIRS, activation=None)[order], raw, atol=ATOL, rtol=0)
    if labels > 1:
        soft = eng.score(pairs, activation="softmax")
        np.testing.assert_allclose(soft, torch.softmax(torch.from_numpy(raw), -1).numpy(), atol=ATOL, rtol=0)
        with pytest.raises(ValueError, match="3 labels"):
            eng.rerank("q", ["a", "b"])
    else:
        df = eng.rerank(PAIRS[0][0], [d for _, d in PAIRS], top_k=3)
        assert df.attrs["mode"] == "cross-encoder" and list(df["rank"]) == [1, 2, 3]


def test_cross_encoder_uses_the_saved_activation(tmp_path, minilm_path):
    """ms-marco-style checkpoints save ``activation_fn`` (Identity) in config.json; CrossEncoder.predict honours it."""
    from sentence_transformers import CrossEncoder

    folder = tiny_encoder(tmp_path / "ce", minilm_path, "bert", num_labels=1)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").write_text(json.dumps(cfg))
    scores = Engine(str(folder), max_length=MAX_LEN).score(PAIRS[:4])
    np.testing.assert_allclose(scores, CrossEncoder(str(folder), max_length=MAX_LEN).predict(PAIRS[:4]), atol=ATOL)
    assert np.abs(scores - 0.5).max() > 0.5 or (scores < 0).any()  # raw logits, not probabilities


# --------------------------------------------------------------------------------------------------- LLM yes/no
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT = YesNoPrompt(system="Judge: yes or no.", instruction="Find it", yes_token="ĠFrance", no_token="Ġcapital")
LLM_PAIRS = [
    ("What is the capital of France?", "Paris is the capital of France."),
    ("q", ""),
    ("fox", "The quick brown fox jumps over the lazy dog."),
    ("Rotary position embeddings?", "They rotate queries and keys by an angle that grows with position."),
]


@pytest.fixture(scope="module")
def qwen2_folders(tmp_path_factory):
    """(plain, chat): a tiny random Qwen2, without and with a ChatML chat template."""
    from transformers import AutoTokenizer

    plain = tiny_llama(tmp_path_factory.mktemp("qwen2"), "qwen2")
    chat = plain.parent / "qwen2-chat"
    shutil.copytree(plain, chat)
    tok = AutoTokenizer.from_pretrained(str(chat))
    tok.chat_template = CHATML
    tok.save_pretrained(str(chat))
    return plain, chat


def prompt_text(q: str, d: str, chat: bool, tok) -> str:
    """The filled prompt, written out by hand (the formula the engine must implement)."""
    user = f"<Instruct>: Find it\n<Query>: {q}\n<Document>: {d}"
    if not chat:
        return f"Judge: yes or no.\n\n{user}\n\nAnswer (yes or no):\n"
    return tok.apply_chat_template(
        [{"role": "system", "content": "Judge: yes or no."}, {"role": "user", "content": user}],
        tokenize=False,
        add_generation_prompt=True,
    )


def hf_yes_probability(folder, ids_list) -> tuple[np.ndarray, np.ndarray]:
    """P(yes) = softmax(logit_yes, logit_no)[0] at the last position, and logit_yes - logit_no, by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    yes, no = tok.convert_tokens_to_ids("ĠFrance"), tok.convert_tokens_to_ids("Ġcapital")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    probs, diffs = [], []
    with torch.no_grad():
        for ids in ids_list:
            last = model(input_ids=torch.tensor([ids])).logits[0, -1]
            probs.append(torch.softmax(last[[yes, no]], 0)[0].item())
            diffs.append((last[yes] - last[no]).item())
    return np.array(probs), np.array(diffs)


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat-template"])
def test_llm_yes_no_matches_transformers(qwen2_folders, chat):
    folder = qwen2_folders[chat]
    eng = Engine(str(folder), max_batch_tokens=150)
    assert eng.score_mode == "llm"
    tok = eng.tokenizer
    ids = [tok(prompt_text(q, d, chat, tok), add_special_tokens=False)["input_ids"] for q, d in LLM_PAIRS]
    probs, diffs = hf_yes_probability(folder, ids)
    for prefix_cache in (True, False):  # the shared prompt head computed once, or with every pair
        eng.configure(prefix_cache=prefix_cache)
        np.testing.assert_allclose(eng.score(LLM_PAIRS, prompt=PROMPT), probs, atol=ATOL, rtol=0)
        assert (eng.stats.shared_prefix > 0) == prefix_cache
        np.testing.assert_allclose(eng.score(LLM_PAIRS, prompt=PROMPT, activation=None), diffs, atol=ATOL, rtol=0)
    df = eng.rerank(LLM_PAIRS[0][0], [d for _, d in LLM_PAIRS], prompt=PROMPT)
    assert df.attrs["mode"] == "llm" and len(df) == 4 and df["score"].is_monotonic_decreasing


@pytest.mark.filterwarnings("ignore:.*truncated")
def test_llm_truncation_cuts_the_document_never_the_suffix(qwen2_folders):
    folder = qwen2_folders[True]
    max_length = 110
    eng = Engine(str(folder), max_length=max_length)
    tok = eng.tokenizer
    pairs = [("fox", "The quick brown fox jumps over the lazy dog. " * 8), LLM_PAIRS[0]]
    expected = []
    for q, d in pairs:  # the suffix starts with <|im_end|>, so tokens before it are a prefix of the full tokens
        text = prompt_text(q, d, True, tok)
        cut = text.rindex("<|im_end|>\n<|im_start|>assistant")
        body, suffix = tok(text[:cut], add_special_tokens=False)["input_ids"], tok(text[cut:])["input_ids"]
        expected.append(
            body[: max_length - len(suffix)] + suffix if len(body) + len(suffix) > max_length else body + suffix
        )
    assert len(expected[0]) == max_length and len(expected[1]) < max_length
    reqs = YesNoLayout(tok, PROMPT, PROMPT.instruction, max_length).requests(*map(list, zip(*pairs)))
    assert [r.ids.tolist() for r in reqs] == expected and [r.truncated for r in reqs] == [True, False]
    scores = eng.score(pairs, prompt=PROMPT)
    assert eng.stats.truncated == 1
    np.testing.assert_allclose(scores, hf_yes_probability(folder, expected)[0], atol=ATOL, rtol=0)
    # a long query and a long document are both cut, longest first; the template stays whole
    both = YesNoLayout(tok, PROMPT, PROMPT.instruction, max_length).requests(["fox " * 60], ["dog " * 60])[0]
    text = tok.decode(both.ids)
    assert both.length == max_length and both.ids[-len(suffix) :].tolist() == suffix
    assert 0 < text.count("fox") < 60 and 0 < text.count("dog") < 60
    assert text.startswith(prompt_text("", "", True, tok).split("<Query>")[0])


# ---------------------------------------------------------------------------------------------------- bi-encoder
def test_bi_encoder_rerank_equals_sentence_transformers_cosine(minilm_engine, minilm_st):
    query = "A man is playing a guitar."
    docs = [
        "Someone plays guitar on a stage.",
        "The cat sits on the mat.",
        "A man is playing a guitar.",
        "Stocks fell sharply on Monday.",
        "",
        "A woman is slicing an onion.",
        "The cat sits on the mat.",
    ]
    assert minilm_engine.score_mode == "bi-encoder"
    q = minilm_st.encode([query], convert_to_numpy=True)[0]
    d = minilm_st.encode(docs, convert_to_numpy=True)
    cos = d @ q / (np.linalg.norm(d, axis=1) * np.linalg.norm(q))
    df = minilm_engine.rerank(query, docs)
    assert list(df.columns) == ["rank", "index", "score", "document"] and df.attrs["mode"] == "bi-encoder"
    assert list(df["rank"]) == list(range(1, len(docs) + 1))
    assert [docs[i] for i in df["index"]] == list(df["document"])
    np.testing.assert_allclose(df["score"].to_numpy(), cos[df["index"].to_numpy()], atol=ATOL, rtol=0)
    assert df["index"].iloc[0] == 2 and df["score"].is_monotonic_decreasing
    top = minilm_engine.rerank(query, docs, top_k=3)
    assert len(top) == 3 and top["index"].tolist() == df["index"].tolist()[:3]
    assert len(minilm_engine.rerank(query, docs, top_k=100)) == len(docs)
    scores = minilm_engine.score([(query, x) for x in docs])
    np.testing.assert_allclose(scores, cos, atol=ATOL, rtol=0)
    assert minilm_engine.stats.sequences == 1 + len(set(docs))  # each distinct text embedded once
    dot = minilm_engine.score([(query, x) for x in docs], similarity="dot")
    np.testing.assert_allclose(dot, d @ q, atol=ATOL, rtol=0)


# -------------------------------------------------------------------------------------------------------- errors
def test_errors(minilm_engine, qwen2_folders):
    eng = minilm_engine
    with pytest.raises(TypeError, match=r"pairs\[1\] must be a \(query, document\) pair.*tuple of length 3"):
        eng.score([("q", "d"), ("q", "d", "x")])
    with pytest.raises(TypeError, match=r"pairs\[0\].*wrap it"):
        eng.score(("q", "d"))
    with pytest.raises(TypeError, match=r"pairs\[2\]'s document is int"):
        eng.score([("q", "d"), ["q", "d"], ("q", 3)])
    with pytest.raises(TypeError, match="single str"):
        eng.score("q")
    with pytest.raises(ValueError, match="documents is empty"):
        eng.rerank("q", [])
    with pytest.raises(TypeError, match=r"documents\[1\] is NoneType"):
        eng.rerank("q", ["a", None])
    with pytest.raises(TypeError, match="query must be a string"):
        eng.rerank(["q"], ["a"])
    for bad, err in ((0, ValueError), (-2, ValueError), ("3", TypeError), (True, TypeError)):
        with pytest.raises(err, match="top_k must be"):
            eng.rerank("q", ["a"], top_k=bad)
    with pytest.raises(ValueError, match=r"no sequence-classification head.*mode='bi-encoder'.*ForSequenceClass"):
        eng.score([("q", "d")], mode="cross-encoder")
    with pytest.raises(ValueError, match="mode='llm' needs a decoder"):
        eng.score([("q", "d")], mode="llm")
    with pytest.raises(ValueError, match="unknown mode"):
        eng.score([("q", "d")], mode="colbert")
    with pytest.raises(ValueError, match="unknown activation"):
        eng.score([("q", "d")], activation="relu")
    with pytest.raises(ValueError, match="unknown similarity"):
        eng.score([("q", "d")], similarity="l2")
    with pytest.raises(ValueError, match="prompt= is for mode='llm'"):
        eng.score([("q", "d")], prompt=PROMPT)
    assert eng.score([]).shape == (0,)
    llm = Engine(str(qwen2_folders[0]))
    with pytest.raises(ValueError, match=r"yes_token='maybe' is not a single token"):
        llm.score([("q", "d")], prompt=YesNoPrompt(yes_token="maybe", no_token="Ġcapital"))
    with pytest.raises(ValueError, match=r"must contain \{document\} exactly once"):
        llm.score([("q", "d")], prompt=YesNoPrompt(template="{query}", yes_token=5, no_token=6))
    with pytest.raises(ValueError, match="prompt without query and document is"):
        Engine(str(qwen2_folders[0]), max_length=20).score([("q", "d")], prompt=PROMPT)
    assert llm.score([("q", "d")], mode="bi-encoder").shape == (1,)  # any model can score by its embeddings


def test_a_registered_score_mode_is_offered_by_score_and_rerank(minilm_path, monkeypatch):
    """``register_mode`` a toy mode (in a scratch copy of ``SCORE_MODES``): ``score`` and ``rerank`` run it, its
    check refuses an engine it does not suit, and the options it does not take are refused by name."""
    from lab.engine import rerank as rr
    from lab.engine.rerank import ScoreJob, ScoreMode, register_mode

    monkeypatch.setattr(rr, "SCORE_MODES", dict(rr.SCORE_MODES))
    eng = Engine(minilm_path)
    pairs = [("a man plays a guitar", "someone plays music"), ("a cat", "a kitten sleeps"), ("x", "")]
    with pytest.raises(ValueError, match="unknown mode 'length'; valid: 'cross-encoder', 'llm', 'bi-encoder'"):
        eng.score(pairs, mode="length")

    def length_job(engine, mode, queries, documents, *, activation, instruction, prompt, similarity):
        return ScoreJob([], lambda outs: np.array([len(d) - len(q) for q, d in zip(queries, documents)], np.float32))

    register_mode(ScoreMode("length", lambda engine: None, length_job))
    np.testing.assert_array_equal(eng.score(pairs, mode="length"), [-1.0, 10.0, -1.0])
    ranked = eng.rerank("ab", ["abcd", "a", "abc"], mode="length")
    assert ranked["document"].tolist() == ["abcd", "abc", "a"] and ranked.attrs["mode"] == "length"
    with pytest.raises(
        ValueError, match="similarity='dot' is for mode='bi-encoder'; this call scores in mode='length'"
    ):
        eng.score(pairs, mode="length", similarity="dot")

    def refuse(engine):
        raise ValueError("mode='never' needs a head this model lacks")

    register_mode(ScoreMode("never", refuse, length_job))
    with pytest.raises(ValueError, match="mode='never' needs a head this model lacks"):
        eng.score(pairs, mode="never")
    with pytest.raises(TypeError, match="ScoreMode"):
        register_mode("never")
