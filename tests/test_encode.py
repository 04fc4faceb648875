"""``Engine.encode`` / ``encode_query`` / ``encode_document`` against ``SentenceTransformer`` on the same folder.

A copy of all-MiniLM-L6-v2 whose ``config_sentence_transformers.json`` carries prompts (and whose Pooling config says
``include_prompt: false``), and a second copy with a ``default_prompt_name`` (prompt pooled, the original config).
Every row of the argument table is run on both libraries with the same inputs (shuffled, odd count, a one-token text,
an empty text, one past ``max_seq_length``) and compared: same container type, shape and dtype; float results at
cosine >= 0.99999 and 1e-4 relative norms; quantized ones bucket for bucket (a bucket boundary may fall between two
float32 results 1e-6 apart: at most 1 % of the entries may differ, by one bucket / one bit). ``lab.outputs.quantize``
itself equals sentence-transformers' ``quantize_embeddings`` exactly on the same float inputs.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import cosine_rows, link_copy

pytest.importorskip("sentence_transformers")
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*longer than max_length.*:UserWarning", "ignore:.*quantization.*:UserWarning"
)

PROMPTS = {"query": "query: ", "passage": "passage: ", "clf": "Classify the topic of this text: "}
DEFAULT_PROMPTS = {"query": "Represent the question: ", "document": "Represent the document: "}
COS = 0.99999


def _texts(sentences) -> list[str]:
    texts = [*sentences, "b", "Another short one."]
    random.Random(3).shuffle(texts)
    assert len(texts) % 2 == 1
    return texts


def _write_st_config(folder: Path, prompts: dict, default: str | None) -> None:
    cfg = {"prompts": prompts, "default_prompt_name": default, "similarity_fn_name": "cosine"}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module")
def folders(minilm_path, tmp_path_factory) -> dict[str, str]:
    src = Path(minilm_path)
    modules = json.loads((src / "modules.json").read_text())
    pool_dir = next(m["path"] for m in modules if m["type"].endswith("Pooling"))
    root = tmp_path_factory.mktemp("encode_models")
    prompted = link_copy(src, root / "prompted", skip={pool_dir, "config_sentence_transformers.json"})
    shutil.copytree(src / pool_dir, prompted / pool_dir)
    pool_cfg = json.loads((src / pool_dir / "config.json").read_text())
    (prompted / pool_dir / "config.json").write_text(json.dumps({**pool_cfg, "include_prompt": False}))
    _write_st_config(prompted, PROMPTS, None)
    default = link_copy(src, root / "default", skip={"config_sentence_transformers.json"})
    _write_st_config(default, DEFAULT_PROMPTS, "document")
    return {"prompted": str(prompted), "default": str(default)}


@pytest.fixture(scope="module")
def engines(folders):
    from lab import Engine

    return {name: Engine(path, dtype="float32", device="cpu") for name, path in folders.items()}


@pytest.fixture(scope="module")
def st_models(folders):
    from sentence_transformers import SentenceTransformer

    return {name: SentenceTransformer(path, device="cpu") for name, path in folders.items()}


def _assert_float(ours, ref, what):
    assert ours.shape == ref.shape, what
    ours, ref = (
        np.asarray(ours, dtype=np.float64).reshape(-1, ours.shape[-1]),
        np.asarray(ref).reshape(-1, ref.shape[-1]),
    )
    cos = cosine_rows(ours, ref)
    assert cos.min() >= COS, f"{what}: lowest cosine {cos.min():.7f}"
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-4, err_msg=what)


def _assert_quantized(ours, ref, what):
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, (what, ours.shape, ref.shape, ours.dtype, ref.dtype)
    if ref.dtype in (np.int8, np.uint8) and what.endswith("binary"):
        ours, ref = np.unpackbits(ours.view(np.uint8)), np.unpackbits(ref.view(np.uint8))
    diff = np.abs(ours.astype(np.int16) - ref.astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() <= 1e-2, f"{what}: {(diff > 0).sum()} of {diff.size} differ"


def _same(ours, ref, what: str, precision: str = "float32"):
    """Same container (array / tensor / list of tensors / one row), same shapes and dtypes, same values."""
    assert type(ours) is type(ref), (what, type(ours), type(ref))
    if isinstance(ref, list):
        assert len(ours) == len(ref), what
        for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
            _same(a, b, f"{what}[{i}]", precision)
        return
    if isinstance(ref, torch.Tensor):
        assert ours.dtype == ref.dtype, (what, ours.dtype, ref.dtype)
        ours, ref = ours.numpy(), ref.numpy()
    assert ours.dtype == ref.dtype, (what, ours.dtype, ref.dtype)
    if precision == "float32":
        _assert_float(ours, ref, what)
    else:
        _assert_quantized(ours, ref, f"{what} {precision}")


# (folder, arguments): the parity table. Each row runs on both libraries with the same texts.
TABLE = [
    ("prompted", {}),
    ("prompted", {"normalize_embeddings": True}),
    ("prompted", {"truncate_dim": 128}),
    ("prompted", {"truncate_dim": 100, "normalize_embeddings": True}),
    ("prompted", {"prompt_name": "query"}),
    ("prompted", {"prompt_name": "clf", "normalize_embeddings": True}),
    ("prompted", {"prompt": "Represent this sentence for searching relevant passages: "}),
    ("prompted", {"convert_to_tensor": True}),
    ("prompted", {"convert_to_numpy": False}),
    ("prompted", {"convert_to_numpy": False, "convert_to_tensor": True, "truncate_dim": 64}),
    ("prompted", {"batch_size": 3, "show_progress_bar": False}),
    ("prompted", {"precision": "int8"}),
    ("prompted", {"precision": "uint8", "prompt_name": "query"}),
    ("prompted", {"precision": "binary"}),
    ("prompted", {"precision": "ubinary", "convert_to_tensor": True}),
    ("prompted", {"output_value": "token_embeddings"}),
    ("prompted", {"output_value": "token_embeddings", "prompt_name": "query"}),
    ("prompted", {"output_value": "token_embeddings", "precision": "int8"}),
    ("default", {}),
    ("default", {"prompt_name": "query"}),
    ("default", {"prompt": ""}),
    ("default", {"normalize_embeddings": True, "truncate_dim": 200, "device": "cpu"}),
]


@pytest.mark.parametrize(("folder", "kwargs"), TABLE, ids=[f"{f}-{json.dumps(k)}" for f, k in TABLE])
def test_encode_matches_sentence_transformers(engines, st_models, sentences, folder, kwargs):
    texts = _texts(sentences)
    ref = st_models[folder].encode(texts, **kwargs)
    ours = engines[folder].encode(texts, **kwargs)
    _same(ours, ref, f"{folder} {kwargs}", kwargs.get("precision", "float32"))


@pytest.mark.parametrize(
    ("folder", "kwargs"),
    [
        ("prompted", {}),
        ("prompted", {"output_value": "token_embeddings"}),
        ("prompted", {"convert_to_tensor": True}),
        ("default", {"precision": "ubinary"}),
    ],
)
def test_single_string_gives_one_vector(engines, st_models, folder, kwargs):
    text = "A man is playing a guitar."
    ref = st_models[folder].encode(text, **kwargs)
    ours = engines[folder].encode(text, **kwargs)
    assert np.ndim(ours) == np.ndim(ref) and np.ndim(ref) in (1, 2)
    _same(ours[None], ref[None], str(kwargs), kwargs.get("precision", "float32"))


@pytest.mark.parametrize("folder", ["prompted", "default"])
@pytest.mark.parametrize("kind", ["query", "document"])
def test_encode_query_and_document_use_the_models_prompts(engines, st_models, sentences, folder, kind):
    texts = _texts(sentences)
    ref = getattr(st_models[folder], f"encode_{kind}")(texts)
    ours = getattr(engines[folder], f"encode_{kind}")(texts)
    _same(ours, ref, f"{folder} encode_{kind}")
    # not a tautology: the prompt changes the vectors, unless it is empty (sentence-transformers >= 5 gives every
    # model empty query / document prompts; "prompted" names "passage", not "document")
    no_prompt = cosine_rows(ours, st_models[folder].encode(texts, prompt="")).min()
    assert no_prompt > COS if (folder, kind) == ("prompted", "document") else no_prompt < 0.999


def test_embed_prompt_name_and_default_prompt(engines, st_models, minilm_st, sentences):
    texts = _texts(sentences)
    e = engines["prompted"]
    _assert_float(
        e.embed(texts, prompt_name="query"),
        st_models["prompted"].encode(texts, prompt_name="query"),
        "embed(prompt_name='query')",
    )
    assert e.prompts == {"document": "", **PROMPTS} == st_models["prompted"].prompts
    d = engines["default"]  # default_prompt_name: used when no instruction is named, as sentence-transformers does
    assert d.resolved["instruction"] == DEFAULT_PROMPTS["document"]
    _assert_float(d.embed(texts), st_models["default"].encode(texts), "embed() with the default prompt")
    _assert_float(d.embed(texts, instruction=None), minilm_st.encode(texts), "embed(instruction=None): no prompt")
    d.configure(instruction="query: ")  # the knob wins over the default prompt
    try:
        _assert_float(d.embed(texts), st_models["default"].encode(texts, prompt="query: "), "instruction knob")
    finally:
        d.configure(instruction=None)
    assert d.resolved["instruction"] == DEFAULT_PROMPTS["document"]


def test_encode_errors_name_the_problem(engines):
    e = engines["prompted"]
    bad = [
        ({"prompt_name": "nope"}, ValueError, "query"),
        ({"prompt_name": "query", "prompt": "x: "}, ValueError, "not both"),
        ({"device": "cuda"}, ValueError, "Engine(path, device="),
        ({"device": ["cpu", "cpu"]}, ValueError, "RayEngine"),
        ({"pool": {"processes": []}}, ValueError, "cpu_workers"),
        ({"output_value": None}, ValueError, "token_embeddings"),
        ({"batch_size": 0}, ValueError, "positive"),
        ({"truncate_dim": 1000}, ValueError, "exceeds"),
        ({"precision": "int4"}, ValueError, "ubinary"),
        ({"normalise_embeddings": True}, TypeError, "normalise_embeddings"),
    ]
    before = (dict(e.knobs), e.stats)
    for kwargs, exc, words in bad:
        with pytest.raises(exc, match=None) as info:
            e.encode(["a text"], **kwargs)
        assert words in str(info.value), (kwargs, str(info.value))
    with pytest.raises(ValueError, match="not both"):
        e.embed(["a"], instruction="x", prompt_name="query")
    with pytest.raises(ValueError, match="single embedding|several embeddings"):
        e.encode(["one text only"], precision="int8")  # int8 ranges cannot come from one row (as ST)
    assert (dict(e.knobs), e.stats) == before
    assert isinstance(e.encode([]), np.ndarray) and e.encode([]).size == 0
    assert e.encode(inputs=["a", "b"]).shape == (2, 384)  # sentence-transformers >= 5's argument name


def test_default_prompt_name_must_be_a_prompt(minilm_path, tmp_path):
    from lab import Engine

    folder = link_copy(Path(minilm_path), tmp_path / "bad", skip={"config_sentence_transformers.json"})
    _write_st_config(folder, {"query": "q: "}, "passage")
    with pytest.raises(ValueError, match="default_prompt_name 'passage'"):
        Engine(str(folder))


@pytest.mark.parametrize("precision", ["float32", "int8", "uint8", "binary", "ubinary"])
def test_quantize_equals_sentence_transformers_exactly(precision):
    from sentence_transformers.util.quantization import quantize_embeddings as st_quantize

    from lab.outputs.quantize import quantize_embeddings

    rng = np.random.default_rng(0)
    emb = rng.standard_normal((37, 100)).astype(np.float32)  # 100 dims: the last packed byte is partial
    calib = rng.standard_normal((200, 100)).astype(np.float32) * 0.5
    cases = [
        ((emb,), {}),
        ((torch.from_numpy(emb),), {}),
        ((emb,), {"calibration_embeddings": calib}),
        ((emb,), {"ranges": np.stack([calib.min(0), calib.max(0)])}),
        (([emb[:5], emb[5:6], emb[6:]],), {}),  # token vectors: shared ranges
        ((np.zeros((4, 16), np.float32),), {}),
    ]  # every range empty: step 1
    for args, kwargs in cases:
        ours, ref = quantize_embeddings(*args, precision, **kwargs), st_quantize(*args, precision=precision, **kwargs)
        for a, b in zip(
            ours if isinstance(ours, list) else [ours], ref if isinstance(ref, list) else [ref], strict=True
        ):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (precision, kwargs)
