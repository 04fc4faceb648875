"""Every CPU fast path forced in turn and checked for parity, whatever this machine's probes would pick.

An engine's probes (``lab.ops.probes``) pick one candidate of each fast path on the running machine, so a test that
relies on the picks exercises only this CPU's. Here every candidate of every probe a model family asks is forced in
turn (``Engine(..., cpu_paths=...)``; the last candidate this machine offers through ``LAB_CPU_<NAME>`` instead),
the other probes left to pick (but for the earlier choices it needs), and the engine is run in float32 and bfloat16
with one and two CPU workers: on all-MiniLM-L6-v2 against sentence-transformers and on a tiny decoder of each family
``tests/tiny_models.py`` builds against transformers. Each run checks that the forced choice is the one in force
(``Engine.cpu_paths``, the decision's source, the model's plan or weight layout) and, for a candidate that runs
prefill-lab's C library, that the library's function ran, on this machine's build and on the portable and AVX2 builds
(``lab.kernels.cpu_attention.use_build``).

Which probes apply to which family and dtype, which candidates this machine offers, which earlier choices a probe
needs before it is asked (a weight layout only where that dtype's GEMMs run in oneDNN, the rotary kernel only in the
``pairs`` layout) and which candidates call the C library are read from the families' own probes at collection
(``_explore``): each family's probe generator is walked under its defaults and under other choices, timing
nothing. A candidate this machine does not offer skips with the reason. Nothing here assumes which candidate
a probe picks or how fast anything is.
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cosine_rows
from lab.kernels import cpu_attention
from tiny_models import KINDS, tiny_config, tiny_llama

from lab import Engine
from lab.models import model_class
from lab.ops.probes import CALL_PROBES, CANDIDATES, cpu_info, env_name

DTYPES = (torch.float32, torch.bfloat16)
WORKERS = (1, 2)
BUILDS = ("avx2", "portable")  # the C library's other builds (conftest.c_builds), for the candidates that call it

# parity: the tolerances of the engine's own parity tests (test_engine.py: MiniLM against sentence-transformers in
# float32, bfloat16 against float32; test_fused.py: decoders against transformers in float32;
# test_models_decoder.py: decoders in bfloat16 against float32)
MINILM_F32_COSINE, MINILM_F32_ATOL = 0.99999, 2e-5
MINILM_BF16_COSINE = 0.999
DECODER_F32_RTOL, DECODER_F32_ATOL = 1e-5, 2e-6
DECODER_BF16_COSINE = 0.99

# short texts, an odd count, in shuffled order; decoders: a one-token sequence and one longer than three causal query
# blocks (``lab.models.decoder.CAUSAL_BLOCK``), so the blocked causal path runs (the ``decoders`` fixture checks both)
MINILM_TEXTS = [
    "a",
    "",
    "The cat sits on the mat.",
    "?!",
    "Café crème, naïve façade — 東京タワー и Москва.",
    "Stocks fell sharply on Monday after the central bank raised interest rates by half a point.",
    "Two dogs run through a field of tall grass while the owner watches from a distance. " * 3,
]
DECODER_TEXTS = [
    "a",
    "What is the capital of France?",
    "x y z " * 36,
    "Rotary embeddings rotate queries and keys.",
    "Paris",
]
random.Random(0).shuffle(MINILM_TEXTS)
random.Random(1).shuffle(DECODER_TEXTS)


class CountingBuild:
    """A build of the C library whose ``lab_*`` functions count their calls (``calls``: function -> count)."""

    def __init__(self, lib):
        self.lib, self.calls = lib, collections.Counter()

    def __getattr__(self, name: str):
        fn = getattr(self.lib, name)
        if not name.startswith("lab_"):
            return fn

        def counted(*args):
            self.calls[name] += 1
            return fn(*args)

        return counted


# ------------------------------------------------------------------------------------ what the families ask
def _family_configs() -> dict[str, dict]:
    """config.json of every family under test: the bundled MiniLM's, and the tiny decoders' (``tiny_config``)."""
    from lab._extras import minilm_path

    configs = {"minilm": json.loads((Path(minilm_path()) / "config.json").read_text())}
    for kind in KINDS:
        config = tiny_config(kind, 320)
        configs[kind] = {**config.to_dict(), "architectures": [type(config).__name__.replace("Config", "ForCausalLM")]}
    return configs


def _walk(model, dtype: torch.dtype, assignment: dict[str, str]) -> list:
    """The probes ``model`` asks at ``dtype`` (its weight layouts, then its CPU probes, in order), each answered by
    ``assignment`` or else by its default (the first candidate): ``[(probe, choice), ...]``. Nothing is timed."""
    steps, layout = [], dict(model.layout)
    try:
        for probe in model.layout_probes(dtype):
            choice = assignment.get(probe.name, next(iter(probe.candidates)))
            model.layout[probe.name] = choice
            steps.append((probe, choice))
        with model.plan.trial() as trial:
            for probe in model.cpu_probes(dtype, 1):
                choice = assignment.get(probe.name)
                choice = choice if choice in probe.candidates else next(iter(probe.candidates))
                trial[probe.name] = choice
                steps.append((probe, choice))
    finally:
        model.layout.clear()
        model.layout.update(layout)
    return steps


def _c_functions(probe, choice: str) -> frozenset[str]:
    """The C library's functions ``probe``'s candidate ``choice`` calls (run once on its prepared inputs)."""
    if not cpu_attention.available():
        return frozenset()
    counting = CountingBuild(cpu_attention.library())
    with cpu_attention.use_build(counting), torch.inference_mode():
        probe.candidates[choice]()
    return frozenset(counting.calls)


def _explore(model, dtype: torch.dtype) -> dict[tuple[str, str], dict]:
    """Every ``(name, candidate)`` ``model``'s probes offer at ``dtype`` on this machine -> ``requires`` (the earlier
    choices every walk that offered it made: they are forced with it) and ``c_functions`` (the C library's functions
    it calls). The first walk takes every default; then one walk per other candidate offered in it, and from each
    walk that asked a probe the defaults do not (a weight layout behind oneDNN GEMMs, the rotary kernel behind the
    ``pairs`` layout), one walk per other candidate offered in that one too. So a probe asked under the defaults
    requires the earlier choices without which it is not asked (the bfloat16 weight layout: native bfloat16 GEMMs),
    and one asked only behind another choice requires that choice."""
    walks, queue, prefixes, c_functions, default_names = set(), [{}], collections.defaultdict(list), {}, None
    while queue:
        assignment = queue.pop(0)
        steps = _walk(model, dtype, assignment)
        names = {probe.name for probe, _ in steps}
        default_names = names if default_names is None else default_names
        # the defaults, or one other choice that made more probes ask
        branches = not assignment or (len(assignment) == 1 and not names <= default_names)
        made: dict[str, str] = {}
        for probe, choice in steps:
            for candidate in probe.candidates:
                key = (probe.name, candidate)
                prefixes[key].append(dict(made))
                if key not in c_functions:
                    with model.plan.trial() as trial:
                        trial.update(made)
                        c_functions[key] = _c_functions(probe, candidate)
                branch = frozenset({**assignment, probe.name: candidate}.items())
                if branches and candidate != choice and branch not in walks:
                    walks.add(branch)
                    queue.append(dict(branch))
            made[probe.name] = choice
    return {
        key: {
            "requires": {n: c for n, c in walks[0].items() if all(w.get(n) == c for w in walks)},
            "c_functions": c_functions[key],
        }
        for key, walks in prefixes.items()
    }


def _explore_families() -> dict[str, dict[torch.dtype, dict]]:
    """family -> dtype -> ``_explore`` of a model of that family with random weights (on one intra-op thread: the
    walks run small ops, which a thread pool only slows)."""
    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for family, config in _family_configs().items():
            out[family] = _explore_family(config)
    finally:
        torch.set_num_threads(threads)
    return out


def _explore_family(config: dict) -> dict[torch.dtype, dict]:
    model = model_class(config["architectures"][0]).from_hf_config(config).eval()
    if any(p.is_meta for p in model.parameters()):  # a family that makes its weights at load: random ones
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.05)
    return {dtype: _explore(model.to(dtype), dtype) for dtype in DTYPES}


EXPLORED = _explore_families()


def _cases() -> list:
    """(family, name, candidate, build) for every candidate of every probe a family asks here, in any dtype; the
    other builds of the C library for the candidates that call it."""
    cases = []
    for family, by_dtype in EXPLORED.items():
        asked = {name for offered in by_dtype.values() for name, _ in offered}
        for name in (n for n in CANDIDATES if n in asked):
            for candidate in CANDIDATES[name]:
                calls_c = any(by_dtype[d].get((name, candidate), {}).get("c_functions") for d in DTYPES)
                for build in ("native", *(BUILDS if calls_c else ())):
                    suffix = "" if build == "native" else f"-{build}"
                    cases.append(
                        pytest.param(family, name, candidate, build, id=f"{family}-{name}={candidate}{suffix}")
                    )
    return cases


# ------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", autouse=True)
def _quick_probes_and_weights():
    """The probes that pick time each candidate once, with no warm-up (``lab.ops.probes.REPEATS`` / ``WARMUP``), on
    64-token steps (the families' ``PROBE_ROWS``, ``ATTENTION_PROBE_LENGTHS``): their choice is not what is under
    test, only that the forced one is kept among them. The measurements made here are dropped afterwards, so no later
    test reuses them. Each checkpoint's weights are read from disk once (a copy for each engine)."""
    from lab.models import bert, decoder
    from lab.models import build as build_module
    from lab.models.folder import Checkpoint
    from lab.ops import probes

    read, cache, before = build_module.read_state_dict, {}, set(probes._MEASURED)

    def read_once(spec):
        if spec.path not in cache:
            cache[spec.path] = read(spec)
        copy = Checkpoint({k: v.clone() for k, v in cache[spec.path].items()})
        copy.files.update(cache[spec.path].files)
        return copy

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probes, "REPEATS", 1)
        mp.setattr(probes, "WARMUP", 0)
        mp.setattr(probes, "ATTENTION_PROBE_LENGTHS", (40, 16, 8))
        mp.setattr(bert, "PROBE_ROWS", 64)
        mp.setattr(decoder, "PROBE_ROWS", 64)
        mp.setattr(build_module, "read_state_dict", read_once)
        yield
    for key in set(probes._MEASURED) - before:
        probes._MEASURED.pop(key, None)


