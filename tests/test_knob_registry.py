"""The knob registry (``lab.engine.knob_registry.KNOBS``) is the one list of knobs: ``Engine``'s keywords and
signature, ``configure``'s checks, the panel's widgets and the README's knob table all read it, so a knob registered
there (here a toy one, in a scratch copy of the registry) reaches each of them."""

from __future__ import annotations

import inspect

import pytest

from lab import Engine, _readme
from lab.engine import knob_registry
from lab.engine.knob_registry import KNOBS, Knob, Widget, positive_int, register
from lab.engine.knobs import Knobs

TOY = Knob(
    "toy_scale",
    1,
    positive_int("toy_scale"),
    type="int",
    calls="nothing (a test's knob)",
    widget=Widget("int", "toy scale", minimum=1, maximum=8),
    doc="a toy knob no code reads.",
)


@pytest.fixture
def scratch(monkeypatch):
    """A copy of the registry in place of the real one for one test."""
    monkeypatch.setattr(knob_registry, "KNOBS", dict(KNOBS))
    return knob_registry.KNOBS


def test_a_registered_knob_reaches_engine_configure_the_panel_and_the_docs(minilm_path, scratch):
    pytest.importorskip("ipywidgets")
    from lab.eval.panel import build_panel

    with pytest.raises(TypeError, match="unknown knob.*toy_scale"):
        Engine(minilm_path, toy_scale=2)
    assert "toy_scale" not in _readme.knob_table()
    register(TOY)
    assert "| `toy_scale` | `1` | nothing (a test's knob) | a toy knob no code reads. |" in _readme.knob_table()
    eng = Engine(minilm_path, toy_scale=2)
    assert eng.knobs["toy_scale"] == 2 and list(eng.knobs)[-1] == "toy_scale"
    before = eng.knobs
    with pytest.raises(ValueError, match="toy_scale must be a positive int, got 0"):
        eng.configure(toy_scale=0)
    assert eng.knobs == before  # a refused value changes nothing
    p = build_panel(eng)
    assert p.toy_scale.value == 2 and p.toy_scale.description == "toy scale"
    p.toy_scale.value = 5  # the widget configures the engine live
    assert eng.knobs["toy_scale"] == 5 and p.error.value == ""
    p.toy_scale.value = 9  # past the widget's maximum: the widget clamps it
    assert eng.knobs["toy_scale"] == 8
    assert Knobs().toy_scale == 1 and Knobs(toy_scale=3)["toy_scale"] == 3


def test_the_real_registry_is_untouched_by_a_scratch_copy(scratch):
    register(TOY)
    assert "toy_scale" in knob_registry.KNOBS and "toy_scale" not in KNOBS


def test_the_engine_signature_lists_the_registry():
    params = inspect.signature(Engine).parameters
    assert [p for p in params if p in KNOBS] == list(KNOBS)
    assert all(params[name].default == k.default and params[name].annotation == k.type for name, k in KNOBS.items())
    assert params["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_register_refuses_what_is_not_a_knob(scratch):
    with pytest.raises(TypeError, match="Knob"):
        register({"name": "x"})
    with pytest.raises(ValueError, match="public Python identifier"):
        register(Knob("not a name", 1, positive_int("x"), doc="."))
    with pytest.raises(ValueError, match="unknown widget kind 'slider'"):
        Widget("slider", "x")
    with pytest.raises(ValueError, match="needs options"):
        Widget("dropdown", "x")


def test_every_knob_has_a_doc_a_type_and_a_check_that_takes_its_default():
    for name, k in KNOBS.items():
        assert k.doc.strip() and k.type != "object" and k.calls, name
        assert k.check(k.default) == k.default, name
    assert {name for name, k in KNOBS.items() if not k.live} == {"device", "revision"}


def test_a_knob_fixed_at_load_is_refused_by_configure(minilm_path, scratch):
    register(Knob("toy_fixed", 1, positive_int("toy_fixed"), doc="a toy knob fixed at load.", live=False))
    eng = Engine(minilm_path, toy_fixed=2)
    eng.configure(toy_fixed=2)  # the value it has: nothing to change
    with pytest.raises(
        ValueError,
        match=r"toy_fixed cannot change live; create a new Engine instead: "
        r"Engine\('.*', toy_fixed=3\)",
    ):
        eng.configure(toy_fixed=3)
    assert eng.knobs["toy_fixed"] == 2
