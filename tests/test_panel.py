"""The knob panel, headless: widget values go through Engine.configure, Run embeds and shows stats, errors are text."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
from matplotlib.figure import Figure

ipywidgets = pytest.importorskip("ipywidgets")

from tiny_models import tiny_llama

from lab import Engine
from lab.eval.panel import build_panel

SENTENCES = "A man is playing a guitar.\nSomeone plays guitar.\n\nThe cat sits on the mat.\n"


@pytest.fixture()
def minilm(minilm_path):
    return Engine(minilm_path)  # its own engine: the panel changes knobs


@pytest.fixture()
def tiny_decoder(tmp_path):
    return Engine(str(tiny_llama(tmp_path, "llama")))


def test_panel_is_a_widget_with_named_children(minilm):
    p = build_panel(minilm)
    assert isinstance(p, ipywidgets.Widget)
    for name in (
        "pooling",
        "bidirectional",
        "chunked_prefill",
        "max_batch_tokens",
        "dtype",
        "instruction",
        "sentences",
        "run_button",
        "error",
        "stats_view",
        "plot",
    ):
        assert isinstance(getattr(p, name), ipywidgets.Widget), name
    assert p.bidirectional.value is True  # an encoder starts bidirectional
    assert p.pooling.value is None and p.error.value == ""
    title = p.children[0].value  # what loaded: the name and the revision
    assert minilm.model_name in title and minilm.revision[:12] in title


def test_run_embeds_and_shows_stats(minilm):
    p = build_panel(minilm)
    p.sentences.value = SENTENCES
    p.run_button.click()
    assert p.error.value == ""
    assert p.embeddings.shape == (3, 384)  # blank lines skipped
    np.testing.assert_allclose(np.diag(p.similarity), 1.0, atol=1e-5)
    assert p.similarity[0, 1] > p.similarity[0, 2]  # the two guitar sentences are closest
    assert isinstance(p.figure, Figure)
    assert "stats" in p.stats_view.value and f"<code>{minilm.stats.tokens}</code>" in p.stats_view.value
    assert minilm.stats.sequences == 3


def test_knob_widgets_configure_the_engine_live(minilm):
    p = build_panel(minilm)
    model = minilm.model
    p.pooling.value = "cls"
    assert minilm.knobs["pooling"] == "cls" and minilm.resolved.pooling == "cls"
    p.bidirectional.value = False  # make the encoder causal
    assert minilm.knobs["bidirectional"] is False and minilm.resolved.causal
    p.max_batch_tokens.value = 16
    p.instruction.value = "query: "
    assert minilm.knobs["max_batch_tokens"] == 16 and minilm.knobs["instruction"] == "query:"
    p.bidirectional.value = True  # back to the model's own attention: the knob says "model default" again
    assert minilm.knobs["bidirectional"] is None and not minilm.resolved.causal
    assert minilm.model is model  # no reload
    p.instruction.value = ""
    p.sentences.value = SENTENCES
    p.run_button.click()
    assert p.error.value == "" and minilm.stats.batches >= 2  # a 16-token budget splits the 24 tokens
    assert "cls" in p.resolved_view.value


def test_invalid_combination_shows_the_error_text(minilm):
    p = build_panel(minilm)
    p.chunked_prefill.value = 16  # an encoder is bidirectional: chunked prefill needs causal attention
    assert "chunked_prefill" in p.error.value and "ValueError" in p.error.value
    assert minilm.knobs["chunked_prefill"] is None  # nothing changed
    p.sentences.value = SENTENCES
    p.run_button.click()  # Run applies the knobs first and stops with the message
    assert p.embeddings is None and "chunked_prefill" in p.error.value
    p.bidirectional.value = False  # causal now: the same chunk size is valid and the error clears
    assert p.error.value == "" and minilm.knobs["chunked_prefill"] == 16 and minilm.resolved.causal
    p.run_button.click()
    assert p.error.value == "" and p.embeddings.shape == (3, 384)


def test_empty_sentences_is_an_error_not_a_traceback(minilm):
    p = build_panel(minilm)
    p.sentences.value = " \n \n"
    p.run_button.click()
    assert "at least one sentence" in p.error.value


def test_decoder_panel_pooling_bidirectional_chunked(tiny_decoder):
    eng = tiny_decoder
    p = build_panel(eng)
    assert p.bidirectional.value is False  # a decoder starts causal
    p.sentences.value = "The quick brown fox.\nA packed batch holds many sequences.\nRotary embeddings rotate."
    p.chunked_prefill.value = 4
    p.run_button.click()
    assert p.error.value == "" and eng.stats.chunks > 0
    chunked = p.embeddings.copy()
    p.chunked_prefill.value = 0
    p.run_button.click()
    np.testing.assert_allclose(chunked, p.embeddings, rtol=1e-4, atol=1e-5)  # chunking changes no number

    p.chunked_prefill.value = 4
    p.bidirectional.value = True  # with chunked prefill: the invalid combination
    assert "bidirectional" in p.error.value and eng.resolved.causal and eng.knobs["chunked_prefill"] == 4
    p.chunked_prefill.value = 0  # fixing it applies the pending bidirectional switch
    assert p.error.value == "" and eng.knobs["bidirectional"] is True and not eng.resolved.causal
    p.pooling.value = "mean"
    p.dtype.value = "bfloat16"
    assert eng.resolved.pooling == "mean" and eng.resolved["dtype"] == "bfloat16"
    p.run_button.click()
    assert p.error.value == "" and p.embeddings.shape == (3, eng.embedding_dim)
    assert "<code>3</code>" in p.stats_view.value
