"""InputProcessor: over-long inputs are cut from one encoding exactly as the tokenizer cuts them at max_length."""

from __future__ import annotations

import random

import pytest
from tiny_models import tiny_tokenizer
from transformers import AutoTokenizer

from lab.engine.inputs import InputProcessor


def _texts(tok) -> list[str]:
    words = ["protein", "cells", "the", "ä", "über", "naïve", "テスト", "x", ",", "1998", "(p<0.05)", "mitochondria"]
    sep = tok.sep_token or tok.eos_token  # a literal special token inside the text, next to the cut
    out = [" ".join(random.choice(words) for _ in range(n)) for n in (0, 1, 3, 9, 15, 16, 17, 40, 200)]
    out += [f"{' '.join(['cells'] * 12)} {sep} {' '.join(['the'] * 5)}", f"{sep} {sep} {sep} {sep} {sep} cells " * 4]
    random.shuffle(out)
    return out


@pytest.mark.parametrize("which", ["minilm", "bytelevel-bpe"])
@pytest.mark.parametrize("max_length", [3, 5, 16, 64])
@pytest.mark.parametrize("append_eos", [False, True])
def test_cut_inputs_equal_the_tokenizers_own_truncation(which, max_length, append_eos, minilm_path):
    tok = AutoTokenizer.from_pretrained(minilm_path) if which == "minilm" else tiny_tokenizer()
    proc = InputProcessor(tok, max_length, append_eos=append_eos)
    texts = _texts(tok)
    ids, _, truncated = proc.tokenize(texts)
    limit = max_length - 1 if proc.append_eos else max_length
    want = tok(texts, truncation=True, max_length=limit)["input_ids"]
    full = tok(texts)["input_ids"]
    for i, (got, w) in enumerate(zip(ids, want)):
        if proc.append_eos and (not w or w[-1] != tok.eos_token_id):
            w = w + [tok.eos_token_id]
        assert got == (w or got), (texts[i], got, w)  # "" with no specials: a stand-in token (tested elsewhere)
        assert truncated[i] == (len(full[i]) > limit)
    assert any(truncated) and not all(truncated)


def test_pairs_keep_the_tokenizers_longest_first_truncation(minilm_path):
    tok = AutoTokenizer.from_pretrained(minilm_path)
    proc = InputProcessor(tok, 12)
    queries = ["a short query", "a much longer query about cells, proteins and their many interactions", "q"]
    docs = ["doc " * 30, "tiny", "fits"]
    ids, types, truncated = proc.tokenize(queries, docs)
    want = tok(queries, docs, truncation=True, max_length=12)
    assert ids == want["input_ids"] and types == want["token_type_ids"] and truncated == [True, True, False]