@pytest.fixture(autouse=True)
def _nothing_forced_by_the_environment(monkeypatch):
    """The other probes pick: no ``LAB_CPU_<NAME>`` from the caller's environment."""
    for name in CANDIDATES:
        monkeypatch.delenv(env_name(name), raising=False)


@pytest.fixture(scope="module")
def minilm_reference(minilm_st) -> np.ndarray:
    return minilm_st.encode(MINILM_TEXTS, convert_to_numpy=True)


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    """``decoders(kind)`` -> (a tiny checkpoint of that family, written on first use, and transformers' float32
    forward of ``DECODER_TEXTS`` on the engine's own tokens, one sequence at a time, mean-pooled)."""
    from transformers import AutoModel

    from lab.models.decoder import CAUSAL_BLOCK

    made = {}

    def get(kind: str) -> tuple[str, np.ndarray]:
        if kind not in made:
            folder = str(tiny_llama(tmp_path_factory.mktemp(kind), kind))
            requests = Engine(folder, pooling="mean", cpu_paths={"rope_layout": "halves"}).tokenize(DECODER_TEXTS)
            lengths = [r.length for r in requests]
            assert min(lengths) == 1 and 3 * CAUSAL_BLOCK < max(lengths), lengths  # one token; causal blocks run
            model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
            with torch.no_grad():
                made[kind] = (
                    folder,
                    np.stack(
                        [
                            model(input_ids=torch.tensor([list(r.ids)])).last_hidden_state[0].mean(0).numpy()
                            for r in requests
                        ]
                    ),
                )
        return made[kind]

    return get


