"""Property tests (hypothesis) for ``embed`` on all-MiniLM-L6-v2: any unicode text gives finite rows, in input
order under any permutation, identical under any token budget and CPU worker count, duplicates equal. A fixed
example budget (derandomized, no deadline) keeps this under a minute on 2 cores."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab import Engine

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
TEXT = st.text(max_size=60)  # any unicode (no lone surrogates: those are refused, tests/test_reliability.py)
TEXTS = st.lists(TEXT, min_size=1, max_size=12)


@pytest.fixture(scope="module")
def eng(minilm_path):
    return Engine(minilm_path, max_length=48)


@SETTINGS
@given(texts=TEXTS, seed=st.integers(0, 2**16))
def test_rows_follow_the_input_order_and_are_finite(eng, texts, seed):
    out = eng.embed(texts)
    assert out.shape == (len(texts), 384) and out.dtype == np.float32 and np.isfinite(out).all()
    perm = np.random.default_rng(seed).permutation(len(texts))
    np.testing.assert_allclose(eng.embed([texts[i] for i in perm]), out[perm], atol=2e-5, rtol=1e-4)


@SETTINGS
@given(texts=TEXTS, budget=st.sampled_from([1, 7, 64, 16384]), workers=st.sampled_from([1, 2]))
def test_budget_and_workers_change_no_row(eng, texts, budget, workers):
    want = eng.embed(texts)
    eng.configure(max_batch_tokens=budget, cpu_workers=workers)
    try:
        np.testing.assert_allclose(eng.embed(texts), want, atol=2e-5, rtol=1e-4)
    finally:
        eng.configure(max_batch_tokens=16384, cpu_workers=None)


@SETTINGS
@given(text=TEXT, others=TEXTS)
def test_duplicates_get_equal_rows(eng, text, others):
    out = eng.embed([text, *others, text])
    np.testing.assert_allclose(out[0], out[-1], atol=2e-5, rtol=1e-4)


def test_empty_list(eng):
    assert eng.embed([]).shape == (0, 384) and eng.stats.sequences == 0
