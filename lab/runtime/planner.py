"""Deciding one engine's CPU plan: its model's probes run on this machine, each choice into the model's plan.

A model family lists its fast-path choices as probes (``PackedModel.cpu_probes``: candidates timed on its own shapes
and weights, ``lab.ops.probes``). ``plan_cpu_paths`` runs them in order inside a trial of the model's plan
(``CpuPlan.trial``), so each probe runs with the choices made before it while calls on other threads keep the plan
in force, then installs the decided choices in one step. An engine's ``cpu_paths`` (``forced``) and the process's
``LAB_CPU_<NAME>`` variables force choices (``lab.ops.probes.decide``); nothing here is shared between engines but
the process's cache of measurements.

    >>> decisions = plan_cpu_paths(model, torch.float32, torch.device("cpu"), workers=2, forced={"f32_gemm": "blas"})
"""

from __future__ import annotations

import functools
import time

import torch

from lab._warn import warn
from lab.models.base import PackedModel
from lab.ops.batch import PackedBatch
from lab.ops.probes import Decision, Probe, decide, forced_choice
from lab.runtime.pool import worker_threads


def plan_cpu_paths(
    model: PackedModel, dtype: torch.dtype, device: torch.device, workers: int, forced: dict[str, str] | None = None
) -> list[Decision]:
    """Decide ``model``'s CPU fast paths for ``dtype``, each timed with one worker's share of the intra-op threads,
    and install them as ``model.plan``; returns the decisions in order. Off the CPU (or for the padded fallback)
    there is nothing to decide and the plan is emptied (each family's defaults)."""
    if device.type != "cpu" or not model.packed:
        model.plan.replace({})
        return []
    threads = worker_threads(workers)
    decisions = []
    with model.plan.trial() as trial:
        for probe in model.cpu_probes(dtype, threads):
            d = decide(probe, forced=forced, context=tuple(sorted(trial.items())))
            trial[d.name] = d.choice
            decisions.append(d)
        choices = dict(trial)
    model.plan.replace(choices)
    return decisions


# The forward path (``forward``: ``eager`` | ``compiled``) under ``compile=None``: measured only for a call whose eager
# time would pay the compile back PAYBACK times over, so a notebook's first small call never waits for a compile.
COMPILE_MIN_TOKENS = 50_000  # below this a call never considers compiling (nor times anything for it)
PAYBACK = 10  # the call's estimated eager seconds must reach this many times the expected compile time
# expected seconds of a first compile with a cold on-disk cache: a base plus each layer (the graph unrolls them), set
# from first compiles of a 6- and a 30-layer model (measured: evals/README.md, "Measurements behind the code's
# choices")
COMPILE_SECONDS = (10.0, 3.5)
PROBE_LENGTHS = (16, 32, 48, 64, 80, 96, 112, 128)  # the forward probe's packed step (576 tokens)


def forward_choice(runner, tokens: int, *, causal: bool, depth: int, threads: int) -> Decision | None:
    """How a call of about ``tokens`` tokens runs its packed steps on ``runner`` (a ``lab.runtime.runner.Runner``),
    as a ``forward`` decision, or ``None`` for eager without a decision: the engine's ``compile`` (``True`` /
    ``False``) or ``cpu_paths["forward"]`` or ``LAB_CPU_FORWARD`` forces it; otherwise, on CPU, eager unless the
    call's eager time (one eager step timed) reaches ``PAYBACK`` times the expected compile time or this engine has
    the graph already, and then a probe: the eager and the compiled forward timed on the same step
    (``lab.ops.probes.decide``, once per process and shape class), the compiled one kept only where it is faster."""
    model, dtype = runner.model, runner.weights.dtype
    key = (type(model).__name__, model.hidden_size, depth, str(dtype), causal)
    if runner.compile is not None:
        return Decision("forward", key, "compiled" if runner.compile else "eager", "engine", threads=threads)
    if runner.device.type != "cpu" or not (model.packed and model.staged) or depth == 0 or runner.compiled.failed:
        return None
    batch = functools.cache(lambda: _probe_batch(model, causal, runner.device))  # made only if a candidate runs
    probe = Probe(
        "forward",
        key,
        {
            "eager": lambda: runner.model(batch().input_ids, batch().positions, batch().meta, num_layers=depth),
            "compiled": lambda: runner.compiled(batch(), depth),
        },
        threads,
    )
    if not forced_choice(probe, runner.forced) and not runner.compiled.built(causal, depth):
        if tokens < COMPILE_MIN_TOKENS:
            return None
        expected = runner.compiled.expected_seconds(depth, COMPILE_SECONDS)
        if tokens * _eager_seconds_per_token(probe, threads) * threads / torch.get_num_threads() < PAYBACK * expected:
            return None
    try:
        return decide(probe, forced=runner.forced)
    except RuntimeError as e:
        if runner.compiled.failed is None:
            raise
        warn(f"{e}; this engine runs eagerly")
        return None


def _probe_batch(model: PackedModel, causal: bool, device: torch.device) -> PackedBatch:
    vocab = model.config.get("vocab_size", 1000)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (n,), generator=gen).numpy() for n in PROBE_LENGTHS]
    return PackedBatch.build(ids, causal=causal, device=device)


def _eager_seconds_per_token(probe: Probe, threads: int) -> float:
    """One timed eager run of the probe's step (after one untimed), with ``threads`` intra-op threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            probe.candidates["eager"]()
            start = time.perf_counter()
            probe.candidates["eager"]()
            return (time.perf_counter() - start) / sum(PROBE_LENGTHS)
    finally:
        torch.set_num_threads(saved)