def _check_parity(family: str, dtype: torch.dtype, got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape and np.isfinite(got).all(), what
    cos = cosine_rows(got, want)
    if family == "minilm" and dtype == torch.float32:
        assert cos.min() >= MINILM_F32_COSINE, (what, cos.min())
        np.testing.assert_allclose(got, want, atol=MINILM_F32_ATOL, err_msg=what)
    elif family == "minilm":
        assert cos.min() >= MINILM_BF16_COSINE, (what, cos.min())
    elif dtype == torch.float32:
        np.testing.assert_allclose(got, want, rtol=DECODER_F32_RTOL, atol=DECODER_F32_ATOL, err_msg=what)
    else:
        assert cos.min() >= DECODER_BF16_COSINE, (what, cos.min())


def _unoffered_reason(family: str, name: str, candidate: str) -> str:
    offered = sorted({c for by in EXPLORED[family].values() for n, c in by if n == name})
    reason = f"{family}: its {name} probe does not offer {candidate} on this machine (it offers {', '.join(offered)})"
    if not cpu_attention.available():
        reason += f" (prefill-lab's C library is not available: {cpu_attention.unavailable_reason()})"
    return reason


# ---------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("family,name,candidate,build", _cases())
def test_forced_candidate_matches_reference(family, name, candidate, build, request, monkeypatch):
    """``name`` forced to ``candidate`` (with the earlier choices it needs), the other probes picking: in every
    dtype where the probe offers it, with one and two CPU workers, the choice is the one in force and the outputs
    match the reference; a candidate that calls the C library calls it, in ``build``."""
    by_dtype = {d: EXPLORED[family][d][(name, candidate)] for d in DTYPES if (name, candidate) in EXPLORED[family][d]}
    if not by_dtype:
        pytest.skip(_unoffered_reason(family, name, candidate))
    c_builds = request.getfixturevalue("c_builds") if build != "native" else {}
    if build != "native" and build not in c_builds:
        pytest.skip(f"no {build} build of the C library on this CPU (its flags: {cpu_info()['cpu_flags']})")
    offered = [c for c in CANDIDATES[name] if any((name, c) in EXPLORED[family][d] for d in DTYPES)]
    if family == "minilm":
        path, want, knobs = request.getfixturevalue("minilm_path"), request.getfixturevalue("minilm_reference"), {}
    else:
        (path, want), knobs = request.getfixturevalue("decoders")(family), {"pooling": "mean"}
    via = "env" if build == "native" and candidate == offered[-1] else "engine"  # each probe's env form, once
    if via == "env":
        monkeypatch.setenv(env_name(name), candidate)
    texts = MINILM_TEXTS if family == "minilm" else DECODER_TEXTS
    lib = cpu_attention.library() if build == "native" and cpu_attention.available() else c_builds.get(build)
    counting = CountingBuild(lib) if lib is not None else None
    groups = collections.defaultdict(list)  # the forced choices -> the dtypes they serve (one engine each)
    for dtype, found in by_dtype.items():
        forced = {**found["requires"], **({name: candidate} if via == "engine" else {})}
        groups[tuple(sorted(forced.items()))].append(dtype)
    for forced, dtypes in groups.items():
        with cpu_attention.use_build(counting) if counting is not None else contextlib.nullcontext():
            eng = Engine(
                path, cpu_paths=dict(forced), dtype=str(dtypes[0]).removeprefix("torch."), cpu_workers=1, **knobs
            )
            for i, dtype in enumerate(dtypes):
                for workers in WORKERS[:: -1 if i % 2 else 1]:  # 1, 2, then 2, 1: one plan fewer
                    eng.configure(dtype=str(dtype).removeprefix("torch."), cpu_workers=workers)
                    what = f"{name}={candidate} ({via}, {build} build) {dtype} x{workers} workers"
                    _check_in_force(eng, name, candidate, via, what)
                    before = collections.Counter(counting.calls) if counting is not None else {}
                    _check_parity(family, dtype, eng.embed(texts), want, what)
                    for fn in by_dtype[dtype]["c_functions"]:
                        assert counting.calls[fn] > before[fn], f"{what}: {fn} did not run"


def _check_in_force(eng: Engine, name: str, candidate: str, via: str, what: str) -> None:
    """The forced choice is the engine's: reported by ``cpu_paths``, made by the force (not a probe), and in the
    model's plan (a CPU probe) or weight layout (a layout probe)."""
    assert eng.cpu_paths.get(name) == candidate, (what, eng.cpu_paths)
    decisions = {d.name: d for d in eng.runner.decisions}
    if name in decisions:
        assert decisions[name].source == via and eng.model.plan.get(name) == candidate, (what, decisions[name])
    else:
        assert eng.model.layout.get(name) == candidate, (what, eng.model.layout)


def test_every_fast_path_is_asked_by_a_family():
    """Every probe of ``CANDIDATES`` is asked by some family here, so every candidate above has a case; where this
    machine's probes never ask one (no C library, no oneDNN in this torch), the skip names them. Where the C library
    built, some candidates were seen calling it (so the cases on its other builds exist)."""
    found = [f for by_dtype in EXPLORED.values() for offered in by_dtype.values() for f in offered.items()]
    assert any(info["c_functions"] for _, info in found) == cpu_attention.available()
    asked = {name for (name, _), _ in found}
    missing = [name for name in CANDIDATES if name not in asked and name not in CALL_PROBES]  # forward: test_compiled
    if missing and not cpu_attention.available():
        pytest.skip(
            f"no family asks {', '.join(missing)} on this machine; prefill-lab's C library is not available: "
            f"{cpu_attention.unavailable_reason()}"
        )
    if missing:
        pytest.skip(f"no family asks {', '.join(missing)} on this machine (its probes do not offer them here)")


def test_use_build_swaps_the_library_for_the_block(c_builds):
    """``use_build`` hands every caller another build inside the block (the kernels run on it and give the same
    result) and puts the machine's own back after it, also when the block raises."""
    if not cpu_attention.available():
        pytest.skip(f"prefill-lab's C library is not available: {cpu_attention.unavailable_reason()}")
    from lab.kernels import cpu_norms

    own = cpu_attention.library()
    x, h, w, b = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32), torch.randn(32)
    want = cpu_norms.add_layer_norm(h.clone(), x, w, b, 1e-12)
    portable = CountingBuild(c_builds["portable"])
    with cpu_attention.use_build(portable):
        assert cpu_attention.library() is portable and cpu_attention.available()
        torch.testing.assert_close(cpu_norms.add_layer_norm(h.clone(), x, w, b, 1e-12), want)
    assert portable.calls["lab_add_layer_norm"] == 1 and cpu_attention.library() is own
    with pytest.raises(RuntimeError, match="inside"), cpu_attention.use_build(portable):
        raise RuntimeError("inside")
    assert cpu_attention.library() is own
