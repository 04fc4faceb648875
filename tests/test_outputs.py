"""``Engine.embed(texts, output=...)`` and the late-interaction / sparse / m3 score modes (``lab.outputs.kinds``).

Oracles: sentence-transformers' ``SparseEncoder.encode`` on tiny random SPLADE folders; for bge-m3, a plainly written
reference of FlagEmbedding's formulas (``M3Embedder``: CLS dense vector normalized, ``relu(sparse_linear(h))`` max
per token id without cls / eos / pad / unk, ``colbert_linear(h[1:])`` normalized, ``colbert_score``,
``compute_score``'s ``colbert+sparse+dense`` with weights 1, 1, 1) over transformers' ``XLMRobertaModel`` hidden
states of padded batches; FlagEmbedding itself does not import under transformers 5. Inputs are shuffled odd-size
lists with a one-token text; small token budgets force several packed steps.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import sparse
from tiny_encoders import tiny_encoder
from tiny_models import tiny_llama

import lab.outputs.kinds
from lab import Engine
from lab.runtime.pool import split_for_workers

TEXTS = [
    "A man is playing a guitar.",
    "a",
    "The quick brown fox jumps over the lazy dog, and the dog jumps back over the fox.",
    "Café crème, naïve façade.",
    "Protein folding remains a central problem of computational biology.",
    "guitar guitar guitar",
    "",
    "Stocks fell sharply on Monday after the central bank raised rates.",
    "Two dogs run through a field of tall grass.",
]
PAIRS = [
    ("who plays the guitar?", "A man is playing a guitar."),
    ("who plays the guitar?", "Stocks fell sharply on Monday."),
    ("fox", "The quick brown fox jumps over the lazy dog."),
    ("a", "guitar guitar guitar"),
    ("protein folding", "Protein folding remains a central problem of computational biology."),
]
ATOL = 1e-5  # float32 (measured <= 1e-6)
# bfloat16 against the float32 oracle, as a share of the largest reference value: measured 0.5-1.1 % for the sparse
# weights (SPLADE max 0.0073 of 0.66, sum + log1p_relu 0.036 of 7.0; bge-m3 0.028 of 2.7), 0.4 % for the unit-length
# dense and ColBERT vectors
BF16_REL = 0.02


def shuffled(texts):
    order = list(range(len(texts)))
    random.shuffle(order)
    return [texts[i] for i in order]


def csr_close(ours, ref: np.ndarray, atol: float) -> None:
    assert isinstance(ours, sparse.csr_matrix) and ours.dtype == np.float32 and ours.shape == ref.shape
    np.testing.assert_allclose(ours.toarray(), ref, atol=atol, rtol=0)


# ------------------------------------------------------------------------------------------------------ SPLADE
@pytest.fixture(
    scope="module", params=[("bert", "max", "relu"), ("roberta", "sum", "log1p_relu")], ids=lambda p: "-".join(p)
)
def splade(request, tmp_path_factory, minilm_path):
    """A SparseEncoder folder (MLMTransformer + SpladePooling) over a tiny random ``*ForMaskedLM``."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    kind, strategy, activation = request.param
    root = tmp_path_factory.mktemp(f"splade-{kind}")
    mlm = tiny_encoder(root / "mlm", minilm_path, kind, masked_lm=True)
    st = SparseEncoder(modules=[MLMTransformer(str(mlm)), SpladePooling(strategy, activation)], device="cpu")
    st.save(str(root / "splade"))
    return root / "splade", SparseEncoder(str(root / "splade"), device="cpu")


def st_sparse(st, texts) -> np.ndarray:
    return st.encode(texts, convert_to_tensor=True).to_dense().numpy()


@pytest.mark.filterwarnings("ignore:.*deprecated")
def test_splade_sparse_matches_sparse_encoder(splade, monkeypatch):
    folder, st = splade
    texts = shuffled(TEXTS)
    ref = st_sparse(st, texts)
    eng = Engine(str(folder), max_batch_tokens=40)
    assert eng.spec.splade is not None and "mlm" in eng.model.token_heads
    out = eng.embed(texts, output="sparse")
    assert eng.stats.batches > 1 and eng.stats.padded_tokens == 0
    assert out.shape == (len(texts), eng.model.config["vocab_size"])
    csr_close(out, ref, ATOL)
    # MLM logits in blocks of 3 rows, so blocks cut across sequences (the memory bound of the module doc)
    monkeypatch.setattr(lab.outputs.kinds, "LOGIT_BLOCK_BYTES", 3 * 4 * eng.model.config["vocab_size"])
    csr_close(eng.embed(texts, output="sparse"), ref, ATOL)
    eng.configure(cpu_workers=2, max_batch_tokens=16384)
    csr_close(eng.embed(texts, output="sparse"), ref, ATOL)
    # a prompt: SpladePooling pools its tokens too (every attended token), so the instruction is pooled here
    prompted = st.encode(texts, prompt="query: ", convert_to_tensor=True).to_dense().numpy()
    assert eng.resolved.include_instruction and np.abs(prompted - ref).max() > 1e-3
    csr_close(eng.embed(texts, output="sparse", instruction="query: "), prompted, ATOL)


