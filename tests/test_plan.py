"""One CPU plan per engine (``lab.ops.plan``, ``lab.ops.probes``, ``lab.runtime.planner``): the decision rule on
injected timings, what forces a choice and in which order, trials that other threads never see, derived weights kept
per plan, and two engines with different plans in one process, interleaved and in two threads, each equal to its
reference. Nothing here depends on which candidate this CPU prefers: the engines' plans are forced."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import cosine_rows

from lab import Engine
from lab.ops import gemm, probes
from lab.ops.plan import CpuPlan
from lab.ops.probes import CANDIDATES, MARGIN, Probe, check_forced, choose, decide


class FakeClock:
    """``time.perf_counter`` for ``probes._measure``: each candidate advances it by its own cost when it runs."""

    def __init__(self):
        self.now, self.calls = 0.0, {}

    def __call__(self) -> float:
        return self.now

    def candidate(self, name: str, seconds: float):
        def run():
            self.calls[name] = self.calls.get(name, 0) + 1
            self.now += seconds

        return run


def fake_probe(clock: FakeClock, costs: dict[str, float], key=("fake",), name="bert_qkv") -> Probe:
    return Probe(name, key, {c: clock.candidate(c, s) for c, s in costs.items()})


@pytest.mark.parametrize(
    "costs,want",
    [
        ({"split": 1.0, "stacked": 1.0}, "split"),  # a tie: the default (first) stays
        ({"split": 1.0, "stacked": 1.0 / (MARGIN * 0.999)}, "split"),  # slower: the default stays
        ({"split": 1.0, "stacked": 0.99}, "split"),  # faster, but within the margin: the default stays
        ({"split": 1.0, "stacked": 0.9}, "stacked"),  # faster by more than the margin
        ({"stacked": 0.9, "split": 1.0}, "stacked"),  # the default is the fastest
    ],
)
def test_the_margin_rule_on_injected_timings(costs, want, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(probes.time, "perf_counter", clock)
    probe = fake_probe(clock, costs, key=(str(costs),))
    assert choose(probe, costs) == want
    d = decide(probe)  # measured through the fake clock: the best of the timed calls per candidate
    assert d.choice == want and d.source == "probe" and d.seconds == pytest.approx(costs)
    assert all(n == probes.WARMUP + probes.REPEATS for n in clock.calls.values())


def test_three_candidates_and_the_cache(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(probes.time, "perf_counter", clock)
    costs = {"sdpa": 1.0, "matmul": 0.5, "lab": 0.7}
    probe = fake_probe(clock, costs, key=("three",), name="attention_kernel")
    assert decide(probe).choice == "matmul"
    runs = dict(clock.calls)
    assert decide(probe).choice == "matmul" and clock.calls == runs  # measured once per process and shape class
    decide(probe, context=(("f32_gemm", "onednn"),))  # other choices made before it: measured again
    assert all(clock.calls[c] == 2 * runs[c] for c in costs)


def test_forcing_order_engine_then_environment_then_probe(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(probes.time, "perf_counter", clock)
    probe = fake_probe(clock, {"split": 1.0, "stacked": 0.5}, key=("order",))
    monkeypatch.setenv("LAB_CPU_BERT_QKV", "split")
    assert decide(probe).source == "env" and decide(probe).choice == "split" and clock.calls == {}
    d = decide(probe, forced={"bert_qkv": "stacked"})
    assert (d.choice, d.source) == ("stacked", "engine")
    monkeypatch.setenv("LAB_CPU_BERT_QKV", "auto")  # read each time: no decision outlives the variable
    assert decide(probe).choice == "stacked" and decide(probe).source == "probe"
    monkeypatch.setenv("LAB_CPU_BERT_QKV", "sideways")
    with pytest.raises(ValueError, match="LAB_CPU_BERT_QKV='sideways' is not a bert_qkv choice.*split, stacked"):
        decide(probe)


def test_forced_choices_are_checked_by_name_and_choice():
    assert check_forced(None) == {} and check_forced({"f32_gemm": "blas"}) == {"f32_gemm": "blas"}
    with pytest.raises(ValueError, match="unknown fast path 'f32'; valid: bf16_gemm, f32_gemm"):
        check_forced({"f32": "blas"})
    with pytest.raises(ValueError, match=r"cpu_paths\['f32_gemm'\]='tf32' is not a choice; valid: blas, onednn"):
        check_forced({"f32_gemm": "tf32"})
    with pytest.raises(TypeError, match="cpu_paths must be a dict"):
        check_forced(["f32_gemm"])
    with pytest.raises(ValueError, match="not registered"):
        Probe("f32_gemm", (), {"tf32": lambda: None})
    # a forced choice the machine does not offer at this shape is refused with what it offers
    with pytest.raises(ValueError, match="not a f32_gemm choice on this machine.*valid: blas"):
        decide(Probe("f32_gemm", ("one",), {"blas": lambda: None}), forced={"f32_gemm": "onednn"})


def test_a_trial_is_invisible_to_other_threads():
    plan = CpuPlan({"attention_kernel": "sdpa"})
    seen = []
    with plan.trial() as trial:
        plan["attention_kernel"] = "lab"
        assert trial == {"attention_kernel": "lab"} and plan.get("attention_kernel") == "lab"
        other = threading.Thread(target=lambda: seen.append(plan.get("attention_kernel")))
        other.start()
        other.join()
        assert "bert_qkv" not in plan  # a trial starts empty: the planner decides from the defaults
    assert seen == ["sdpa"] and plan.as_dict() == {"attention_kernel": "sdpa"}
    plan.replace({"attention_kernel": "lab"})
    assert plan["attention_kernel"] == "lab" and plan.bf16_gemm == "native" and plan.f32_gemm == "blas"
    assert (
        plan.weights(torch.float32) == "plain"
        and CpuPlan({"bf16_weights": "packed"}).weights(torch.bfloat16) == "packed"
    )


def test_derived_copies_belong_to_their_plan():
    """Two plans over one weight keep their own widened copies; ``drop`` frees one plan's copies only, and a copy
    is remade when its weight's data changes."""
    w = torch.nn.Parameter(torch.randn(12, 8).bfloat16(), requires_grad=False)
    a, b = CpuPlan({"bf16_gemm": "widened"}), CpuPlan({"bf16_gemm": "widened"})
    wa, wb = gemm.wide_weight(w, a), gemm.wide_weight(w, b)
    assert wa is not wb and torch.equal(wa, wb) and gemm.wide_weight(w, a) is wa
    assert [(k, cur) for k, _, cur in a.copies()] == [("wide", True)] and a.derived_bytes() == 12 * 8 * 4
    a.drop(w)
    assert a.copies() == [] and gemm.wide_weight(w, b) is wb
    w.data = (w.float() * 3).bfloat16()
    assert [cur for _, _, cur in b.copies()] == [False]
    assert torch.equal(gemm.wide_weight(w, b), w.float())


