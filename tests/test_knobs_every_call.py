"""Every knob through every call kind: each call either honours a knob that applies to it or refuses it with an
error naming the knob, and a knob that does not apply leaves the call's output as it was.

"Honours" is checked against an independent expectation: for the calls that embed texts (``encode``,
``encode_query``, ``encode_document``, ``score`` / ``rerank`` in ``bi-encoder`` mode, ``embed_chunks``) the vectors
``Engine.embed`` gives under the same knobs (in sentence-transformers' order for ``encode``: normalize, then
``truncate_dim``; documents without the query side's ``instruction``), or for late chunking the token states
``embed(output="tokens")`` gives, pooled per chunk; for a cross-encoder, transformers' own forward; for an LLM
yes/no reranker, the same scores asked for another way (the prompt's instruction, no chunked prefill).

Models: the bundled all-MiniLM-L6-v2 (mean pooling, Normalize, ``include_prompt``), a tiny random BERT
cross-encoder (``tests/tiny_encoders.py``) and a tiny random Qwen2 (``tests/tiny_models.py``), as an embedder
(``bi-encoder``) and as an LLM reranker.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import torch

from lab import Engine
from lab.engine.rerank import YesNoPrompt
from tests.tiny_encoders import tiny_encoder
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore:.*max_length.*:UserWarning")

ATOL = 2e-5
LONG = "The committee met on Tuesday to discuss the budget, the new library and the roads. " * 3  # ~57 tokens
QUERIES = ["Who met on Tuesday?", "What did the committee discuss? " * 5, "guitar"]
DOCS = [LONG, "A man is playing a guitar.", "Stocks fell sharply on Monday."]
SHORT_DOCS = ["A man plays a guitar.", "Stocks fell."]  # fit every max_length

# knob -> the values it is set to (each changes embed's vectors on MiniLM for these texts)
MINILM_KNOBS = {
    "long_inputs": {"long_inputs": "chunk", "max_length": 32},
    "instruction": {"instruction": "Represent this sentence for searching: "},
    "include_instruction": {"instruction": "query: ", "include_instruction": False},
    "truncate_dim": {"truncate_dim": 64},
    "normalize": {"normalize": False},
    "pooling": {"pooling": "cls"},
    "max_length": {"max_length": 12},
    "layer": {"layer": 3},
    "dtype": {"dtype": "bfloat16"},
}
DENSE_CALLS = ("encode", "encode_query", "encode_document", "score", "rerank", "embed_chunks")


@contextmanager
def configured(eng: Engine, **knobs):
    """``eng`` with ``knobs`` set, restored afterwards."""
    old = {k: eng.knobs[k] for k in knobs}
    eng.configure(**knobs)
    try:
        yield eng
    finally:
        eng.configure(**old)


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


class Expected:
    """``embed``'s vectors under the knobs in force, each asked for once: ``encode(texts, instruction)`` in
    sentence-transformers' order (normalize, then cut to the ``truncate_dim`` knob), ``embed(texts, instruction)``
    as ``embed`` gives them (``instruction``: ``embed``'s argument; absent, the knob)."""

    def __init__(self, eng: Engine):
        self.eng, self.memo = eng, {}

    def embed(self, texts: list[str], **kw) -> np.ndarray:
        key = ("embed", tuple(texts), repr(kw))
        if key not in self.memo:
            self.memo[key] = self.eng.embed(texts, **kw)
        return self.memo[key]

    def encode(self, texts: list[str], **kw) -> np.ndarray:
        d = self.eng.knobs["truncate_dim"]
        if d is None:
            return self.embed(texts, **kw)
        key = ("encode", tuple(texts), repr(kw))
        if key not in self.memo:
            with configured(self.eng, truncate_dim=None):
                self.memo[key] = self.eng.embed(texts, **kw)[:, :d]
        return self.memo[key]


def pooled(rows: np.ndarray, method: str) -> np.ndarray:
    return {
        "mean": lambda: rows.mean(0),
        "max": lambda: rows.max(0),
        "cls": lambda: rows[0],
        "lasttoken": lambda: rows[-1],
    }[method]()


def late_chunks(eng: Engine, docs: list[str], chunk_tokens: int) -> np.ndarray:
    """Late chunking's vectors, independently: each document's token states from ``embed(output="tokens")`` (one
    forward, the instruction attended and not pooled), each chunk's span pooled by the engine's method, then
    ``truncate_dim`` and normalize. The documents must fit ``max_length``."""
    tok = eng.tokenizer
    # the token states start at the leading specials, or after the instruction (which counts them) when there is one
    n_prefix = (
        0
        if eng.resolved["instruction"]
        else tok("x")["input_ids"].index(tok("x", add_special_tokens=False)["input_ids"][0])
    )
    with configured(eng, include_instruction=False, long_inputs="truncate"):
        states = eng.embed(docs, output="tokens")
    out = []
    for doc, rows in zip(docs, states, strict=True):
        n = len(tok(doc, add_special_tokens=False)["input_ids"])
        for a in range(0, n, chunk_tokens):
            out.append(pooled(rows[n_prefix + a : n_prefix + min(a + chunk_tokens, n)], eng.resolved.pooling))
    out = np.stack(out)[:, : eng.knobs["truncate_dim"] or None]
    return unit(out) if eng.resolved.normalize else out


def dense_call(eng: Engine, call: str, want: Expected, *, mode: str | None = None):
    """(what ``call`` must give, what it gives) under the knobs in force; the call runs last (``eng.stats`` are
    its own)."""
    if call == "encode":
        return np.concatenate([want.encode(QUERIES), want.encode(DOCS)]), eng.encode(QUERIES + DOCS)
    if call == "encode_query":
        return want.encode(QUERIES), eng.encode_query(QUERIES)
    if call == "encode_document":  # the instruction knob is the query side's: documents embed without it
        return want.encode(DOCS, instruction=None), eng.encode_document(DOCS)
    if call == "embed_chunks":
        return late_chunks(eng, SHORT_DOCS, 4), eng.embed_chunks(SHORT_DOCS, 4)[0]
    q, d = unit(want.embed(QUERIES)), unit(want.embed(DOCS, instruction=None))
    if call == "score":
        return (q * d).sum(1), eng.score(list(zip(QUERIES, DOCS, strict=True)), mode=mode)
    assert call == "rerank"  # its one query is embedded alone (in bfloat16 a batch of one may round otherwise)
    return d @ unit(want.embed(QUERIES[:1]))[0], eng.rerank(QUERIES[0], DOCS, mode=mode).sort_values("index")[
        "score"
    ].to_numpy()


def check_close(ours, expected, what: str, atol: float = ATOL) -> None:
    ours, expected = np.asarray(ours), np.asarray(expected)
    assert ours.shape == expected.shape, f"{what}: shape {ours.shape}, expected {expected.shape}"
    err = float(np.abs(ours - expected).max()) if ours.size else 0.0
    assert err <= atol, f"{what}: differs from the expectation by {err:.3g} (the knob is not honoured)"


# -------------------------------------------------------------------------------------- MiniLM: embedding calls
@pytest.fixture(scope="module")
def mini(minilm_path):
    return Engine(minilm_path)


@pytest.mark.parametrize("knob", list(MINILM_KNOBS))
def test_every_embedding_call_honours_the_knob(mini, knob):
    settings = MINILM_KNOBS[knob]
    plain = np.concatenate([mini.embed(QUERIES), mini.embed(DOCS)])
    with configured(mini, **settings):
        want = Expected(mini)
        moved = np.concatenate([want.embed(QUERIES), want.embed(DOCS)])
        assert moved.shape != plain.shape or not np.allclose(moved, plain, atol=1e-3), f"{knob} changes nothing here"
        failures = []
        for call in DENSE_CALLS:
            expected, ours = dense_call(mini, call, want)
            try:
                check_close(ours, expected, f"{call} under {settings}")
            except AssertionError as e:
                failures.append(str(e).splitlines()[0])
        assert not failures, "\n".join(failures)


def test_long_inputs_chunk_counts_the_split_inputs_in_every_call(mini):
    with configured(mini, long_inputs="chunk", max_length=32):
        mini.encode([LONG, "short"])
        assert mini.stats.split == 1
        mini.score([("short", LONG), (LONG, LONG)])
        assert mini.stats.split == 2  # the long query and the long document, each embedded once
        mini.embed_chunks([LONG], 8)  # late chunking runs macro-windows of its own: nothing is cut or split
        assert mini.stats.split == 0 and mini.stats.truncated == 0


def test_encode_prompts_take_precedence_over_the_instruction_knob(mini):
    """sentence-transformers' prompt= / prompt_name= are the call's; the knob applies when neither is given."""
    with configured(mini, instruction="Represent this sentence for searching: "):
        check_close(mini.encode(QUERIES, prompt="query: "), mini.embed(QUERIES, instruction="query: "), "prompt=")
        check_close(mini.encode(QUERIES, prompt_name="query"), mini.embed(QUERIES, instruction=None), "prompt_name=")
        check_close(
            mini.encode_query(QUERIES, prompt="query: "),
            mini.embed(QUERIES, instruction="query: "),
            "encode_query(prompt=)",
        )
        check_close(
            mini.encode_document(DOCS, prompt="passage: "),
            mini.embed(DOCS, instruction="passage: "),
            "encode_document(prompt=)",
        )


def test_per_token_outputs_refuse_long_inputs_chunk(mini):
    with configured(mini, long_inputs="chunk"):
        with pytest.raises(ValueError, match=r"long_inputs='chunk'.*token_embeddings.*long_inputs='truncate'"):
            mini.encode(QUERIES, output_value="token_embeddings")
        with pytest.raises(ValueError, match=r"long_inputs='chunk'"):
            mini.embed(QUERIES, output="tokens")


# ------------------------------------------------------------------------------------ cross-encoder: pair scores
CE_PAIRS = [
    ("How many people live in Berlin?", "Berlin has about 3.5 million inhabitants."),
    ("guitar", "A man is playing a guitar on a stage."),
    ("a", "b"),
]


@pytest.fixture(scope="module")
def ce(tmp_path_factory, minilm_path):
    folder = tiny_encoder(tmp_path_factory.mktemp("ce") / "ce", minilm_path, "bert", num_labels=1)
    return folder, Engine(str(folder))


def hf_cross_encoder(folder, pairs, *, max_length: int = 128, layer: int | None = None) -> np.ndarray:
    """sigmoid(classifier(pooler(hidden_states[layer]))) by transformers, over the tokenizer's truncated pairs."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for q, d in pairs:
            enc = tok([q], [d], truncation=True, max_length=max_length, return_tensors="pt")
            hs = model.bert(**enc, output_hidden_states=True).hidden_states[-1 if layer is None else layer]
            out.append(torch.sigmoid(model.classifier(model.bert.pooler(hs)))[0, 0].item())
    return np.asarray(out, dtype=np.float32)


@pytest.mark.parametrize(
    ("knob", "settings"),
    [
        ("instruction", {"instruction": "Answer the question: "}),
        ("max_length", {"max_length": 12}),
        ("layer", {"layer": 1}),
        ("dtype", {"dtype": "bfloat16"}),
        ("long_inputs", {"long_inputs": "chunk"}),  # every pair fits: scored as under truncate
    ],
)
def test_cross_encoder_honours_the_knobs_that_apply(ce, knob, settings):
    folder, eng = ce
    instr = settings.get("instruction", "")
    expected = hf_cross_encoder(
        folder,
        [(instr + q, d) for q, d in CE_PAIRS],
        max_length=settings.get("max_length", 128),
        layer=settings.get("layer"),
    )
    with configured(eng, **settings):
        atol = 2e-2 if knob == "dtype" else ATOL
        check_close(eng.score(CE_PAIRS), expected, f"score under {settings}", atol)
        df = eng.rerank(CE_PAIRS[0][0], [d for _, d in CE_PAIRS]).sort_values("index")
        pairs = [(CE_PAIRS[0][0], d) for _, d in CE_PAIRS]
        check_close(
            df["score"].to_numpy(),
            hf_cross_encoder(
                folder,
                [(instr + q, d) for q, d in pairs],
                max_length=settings.get("max_length", 128),
                layer=settings.get("layer"),
            ),
            f"rerank under {settings}",
            atol,
        )
        if knob == "dtype":
            assert not np.array_equal(eng.score(CE_PAIRS), expected), "dtype changes nothing"


@pytest.mark.parametrize(
    "settings",
    [
        {"pooling": "mean"},
        {"normalize": True},
        {"truncate_dim": 8},
        {"include_instruction": False, "instruction": "q: "},
    ],
    ids=str,
)
def test_cross_encoder_scores_ignore_the_knobs_that_do_not_apply(ce, settings):
    """The classification head reads the first token: pooling, normalize, truncate_dim and include_instruction
    leave the scores as they are (the instruction itself does apply)."""
    folder, eng = ce
    instr = settings.get("instruction", "")
    with configured(eng, **settings):
        check_close(
            eng.score(CE_PAIRS),
            hf_cross_encoder(folder, [(instr + q, d) for q, d in CE_PAIRS]),
            f"score under {settings}",
        )


def test_pair_scoring_refuses_a_pair_past_max_length_under_long_inputs_chunk(ce, qwen2):
    _, eng = ce
    long_pairs = [("who met?", LONG * 3), CE_PAIRS[0]]
    with configured(eng, long_inputs="chunk", max_length=32):
        with pytest.raises(ValueError, match=r"long_inputs='chunk'.*mode='cross-encoder'.*pairs\[0\].*max_length=32"):
            eng.score(long_pairs)
        with pytest.raises(ValueError, match=r"long_inputs='chunk'.*max_length=32"):
            eng.rerank("who met?", [LONG * 3, "b"])
    llm = qwen2[1]
    with (
        configured(llm, long_inputs="chunk", max_length=110),
        pytest.raises(ValueError, match=r"long_inputs='chunk'.*mode='llm'.*pairs\[0\].*max_length=110"),
    ):
        llm.score(long_pairs, prompt=PROMPT)


# --------------------------------------------------------------------------------- tiny decoder: LLM and embedder
PROMPT = YesNoPrompt(system="Judge: yes or no.", instruction="Find it", yes_token="ĠFrance", no_token="Ġcapital")
LLM_PAIRS = [
    ("What is the capital of France?", "Paris is the capital of France. " * 4),
    ("fox", "The quick brown fox jumps over the lazy dog."),
]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    folder = tiny_llama(tmp_path_factory.mktemp("qwen2"), "qwen2")
    return folder, Engine(str(folder))


def test_llm_reranker_honours_instruction_and_chunked_prefill(qwen2):
    _, eng = qwen2
    plain = eng.score(LLM_PAIRS, prompt=PROMPT)
    with configured(eng, instruction="Find the answer"):  # fills the prompt's {instruction} slot
        ours = eng.score(LLM_PAIRS, prompt=PROMPT)
    check_close(ours, eng.score(LLM_PAIRS, prompt=replace(PROMPT, instruction="Find the answer")), "instruction")
    assert not np.allclose(ours, plain, atol=1e-4)
    with configured(eng, chunked_prefill=48):  # causal chunked prefill is exact
        check_close(eng.score(LLM_PAIRS, prompt=PROMPT), plain, "chunked_prefill")
        assert eng.stats.chunks > 0
    with configured(eng, long_inputs="chunk"):  # every pair fits: scored as under truncate
        check_close(eng.score(LLM_PAIRS, prompt=PROMPT), plain, "long_inputs")
    for settings in ({"pooling": "mean"}, {"normalize": True}, {"truncate_dim": 8}, {"include_instruction": True}):
        with configured(eng, **settings):
            check_close(eng.score(LLM_PAIRS, prompt=PROMPT), plain, f"{settings} (does not apply)")


@pytest.mark.parametrize(
    ("knob", "settings"),
    [
        ("bidirectional", {"bidirectional": True}),
        ("chunked_prefill", {"chunked_prefill": 48}),  # LONG is longer
        ("long_inputs", {"long_inputs": "chunk", "max_length": 24}),
        ("instruction", {"instruction": "Find it:"}),  # no trailing space: tokenized alone or with a text alike
    ],
)
def test_every_embedding_call_honours_the_knob_on_a_decoder(qwen2, knob, settings):
    _, eng = qwen2
    plain = np.concatenate([eng.embed(QUERIES), eng.embed(DOCS)])
    with configured(eng, **settings):
        want = Expected(eng)
        if knob != "chunked_prefill":  # exact under causal attention: stats.chunks shows that it ran
            moved = np.concatenate([want.embed(QUERIES), want.embed(DOCS)])
            assert not np.allclose(moved, plain, atol=1e-4), f"{knob} changes nothing here"
        failures = []
        for call in DENSE_CALLS:
            expected, ours = dense_call(eng, call, want, mode="bi-encoder")
            if knob == "chunked_prefill" and eng.stats.chunks == 0:
                failures.append(f"{call} ran without chunked prefill")
            try:
                check_close(ours, expected, f"{call} under {settings}", 1e-4)
            except AssertionError as e:
                failures.append(str(e).splitlines()[0])
        assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------- per-token and lexical scores
def test_per_token_and_lexical_score_modes_refuse_long_inputs_chunk(tmp_path, minilm_path):
    """A tiny XLM-R with bge-m3's ColBERT and sparse heads (random ``colbert_linear.pt`` / ``sparse_linear.pt``)."""
    folder = tiny_encoder(tmp_path / "m3", minilm_path, "xlm-roberta")
    for name, out in (("colbert_linear", 48), ("sparse_linear", 1)):
        torch.save(torch.nn.Linear(48, out).state_dict(), folder / f"{name}.pt")
    eng = Engine(str(folder))
    pairs = [("who met?", "The committee met."), ("a", "b")]
    for mode in ("late-interaction", "sparse", "m3"):
        plain = eng.score(pairs, mode=mode)
        with (
            configured(eng, long_inputs="chunk"),
            pytest.raises(ValueError, match=rf"long_inputs='chunk'.*mode='{mode}'.*long_inputs='truncate'"),
        ):
            eng.score(pairs, mode=mode)
        assert np.array_equal(eng.score(pairs, mode=mode), plain)
        with configured(eng, long_inputs="chunk"), pytest.raises(ValueError, match=r"long_inputs='chunk'"):
            eng.rerank("who met?", ["The committee met.", "b"], mode=mode)