@pytest.mark.filterwarnings("ignore:.*deprecated")
def test_splade_bfloat16(splade):
    folder, st = splade
    texts = shuffled(TEXTS)
    ref = st_sparse(st, texts)
    out = Engine(str(folder), dtype="bfloat16").embed(texts, output="sparse")
    csr_close(out, ref, BF16_REL * np.abs(ref).max())


# ------------------------------------------------------------------------------------------------------ bge-m3
@pytest.fixture(scope="module")
def m3_folder(tmp_path_factory, minilm_path):
    """A tiny XLM-R folder laid out as BAAI/bge-m3: CLS pooling + Normalize modules, ``colbert_linear.pt`` and
    ``sparse_linear.pt`` (random Linear state dicts, saved as FlagEmbedding saves them); the tokenizer's eos is
    ``[SEP]``, as XLM-R's is ``</s>``."""
    from transformers import AutoTokenizer

    folder = tiny_encoder(tmp_path_factory.mktemp("m3") / "bge-m3-tiny", minilm_path, "xlm-roberta")
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.eos_token = "[SEP]"
    tok.save_pretrained(str(folder))
    g = torch.Generator().manual_seed(7)
    hidden = 48
    for name, out, shift in (("colbert_linear", hidden, 0.0), ("sparse_linear", 1, 1.0)):
        layer = torch.nn.Linear(hidden, out)
        with torch.no_grad():  # the sparse bias makes most weights positive (about 3 in 4), some cut by relu
            layer.weight.copy_(torch.randn(out, hidden, generator=g) * 0.2)
            layer.bias.copy_(shift + torch.randn(out, generator=g) * 0.1)
        torch.save(layer.state_dict(), folder / f"{name}.pt")
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, "pooling_mode_cls_token": True})
    )
    (folder / "2_Normalize").mkdir()
    return folder


def m3_reference(folder, texts, dtype=torch.float32) -> dict:
    """FlagEmbedding's M3Embedder outputs, written out over transformers' XLMRobertaModel (padded batch)."""
    from transformers import AutoTokenizer, XLMRobertaModel

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = XLMRobertaModel.from_pretrained(str(folder), dtype=dtype).eval()
    heads = {
        name: torch.load(folder / f"{name}.pt", weights_only=True) for name in ("sparse_linear", "colbert_linear")
    }
    unused = {
        tok.convert_tokens_to_ids(tok.special_tokens_map[t])
        for t in ("cls_token", "eos_token", "pad_token", "unk_token")
        if t in tok.special_tokens_map
    }
    enc = tok(texts, padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state.float()  # (B, L, H)
    dense = F.normalize(h[:, 0], dim=-1).numpy()
    weights = torch.relu(h @ heads["sparse_linear"]["weight"].T + heads["sparse_linear"]["bias"])[..., 0]
    colbert = F.normalize(h[:, 1:] @ heads["colbert_linear"]["weight"].T + heads["colbert_linear"]["bias"], dim=-1)
    lexical, vectors = [], []
    for i in range(len(texts)):
        n = int(enc["attention_mask"][i].sum())
        row = {}
        for token, w in zip(enc["input_ids"][i, :n].tolist(), weights[i, :n].tolist()):
            if token not in unused and w > 0:
                row[token] = max(row.get(token, 0.0), w)
        lexical.append(row)
        vectors.append(colbert[i, : n - 1].numpy())  # every token but CLS (the mask without its first position)
    vocab = model.config.vocab_size
    dense_sparse = np.zeros((len(texts), vocab), dtype=np.float32)
    for i, row in enumerate(lexical):
        for token, w in row.items():
            dense_sparse[i, token] = w
    return {"dense": dense, "sparse": dense_sparse, "colbert": vectors, "unused": unused}


def check_m3(out: dict, ref: dict, atol: float | None = None) -> None:
    """``atol`` for every output (float32), or ``None``: ``BF16_REL`` of each output's largest value."""

    def tol(x: float) -> float:
        return BF16_REL * x if atol is None else atol

    np.testing.assert_allclose(out["dense"], ref["dense"], atol=tol(1.0), rtol=0)
    csr_close(out["sparse"], ref["sparse"], tol(ref["sparse"].max()))
    assert len(out["colbert"]) == len(ref["colbert"])
    for ours, theirs in zip(out["colbert"], ref["colbert"]):
        assert ours.dtype == np.float32 and ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, atol=tol(1.0), rtol=0)