FORCED = {
    "a": {"bert_qkv": "split", "bert_ffn": "blocks", "attention_kernel": "sdpa", "f32_gemm": "blas"},
    "b": {
        "bert_qkv": "stacked",
        "bert_ffn": "fused",
        "attention_kernel": "matmul",
        **({"f32_gemm": "onednn", "f32_weights": "packed"} if gemm.onednn_cpu() else {}),
    },
}


@pytest.fixture(scope="module")
def two_engines(minilm_path):
    return {name: Engine(minilm_path, cpu_paths=forced) for name, forced in FORCED.items()}


def test_two_engines_with_different_plans_interleaved(two_engines, minilm_st, sentences, monkeypatch):
    """Each engine reports and runs its own plan, whatever the other decided or ran between its calls, and each
    equals sentence-transformers; the oneDNN GEMMs run in engine ``b``'s calls only (where this torch has them)."""
    texts = sentences[:40]
    want = minilm_st.encode(texts, convert_to_numpy=True)
    calls, real = [], gemm.onednn_linear
    monkeypatch.setattr(gemm, "onednn_linear", lambda *a: calls.append(1) or real(*a))
    first = {}
    for rnd in range(2):
        for name in ("a", "b"):
            eng = two_engines[name]
            assert {k: eng.cpu_paths[k] for k in FORCED[name]} == FORCED[name]
            assert all(eng.runner.plan.get(k) == v for k, v in FORCED[name].items())
            before = len(calls)
            got = eng.embed(texts)
            assert cosine_rows(got, want).min() > 0.99999
            if rnd:
                np.testing.assert_array_equal(got, first[name])  # the other engine's calls changed nothing
            first[name] = got
            if name == "a":
                assert len(calls) == before  # float32 through BLAS: never oneDNN
            elif gemm.onednn_cpu():
                assert len(calls) > before
    assert not np.array_equal(first["a"], first["b"])  # two ways of computing, not one


def test_two_engines_with_different_plans_in_two_threads(two_engines, sentences):
    """Both engines embed at once, each in its own thread, several rounds: every result equals that engine's own
    result computed alone, bit for bit."""
    texts = {"a": sentences[:30], "b": sentences[30:64]}
    alone = {name: two_engines[name].embed(texts[name]) for name in texts}
    results, errors = {name: [] for name in texts}, []

    def work(name):
        try:
            for _ in range(4):
                results[name].append(two_engines[name].embed(texts[name]))
        except Exception as e:  # noqa: BLE001 (surfaced below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(name,)) for name in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for name in texts:
        assert len(results[name]) == 4
        for got in results[name]:
            np.testing.assert_array_equal(got, alone[name])


def test_the_process_default_is_read_when_each_engine_decides(minilm_path, monkeypatch):
    monkeypatch.setenv("LAB_CPU_BERT_QKV", "split")
    split = Engine(minilm_path)
    monkeypatch.setenv("LAB_CPU_BERT_QKV", "stacked")
    stacked = Engine(minilm_path)
    assert (split.cpu_paths["bert_qkv"], stacked.cpu_paths["bert_qkv"]) == ("split", "stacked")
    assert split.runner.plan["bert_qkv"] == "split"  # the second engine left the first one's plan alone


def test_every_registered_name_is_a_probe_of_some_family():
    """``CANDIDATES`` lists only names the code probes (a stale entry would accept a ``cpu_paths`` that nothing
    reads)."""
    import inspect

    from lab.models import bert, decoder

    source = inspect.getsource(probes) + inspect.getsource(bert) + inspect.getsource(decoder)
    assert all(f'"{name}"' in source.replace(f'"{name}": (', "") for name in CANDIDATES)
