"""LLM2Vec as llm2vec 0.2.3 computes it, with no knob an llm2vec user would not pass: its document cut
(``doc_max_length``), the folder its ``llm2vec_config.json`` is read from, its class defaults for layouts without
that file, bidirectional attention by default, and the name its chat template is chosen by.

Each rule is checked against a plain re-implementation of llm2vec's published code (``ref_*`` below, written from
``LLM2Vec.from_pretrained`` / ``prepare_for_tokenization`` / ``_convert_to_str``), independent of ``lab``'s.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from test_llm2vec_layouts import MNTP_ID, bare_adapter, published_layout, with_llm2vec_config
from tiny_models import tiny_llama

from lab import Engine as _Engine
from lab.engine.llm2vec import Llm2VecNotice, cut_document

WORDS = (
    "retrieval",
    "of",
    "scientific",
    "abstracts",
    "needs",
    "long",
    "documents",
    "and",
    "tokenizers",
    "split",
    "rare",
    "words",
    "into",
    "pieces",
)
LLAMA2 = "meta-llama/Llama-2-7b-chat-hf"


def Engine(*args, **kw) -> _Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Llm2VecNotice)
        return _Engine(*args, **{"device": "cpu", "normalize": False, **kw})


def documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 180)))) + "." for _ in range(n)]


# ---------------------------------------------------------------- llm2vec 0.2.3's rules, re-implemented plainly
def ref_cut(tokenizer, text: str, max_length: int, doc_max_length: int) -> str:
    """``LLM2Vec._convert_to_str``'s loop on the text."""

    def count(t):
        return len(tokenizer([t], truncation=True, max_length=max_length, add_special_tokens=False)["input_ids"][0])

    n = count(text)
    while n > doc_max_length:
        ratio = doc_max_length / n
        keep = int(len(text.split()) * ratio)
        text = " ".join(text.split()[:keep])
        n = count(text)
    return text


def ref_config(base_folder: Path, peft_folder: Path | None) -> dict:
    """``LLM2Vec.from_pretrained``'s settings: the class defaults updated with the one llm2vec_config.json it reads
    (the peft folder's when one is given, else the base folder's)."""
    config = {"pooling_mode": "mean", "max_length": 512, "doc_max_length": 400, "skip_instruction": True}
    where = peft_folder if peft_folder is not None else base_folder
    if (where / "llm2vec_config.json").exists():
        config.update(json.loads((where / "llm2vec_config.json").read_text()))
    return config


def ref_wrap(name_or_path: str, text: str) -> str:
    """``prepare_for_tokenization`` for mean pooling: the chat template chosen by ``config._name_or_path``."""
    if name_or_path == "meta-llama/Meta-Llama-3-8B-Instruct":
        return "<|start_header_id|>user<|end_header_id|>\n\n" + text.strip() + "<|eot_id|>"
    if name_or_path in ("mistralai/Mistral-7B-Instruct-v0.2", LLAMA2):
        return "[INST] " + text.strip() + " [/INST]"
    return text


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("fidelity"), "llama")


