"""ColBERT folders of sentence-transformers (``MultiVectorEncoder``) and PyLate: ``embed(output="colbert")``
(``lab.outputs.multivector``).

Oracle: sentence-transformers' own ``MultiVectorEncoder.encode_query`` / ``encode_document`` / ``encode`` on tiny
random folders it saved (Transformer with per-task lengths and query expansion, token-level Dense, MultiVectorMask
with a punctuation skiplist, Normalize), and on a PyLate (<= 3) save of the same weights that it loads itself. Inputs
are shuffled, odd-sized, with one-token and empty texts; small token budgets force several packed steps; CPU workers
share the steps.
"""

from __future__ import annotations

import random
import string
import warnings

import numpy as np
import pytest
import torch
from tiny_encoders import tiny_encoder

from lab import Engine
from lab.ops.attention import visible_keys_attention
from lab.ops.batch import AttnMeta
from lab.outputs.scoring import maxsim_matrix

st = pytest.importorskip("sentence_transformers")
if not hasattr(st, "MultiVectorEncoder"):
    pytest.skip("this sentence-transformers has no MultiVectorEncoder", allow_module_level=True)

QUERIES = [
    "what is a cat?",
    "hi",
    "a much longer query that will certainly run past the fixed query length",
    "x y",
    "",
    "Why do dogs bark at night, and what can be done?",
    "q",
]
DOCS = [
    "A cat is an animal, small.",
    "x",
    "Dogs! bark; loudly... (sometimes) at night.",
    "hello world",
    "",
    "Protein folding remains a central problem of computational biology; it is hard.",
    "z",
    "Café crème.",
]
ATOL = 1e-5  # float32 (measured <= 2e-7)
BF16_ATOL = 0.03  # bfloat16 unit vectors against the float32 oracle (measured ~0.01)


def _save_mv(
    out,
    minilm_path,
    *,
    expansion=None,
    query_length=None,
    document_length=None,
    dense=16,
    skiplist=True,
    normalize=True,
    activation=None,
):
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    base = tiny_encoder(out.parent / f"{out.name}-base", minilm_path)
    modules = [
        Transformer(str(base), query_expansion=expansion, query_length=query_length, document_length=document_length)
    ]
    if dense:
        modules.append(
            Dense(
                in_features=48,
                out_features=dense,
                bias=activation is not None,
                activation_function=activation or torch.nn.Identity(),
                module_input_name="token_embeddings",
            )
        )
    modules.append(MultiVectorMask(skiplist_words=list(string.punctuation) if skiplist else None))
    if normalize:
        modules.append(Normalize(module_input_name="token_embeddings"))
    torch.manual_seed(7)
    if dense:
        torch.nn.init.normal_(modules[1].linear.weight, std=0.3)
    model = MultiVectorEncoder(modules=modules, prompts={"query": "[Q] ", "document": "[D] "}, device="cpu")
    model.save(str(out))
    return out


VARIANTS = {
    "fixed": {"expansion": {"strategy": "fixed", "attend": False, "length": 12}, "document_length": 14},
    "fixed-attend": {"expansion": {"strategy": "fixed", "attend": True, "length": 12}},
    "min": {"expansion": {"strategy": "min", "attend": False, "length": 8}, "query_length": 16},
    "plain": {"query_length": 10, "skiplist": False, "normalize": False, "dense": 0},
    "tanh": {
        "expansion": {"strategy": "fixed", "attend": False, "length": 12},
        "activation": torch.nn.Tanh(),
        "normalize": False,
    },  # a biased Dense with tanh, no Normalize
}


def _as_pylate(native, out):
    """A PyLate (<= 3) save of the same weights: [Transformer, pylate Dense] only, the ColBERT knobs at the top level
    of config_sentence_transformers.json, prefixes that are vocabulary tokens text would split ([unused0])."""
    import json
    import shutil

    shutil.copytree(native, out)
    for extra in ("2_MultiVectorMask", "3_Normalize"):
        shutil.rmtree(out / extra)
    (out / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
            ]
        )
    )
    (out / "1_Dense" / "config.json").write_text(
        json.dumps(
            {
                "in_features": 48,
                "out_features": 16,
                "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity",
            }
        )
    )
    (out / "config_sentence_transformers.json").write_text(
        json.dumps(
            {
                "model_type": "ColBERT",
                "query_prefix": "[unused0]",
                "document_prefix": "[unused1]",
                "query_length": 10,
                "document_length": 20,
                "attend_to_expansion_tokens": False,
                "similarity_fn_name": "MaxSim",
            }
        )
    )
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_path):
    root = tmp_path_factory.mktemp("mv")
    out = {name: _save_mv(root / name, minilm_path, **kw) for name, kw in VARIANTS.items()}
    out["pylate"] = _as_pylate(out["fixed"], root / "pylate")
    return out