def test_m3_outputs_match_the_reference_from_one_forward(m3_folder):
    texts = shuffled(TEXTS)
    ref = m3_reference(m3_folder, texts)
    eng = Engine(str(m3_folder), max_batch_tokens=40)
    assert set(eng.model.token_heads) == {"sparse_linear", "colbert_linear"}
    assert len(ref["unused"]) == 4  # [CLS], [SEP] (eos), [PAD], [UNK] are dropped
    assert not ref["sparse"][:, eng.tokenizer.sep_token_id].any()
    dense = eng.embed(texts)
    dense_batches = eng.stats.batches
    assert dense_batches > 1
    out = eng.embed(texts, output=("dense", "sparse", "colbert"))
    assert list(out) == ["dense", "sparse", "colbert"]
    assert eng.stats.batches == dense_batches and eng.stats.padded_tokens == 0  # one forward for all three
    np.testing.assert_array_equal(out["dense"], dense)
    check_m3(out, ref, ATOL)
    assert out["sparse"].nnz > 0 and (ref["sparse"] == 0).any()  # relu and the special tokens drop weights
    single = {name: eng.embed(texts, output=name) for name in ("sparse", "colbert")}
    check_m3({"dense": dense, **single}, ref, ATOL)
    eng.configure(cpu_workers=2, max_batch_tokens=16384)
    check_m3(eng.embed(texts, output=("dense", "sparse", "colbert")), ref, ATOL)


def test_m3_bfloat16(m3_folder):
    texts = shuffled(TEXTS)
    ref = m3_reference(m3_folder, texts)
    out = Engine(str(m3_folder), dtype="bfloat16").embed(texts, output=("dense", "sparse", "colbert"))
    check_m3(out, ref)


def flag_colbert_score(q: np.ndarray, d: np.ndarray) -> float:
    """FlagEmbedding's colbert_score: sum over query vectors of the best dot product, over the query vectors."""
    scores = torch.einsum("in,jn->ij", torch.from_numpy(q), torch.from_numpy(d))
    return float(scores.max(-1).values.sum() / q.shape[0])


def test_score_modes_match_the_reference(m3_folder):
    queries, docs = [q for q, _ in PAIRS], [d for _, d in PAIRS]
    rq, rd = m3_reference(m3_folder, queries), m3_reference(m3_folder, docs)
    colbert = np.array([flag_colbert_score(q, d) for q, d in zip(rq["colbert"], rd["colbert"])])
    lexical = (rq["sparse"] * rd["sparse"]).sum(1)
    dense = (rq["dense"] * rd["dense"]).sum(1)
    eng = Engine(str(m3_folder))
    li = eng.score(PAIRS, mode="late-interaction")
    assert eng.stats.batches == 2  # one forward per side
    np.testing.assert_allclose(li, colbert, atol=ATOL, rtol=0)
    np.testing.assert_allclose(eng.score(PAIRS, mode="sparse"), lexical, atol=ATOL, rtol=1e-5)
    m3 = eng.score(PAIRS, mode="m3")
    assert eng.stats.batches == 2 and m3.dtype == np.float32 and m3.shape == (len(PAIRS),)
    np.testing.assert_allclose(m3, (dense + lexical + colbert) / 3, atol=ATOL, rtol=1e-5)
    assert lexical.min() < lexical.max() and colbert.min() < colbert.max()  # the scores tell pairs apart
    df = eng.rerank(PAIRS[0][0], docs, mode="late-interaction")
    np.testing.assert_allclose(
        df.sort_values("index")["score"],
        [flag_colbert_score(rq["colbert"][0], d) for d in rd["colbert"]],
        atol=ATOL,
        rtol=0,
    )
    np.testing.assert_allclose(
        eng.score(PAIRS, mode="sparse", activation="sigmoid"), 1 / (1 + np.exp(-lexical)), atol=ATOL, rtol=0
    )


# ------------------------------------------------------------------------------------------------------ tokens
@pytest.fixture(scope="module")
def minilm_raw(minilm_path):
    """all-MiniLM-L6-v2 without its Normalize module: the mean-pooled vector before normalize."""
    return Engine(minilm_path, normalize=False)