# ------------------------------------------------------------------------------------------------ the cut
def test_cut_document_is_llm2vecs_loop(base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    kw = {"add_special_tokens": False, "truncation": True}
    for max_length, limit in [(512, 40), (64, 40), (30, 7), (256, 1)]:
        for text in documents(30, seed=max_length):
            want = ref_cut(tok, text, max_length, limit)
            got = cut_document(text, lambda t, m=max_length: len(tok(t, max_length=m, **kw)["input_ids"]), limit)
            assert got == want, (max_length, limit, text)


def test_doc_max_length_cuts_as_llm2vec_in_every_call_kind(base, tmp_path):
    from transformers import AutoTokenizer

    folder = with_llm2vec_config(base, tmp_path / "cfg", pooling_mode="mean", doc_max_length=12)
    tok = AutoTokenizer.from_pretrained(base)
    docs = documents(17)
    eng = Engine(str(folder))
    assert eng.resolved["doc_max_length"] == 12
    assert eng.resolved.sources["doc_max_length"] == f"llm2vec_config.json in {folder}"
    cut = [ref_cut(tok, d, eng.resolved.max_length, 12) for d in docs]
    assert sum(c != d for c, d in zip(cut, docs)) >= 5  # the documents really are cut
    off = Engine(str(folder), doc_max_length=0)  # 0: the cut off
    assert off.resolved["doc_max_length"] is None
    want = off.embed(cut)
    np.testing.assert_array_equal(eng.embed(docs), want)
    np.testing.assert_array_equal(eng.encode(docs), want)
    np.testing.assert_allclose(
        eng.score([("a query", d) for d in docs]), off.score([("a query", c) for c in cut]), rtol=1e-6, atol=1e-6
    )
    assert not np.allclose(off.embed(docs), want, atol=1e-4)
    # with an instruction the text is cut, never the instruction
    np.testing.assert_array_equal(
        eng.embed(docs, instruction="Represent the abstract: "), off.embed(cut, instruction="Represent the abstract: ")
    )
    # long inputs in windows: the cut first, the windows split what is left
    chunked = Engine(str(folder), long_inputs="chunk", max_length=8, doc_max_length=12)
    plain = Engine(str(folder), long_inputs="chunk", max_length=8, doc_max_length=0)
    cut8 = [ref_cut(tok, d, 8, 12) for d in docs]
    np.testing.assert_array_equal(chunked.embed(docs), plain.embed(cut8))


def test_doc_max_length_is_off_for_other_models(minilm_path):
    eng = Engine(minilm_path, normalize=None)
    assert eng.resolved["doc_max_length"] is None and eng.resolved.sources["doc_max_length"] == "model default"
    with pytest.raises(ValueError, match="doc_max_length must be a non-negative int or None"):
        eng.configure(doc_max_length=-1)


# ------------------------------------------------------------------------------ settings: which folder, defaults
def test_settings_come_from_the_folder_llm2vec_reads(base, tmp_path):
    """``Engine(model, adapters=[..., last])`` is ``LLM2Vec.from_pretrained(model, peft_model_name_or_path=last)``:
    the settings come from the last adapter's llm2vec_config.json when it has one, else from llm2vec's defaults,
    never from another folder (here the model folder holds a non-default file)."""
    model = with_llm2vec_config(
        base,
        tmp_path / "model",
        pooling_mode="weighted_mean",
        max_length=33,
        skip_instruction=False,
        doc_max_length=50,
    )
    with_file = Path(bare_adapter(base, tmp_path / "with", seed=1))
    (with_file / "llm2vec_config.json").write_text(json.dumps({"pooling_mode": "eos_token", "max_length": 21}))
    without = Path(bare_adapter(base, tmp_path / "without", seed=2))
    names = {"pooling_mode": "pooling", "max_length": "max_length", "doc_max_length": "doc_max_length"}
    ours = {"weighted_mean": "weightedmean", "eos_token": "eos_token", "mean": "mean"}
    for peft in (None, with_file, without):
        eng = Engine(str(model), adapters=[str(peft)] if peft else [])
        ref = ref_config(model, peft)
        got = {k: eng.resolved[v] for k, v in names.items()}
        assert got == {
            "pooling_mode": ours[ref["pooling_mode"]],
            "max_length": min(ref["max_length"], 256),
            "doc_max_length": ref["doc_max_length"],
        }, peft
        assert eng.resolved["include_instruction"] is (not ref["skip_instruction"])
        assert eng.resolved["causal"] is False  # enable_bidirectional=True by default


def test_a_layout_without_llm2vec_config_gets_llm2vecs_defaults(base, tmp_path):
    """A published -mntp folder (auto_map to llm2vec's encoder) with no llm2vec_config.json anywhere: mean pooling,
    512 tokens, documents cut at 400, instructions not pooled, bidirectional; the notice names what it brought."""
    _, mntp_dir, sup_dir = published_layout(
        tmp_path / "pub", base, base_ref="../../meta-llama/Meta-Llama-3-8B-Instruct"
    )
    with pytest.warns(
        Llm2VecNotice,
        match=r"an LLM2Vec layout .*names llm2vec's encoder model.*bidirectional=True.*"
        r"pooling='mean'.*doc_max_length=400.*the chat template of "
        r"meta-llama/Meta-Llama-3-8B-Instruct",
    ):
        eng = _Engine(str(mntp_dir), adapters=[str(sup_dir)], device="cpu")
    r = eng.resolved
    assert (r["pooling"], r["doc_max_length"], r["include_instruction"], r["causal"]) == ("mean", 400, False, False)
    assert r["max_length"] == 256  # llm2vec's 512, capped at the tiny model's positions
    assert all(r.sources[k] == "llm2vec default" for k in ("pooling", "max_length", "doc_max_length", "causal"))
    assert r["instruction_pooling"] == "llm2vec"


def test_explicit_knobs_win_and_say_so(base, tmp_path):
    folder = with_llm2vec_config(base, tmp_path / "cfg", pooling_mode="mean")
    eng = Engine(str(folder), bidirectional=False, pooling="lasttoken", doc_max_length=0)
    assert (eng.resolved["causal"], eng.resolved["pooling"], eng.resolved["doc_max_length"]) == (
        True,
        "lasttoken",
        None,
    )
    assert eng.resolved.sources["causal"] == eng.resolved.sources["pooling"] == "user"
    assert "(user)" in repr(eng.resolved) and "llm2vec" not in repr(Engine(str(base)).resolved)


# ------------------------------------------------------------------------------------------- the chat template
def _texts_tokenized(eng, texts):
    return [list(r.ids) for r in eng.tokenize(texts)]


def test_the_template_name_comes_from_the_loaded_config_not_the_adapter_config(base, tmp_path):
    """(a) an -mntp folder whose config.json names Llama-2-chat, its adapter's base re-pointed to a local folder:
    llm2vec wraps in [INST] ... [/INST]; (b) an adapter whose adapter_config.json names Llama-2-chat on an explicit
    local base whose config names nothing llm2vec knows: no wrapping."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    texts = ["A man is playing a guitar.", "Paris"]
    base_dir, mntp_dir, _ = published_layout(tmp_path / "a", base, base_ref="placeholder")
    cfg = json.loads((mntp_dir / "config.json").read_text())
    cfg["_name_or_path"] = LLAMA2
    (mntp_dir / "config.json").write_text(json.dumps(cfg))
    acfg = json.loads((mntp_dir / "adapter_config.json").read_text())
    acfg["base_model_name_or_path"] = str(base_dir)  # what the "base not found" error advises
    (mntp_dir / "adapter_config.json").write_text(json.dumps(acfg))
    eng = Engine(str(mntp_dir))
    assert _texts_tokenized(eng, texts) == [tok(ref_wrap(LLAMA2, t))["input_ids"] for t in texts]
    # (b): the adapter names Llama-2-chat as its base, the base folder's config does not
    adapter = Path(bare_adapter(base, tmp_path / "b", seed=5, base_name=LLAMA2))
    (adapter / "llm2vec_config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    eng = Engine(str(base_dir), adapters=[str(adapter)])
    name = json.loads((base_dir / "config.json").read_text()).get("_name_or_path") or str(base_dir)
    assert _texts_tokenized(eng, texts) == [tok(ref_wrap(name, t))["input_ids"] for t in texts]
    assert _texts_tokenized(eng, texts) == [tok(t)["input_ids"] for t in texts]


def test_the_published_mntp_id_brings_its_bases_template(base, tmp_path):
    """The -mntp folder's config names Meta-Llama-3-8B-Instruct (as the published one does): Llama-3's template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    _, mntp_dir, sup_dir = published_layout(tmp_path / "p", base, base_ref="../../meta-llama/Meta-Llama-3-8B-Instruct")
    eng = Engine(str(mntp_dir), adapters=[str(sup_dir)])
    name = "meta-llama/Meta-Llama-3-8B-Instruct"
    assert _texts_tokenized(eng, ["A cat."]) == [tok(ref_wrap(name, "A cat."))["input_ids"]]
    assert MNTP_ID.endswith("-mntp")


def test_by_hub_id_the_template_name_is_the_adapters_base(base, tmp_path, monkeypatch):
    """Named by hub id, a repository holding an adapter is loaded by transformers 4.44 under the adapter's
    ``base_model_name_or_path``, whatever its config.json's ``_name_or_path`` says (llm2vec 0.2.3, run in its own
    environment: evals/llm2vec_parity.py); by local path, the config.json's name counts."""
    from hub_cache import write_hub_cache
    from huggingface_hub import constants
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    base_dir, mntp_dir, _ = published_layout(tmp_path / "p", base, base_ref="tiny-org/base")
    cfg = json.loads((mntp_dir / "config.json").read_text())
    cfg["_name_or_path"] = LLAMA2  # the config names a templated model, the adapter a plain base
    (mntp_dir / "config.json").write_text(json.dumps(cfg))
    cache = tmp_path / "cache"
    write_hub_cache(cache, "tiny-org/base", base_dir, commit="a" * 40)
    write_hub_cache(cache, "tiny-org/x-mntp", mntp_dir, commit="b" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    by_id = Engine("tiny-org/x-mntp")
    assert by_id.llm2vec.name == "tiny-org/base"
    assert _texts_tokenized(by_id, ["A cat."]) == [tok(ref_wrap("tiny-org/base", "A cat."))["input_ids"]]
    by_path = Engine(str(mntp_dir))
    assert by_path.llm2vec.name == LLAMA2
    assert _texts_tokenized(by_path, ["A cat."]) == [tok(ref_wrap(LLAMA2, "A cat."))["input_ids"]]