def _reference(path, texts, task):
    from sentence_transformers import MultiVectorEncoder

    model = MultiVectorEncoder(str(path), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enc = {"query": model.encode_query, "document": model.encode_document, None: model.encode}[task]
        return [e.numpy() for e in enc(texts)]


def _ours(eng, texts, task):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # truncation warnings: the long query is cut on purpose
        return eng.embed(texts, output="colbert", prompt_name=task)


def _close(ours, ref, atol):
    assert len(ours) == len(ref)
    for o, r in zip(ours, ref):
        assert isinstance(o, np.ndarray) and o.dtype == np.float32
        assert o.shape == r.shape
        np.testing.assert_allclose(o, r, atol=atol, rtol=0)


@pytest.mark.parametrize("variant", [*VARIANTS, "pylate"])
@pytest.mark.parametrize("task", ["query", "document", None])
def test_colbert_matches_multi_vector_encoder(folders, variant, task):
    texts = list(QUERIES if task == "query" else DOCS)
    random.Random(hash((variant, task)) % 1000).shuffle(texts)
    ref = _reference(folders[variant], texts, task)
    eng = Engine(str(folders[variant]), max_batch_tokens=40)
    _close(_ours(eng, texts, task), ref, ATOL)
    assert eng.stats.padded_tokens == 0
    eng.configure(cpu_workers=2, max_batch_tokens=16384)
    _close(_ours(eng, texts, task), ref, ATOL)


def test_query_expansion_shapes_and_masked_keys(folders):
    """fixed: every query is exactly `length` vectors; attend=False differs from attend=True (the [MASK] tokens are
    no keys), so the key-limited attention is really exercised by the parity test above."""
    e_fixed, e_attend = Engine(str(folders["fixed"])), Engine(str(folders["fixed-attend"]))
    q = _ours(e_fixed, ["hi", "what is a cat?"], "query")
    assert [len(x) for x in q] == [12, 12]
    a = _ours(e_attend, ["hi"], "query")[0]
    # same weights (same seed), different attention: the first (real) token's vector moves
    assert np.abs(q[0][0] - a[0]).max() > 1e-3
    d = _ours(e_fixed, ["A cat, small."], "document")[0]
    assert len(d) == 6  # [CLS] [ d ] a cat , small . [SEP]: the skiplist drops '[', ']', ',' and '.'


def test_bfloat16_and_maxsim(folders):
    path = folders["fixed"]
    eng = Engine(str(path), dtype="bfloat16")
    rq, rd = _reference(path, QUERIES, "query"), _reference(path, DOCS, "document")
    _close(_ours(eng, QUERIES, "query"), rq, BF16_ATOL)
    _close(_ours(eng, DOCS, "document"), rd, BF16_ATOL)
    from sentence_transformers import MultiVectorEncoder

    ref = (
        MultiVectorEncoder(str(path), device="cpu")
        .similarity([torch.from_numpy(x) for x in rq], [torch.from_numpy(x) for x in rd])
        .numpy()
    )
    ours = maxsim_matrix(rq, rd) * np.asarray([len(x) for x in rq])[:, None]  # ours divides by query length
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_visible_keys_attention_matches_masked_softmax():
    torch.manual_seed(0)
    lens, keys = [5, 1, 7, 5], [3, 1, 7, 5]
    q, k, v = torch.randn(sum(lens), 4, 8), torch.randn(sum(lens), 2, 8), torch.randn(sum(lens), 2, 8)
    meta = AttnMeta.from_lengths(lens, causal=False, key_lens=keys)
    out = visible_keys_attention(q, k, v, meta)
    start = 0
    for n, kl in zip(lens, keys):
        qi = q[start : start + n].transpose(0, 1)
        ki = k[start : start + kl].repeat_interleave(2, dim=1).transpose(0, 1)
        vi = v[start : start + kl].repeat_interleave(2, dim=1).transpose(0, 1)
        ref = torch.softmax(qi @ ki.transpose(1, 2) / 8**0.5, -1) @ vi
        torch.testing.assert_close(out[start : start + n], ref.transpose(0, 1), atol=1e-5, rtol=0)
        start += n
    assert AttnMeta.from_lengths(lens, causal=False, key_lens=lens).key_lens is None  # all visible: the fast path


def test_unsupported_multi_vector_folders_are_refused(folders, tmp_path):
    import json
    import shutil

    path = shutil.copytree(folders["fixed"], tmp_path / "image-docs")
    cfg = path / "2_MultiVectorMask" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "keep_only_token_ids": [5]}))
    with pytest.raises(ValueError, match="keep_only_token_ids"):
        Engine(str(path))
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "keep_only_token_ids": None}))
    modules = json.loads((path / "modules.json").read_text())
    dense = "sentence_transformers.base.modules.dense.Dense"
    for extra, match in (
        ({"idx": 4, "name": "4", "path": "1_Dense", "type": dense}, "more than one Dense"),
        ({"idx": 4, "name": "4", "path": "../elsewhere", "type": "x.Normalize"}, "outside"),
        ({"idx": 4, "name": "4", "path": "", "type": "x.HierarchicalTokenPooling"}, "not supported"),
    ):
        (path / "modules.json").write_text(json.dumps([*modules, extra]))
        with pytest.raises(ValueError, match=match):
            Engine(str(path))
    (path / "modules.json").write_text(json.dumps(modules))
    dcfg = path / "1_Dense" / "config.json"
    dcfg.write_text(
        json.dumps({**json.loads(dcfg.read_text()), "activation_function": "torch.nn.modules.activation.ReLU"})
    )
    with pytest.raises(ValueError, match="activation_function"):
        Engine(str(path))