@pytest.mark.filterwarnings("ignore:.*truncated")  # one sentence is past max_length, as intended
@pytest.mark.parametrize("instruction", [None, "Represent this sentence for retrieval: "])
def test_tokens_average_to_the_mean_pooled_vector(minilm_raw, sentences, instruction):
    eng = minilm_raw
    texts = shuffled(sentences)
    eng.configure(include_instruction=False, cpu_workers=1, max_batch_tokens=512)
    try:
        dense = eng.embed(texts, instruction=instruction)
        batches = eng.stats.batches
        out = eng.embed(texts, output=("dense", "tokens"), instruction=instruction)
        assert eng.stats.batches == batches and eng.stats.padded_tokens == 0
        np.testing.assert_array_equal(out["dense"], dense)
        tokens = eng.embed(texts, output="tokens", instruction=instruction)
        reqs = eng.tokenize(texts, instruction=instruction)
        assert eng.stats.padded_tokens == 0 and len(tokens) == len(texts)
        for t, r, d, both in zip(tokens, reqs, dense, out["tokens"]):
            assert t.dtype == np.float32 and t.shape == (r.length - r.pool_start, eng.model.hidden_size)
            np.testing.assert_allclose(t.mean(0), d, atol=ATOL, rtol=0)
            np.testing.assert_array_equal(t, both)
        if instruction:
            assert all(r.pool_start > 0 for r in reqs)  # the instruction is attended to, not in the tokens
        # two CPU workers share each step (the long input would make the step too uneven to share: left out)
        short = [i for i, r in enumerate(reqs) if r.length < 100]
        assert split_for_workers([reqs[i].length for i in short], 2) is not None
        eng.configure(cpu_workers=2, max_batch_tokens=16384)
        shared = eng.embed([texts[i] for i in short], output="tokens", instruction=instruction)
        assert eng.stats.padded_tokens == 0
        for a, i in zip(shared, short):
            np.testing.assert_allclose(a, tokens[i], atol=ATOL, rtol=0)
    finally:
        eng.configure(include_instruction=None, cpu_workers=None, max_batch_tokens=16384)


def test_tokens_on_a_decoder_with_chunked_prefill(tmp_path):
    path = tiny_llama(tmp_path, "qwen2")
    texts = shuffled(
        [
            "The quick brown fox jumps over the lazy dog. " * 4,
            "a",
            "What is the capital of France?",
            "Embeddings map text to vectors; rerankers score a query against a document. " * 2,
        ]
    )
    instruction = "Given a claim, retrieve: "
    plain = Engine(str(path), pooling="mean")
    want = plain.embed(texts, output=("dense", "tokens"), instruction=instruction)
    eng = Engine(str(path), pooling="mean", chunked_prefill=8, cpu_workers=2)
    dense = eng.embed(texts, instruction=instruction)
    batches = eng.stats.batches
    out = eng.embed(texts, output=("dense", "tokens"), instruction=instruction)
    assert eng.stats.chunks > len(texts) and eng.stats.shared_prefix > 0  # the KV path: chunks and a cached prefix
    assert eng.stats.batches == batches and eng.stats.padded_tokens == 0
    np.testing.assert_allclose(out["dense"], dense, atol=ATOL, rtol=0)
    for t, w, d in zip(out["tokens"], want["tokens"], dense):
        assert t.shape == w.shape
        np.testing.assert_allclose(t, w, atol=ATOL, rtol=0)
        np.testing.assert_allclose(t.mean(0), d, atol=ATOL, rtol=0)
    # lasttoken: alone, the last layer runs for the pooled rows only (rows()); with tokens it must run for all
    last = Engine(str(path))
    assert last.resolved.pooling == "lasttoken" and last.model.computes_output_rows
    alone = last.embed(texts)
    both = last.embed(texts, output=("dense", "tokens"))
    np.testing.assert_allclose(both["dense"], alone, atol=ATOL, rtol=0)  # two kernel paths: measured 1e-6
    for t, d, r in zip(both["tokens"], both["dense"], last.tokenize(texts)):
        assert t.shape == (r.length, last.model.hidden_size)
        np.testing.assert_array_equal(t[-1], d)


@pytest.mark.filterwarnings("ignore:.*truncated")
def test_tokens_bfloat16(minilm_path, sentences):
    eng = Engine(minilm_path, normalize=False, dtype="bfloat16")
    out = eng.embed(sentences, output=("dense", "tokens"))
    for t, d in zip(out["tokens"], out["dense"]):
        assert t.dtype == np.float32
        np.testing.assert_allclose(t.mean(0), d, atol=ATOL, rtol=0)  # the same bfloat16 rows, averaged in float32


# ------------------------------------------------------------------------------------------------------ errors
def test_errors_name_the_heads_and_change_nothing(minilm_engine, m3_folder, splade, tmp_path, minilm_path):
    eng = minilm_engine
    eng.embed(["x"])
    before, knobs = eng.stats, eng.knobs
    with pytest.raises(ValueError, match=r"output='sparse' needs a sparse head.*no per-token heads.*dense, tokens"):
        eng.embed(["a"], output="sparse")
    with pytest.raises(ValueError, match=r"output='colbert' needs a ColBERT head"):
        eng.embed(["a"], output=("dense", "colbert"))
    with pytest.raises(ValueError, match=r"unknown output 'vectors'; valid: 'dense', 'tokens', 'sparse', 'colbert'"):
        eng.embed(["a"], output="vectors")
    with pytest.raises(ValueError, match="twice"):
        eng.embed(["a"], output=("dense", "dense"))
    with pytest.raises(TypeError, match="output must be"):
        eng.embed(["a"], output=())
    with pytest.raises(ValueError, match=r"mode='late-interaction' needs a ColBERT head"):
        eng.score([("q", "d")], mode="late-interaction")
    with pytest.raises(ValueError, match=r"mode='m3' needs a sparse head"):
        eng.score([("q", "d")], mode="m3")
    assert eng.stats is before and eng.knobs == knobs

    m3 = Engine(str(m3_folder))
    with pytest.raises(ValueError, match="activation='softmax'"):
        m3.score([("q", "d")], mode="m3", activation="softmax")
    with pytest.raises(ValueError, match="similarity='dot' is for mode='bi-encoder'"):
        m3.score([("q", "d")], mode="sparse", similarity="dot")
    splade_folder, _ = splade
    with pytest.raises(ValueError, match=r"colbert.*has a masked-LM head; its outputs: dense, tokens, sparse"):
        Engine(str(splade_folder)).embed(["a"], output="colbert")
    mlm = Engine(str(tiny_encoder(tmp_path / "mlm", minilm_path, "bert", masked_lm=True)))
    with pytest.raises(ValueError, match="masked-LM head \\(no SpladePooling module"):
        mlm.embed(["a"], output="sparse")
    assert m3.embed([], output=("sparse", "colbert"))["sparse"].shape == (0, m3.model.config["vocab_size"])


def test_an_m3_head_of_the_wrong_width_is_named(m3_folder, tmp_path):
    """A ``colbert_linear.pt`` whose input width is not the model's hidden size fails at load, naming the tensor and
    the shape config.json implies, not inside torch at the first call."""
    import shutil

    folder = tmp_path / "m3-wrong"
    shutil.copytree(m3_folder, folder)
    torch.save(torch.nn.Linear(40, 48).state_dict(), folder / "colbert_linear.pt")
    with pytest.raises(
        ValueError,
        match=r"'colbert_linear.weight'.*has shape \(48, 40\), but config.json implies "
        r"\(48, 48\) \(\(outputs, hidden_size\)\)",
    ):
        Engine(str(folder))


def test_a_registered_output_kind_is_offered_by_embed(minilm_path, monkeypatch):
    """``register`` a toy output kind (in a scratch copy of ``KINDS``): ``embed(output=...)`` gives it, alone and
    beside ``dense`` from one forward, and a model without it gets the kind's ``needs`` in the error."""
    from lab.outputs import kinds
    from lab.outputs.heads import TokensHead
    from lab.outputs.kinds import Output, OutputKind, register
    from lab.outputs.pooling import pooling_method

    monkeypatch.setattr(kinds, "KINDS", dict(kinds.KINDS))
    eng = Engine(minilm_path)
    texts = ["a man plays a guitar", "short", "two dogs run in the snow"]
    with pytest.raises(ValueError, match="unknown output 'first_rows'; valid: 'dense', 'tokens', 'sparse', 'colbert'"):
        eng.embed(texts, output="first_rows")
    register(
        OutputKind("first_rows", lambda model, spec: True, lambda *_: Output(pooling_method("tokens"), TokensHead()))
    )
    first = eng.embed(texts, output="first_rows")
    tokens = eng.embed(texts, output="tokens")
    assert all(np.array_equal(a, b) for a, b in zip(first, tokens))
    both = eng.embed(texts, output=("dense", "first_rows"))
    np.testing.assert_array_equal(both["dense"], eng.embed(texts))
    register(OutputKind("never", lambda model, spec: False, lambda *_: None, needs="a head no model has"))
    with pytest.raises(
        ValueError, match="output='never' needs a head no model has; .* its outputs: dense, tokens, first_rows"
    ):
        eng.embed(texts, output="never")
    with pytest.raises(TypeError, match="OutputKind"):
        register("never")