def test_colbert_on_a_plain_encoder_names_the_fix(minilm_engine):
    with pytest.raises(ValueError, match="MultiVectorEncoder"):
        minilm_engine.embed(["a"], output="colbert")


def test_pylate_prefixes_are_single_tokens(folders):
    eng = Engine(str(folders["pylate"]))
    assert eng.prompts["query"] == "[unused0]" and eng.prompts["document"] == "[unused1]"
    assert eng.tokenizer.tokenize("[unused0]what") == ["[unused0]", "what"]
    q = _ours(eng, ["hi"], "query")[0]
    assert len(q) == 10  # PyLate's query_length is the expansion length


def test_encode_query_and_document_answer_as_multi_vector_encoder(folders):
    from sentence_transformers import MultiVectorEncoder

    path = folders["fixed"]
    model, eng = MultiVectorEncoder(str(path), device="cpu"), Engine(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kw in ({}, {"convert_to_numpy": True}, {"normalize_embeddings": True, "truncate_dim": 8}):
            for name in ("encode_query", "encode_document", "encode"):
                ref, ours = getattr(model, name)(QUERIES, **kw), getattr(eng, name)(QUERIES, **kw)
                assert type(ours) is type(ref) and len(ours) == len(ref)
                for o, r in zip(ours, ref):
                    assert type(o) is type(r) and o.shape == r.shape
                    np.testing.assert_allclose(np.asarray(o), np.asarray(r), atol=ATOL, rtol=0)
        one = eng.encode_query("what is a cat?")
        assert isinstance(one, torch.Tensor) and one.shape == model.encode_query("what is a cat?").shape
        assert eng.encode_document([]) == []
    for bad, match in (
        ({"convert_to_tensor": True}, "convert_to_tensor"),
        ({"precision": "int8"}, "precision"),
        ({"task": "passage"}, "task"),
        ({"output_value": "sentence_embedding"}, "output_value"),
    ):
        with pytest.raises(ValueError, match=match):
            eng.encode(["a"], **bad)


def test_late_interaction_retrieval_runs_the_folder_tasks(folders):
    """lab.eval.retrieval's late-interaction mode on a ColBERT folder: queries as queries, documents as documents."""
    from sentence_transformers import MultiVectorEncoder

    from lab.eval.retrieval import score_matrix

    path = folders["fixed"]
    model = MultiVectorEncoder(str(path), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, d = model.encode_query(QUERIES), model.encode_document(DOCS)
        ours = score_matrix(Engine(str(path)), "late-interaction", QUERIES, DOCS)
    ref = model.similarity(q, d).numpy() / np.asarray([len(x) for x in q])[:, None]
    np.testing.assert_allclose(ours, ref, atol=1e-5)
