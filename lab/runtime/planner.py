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

import torch

from lab.models.base import PackedModel
from lab.ops.probes import Decision, decide


def plan_cpu_paths(model: PackedModel, dtype: torch.dtype, device: torch.device, workers: int,
                   forced: dict[str, str] | None = None) -> list[Decision]:
    """Decide ``model``'s CPU fast paths for ``dtype``, each timed with one worker's share of the intra-op threads,
    and install them as ``model.plan``; returns the decisions in order. Off the CPU (or for the padded fallback)
    there is nothing to decide and the plan is emptied (each family's defaults)."""
    if device.type != "cpu" or not model.packed:
        model.plan.replace({})
        return []
    threads = max(1, torch.get_num_threads() // max(1, workers))
    decisions = []
    with model.plan.trial() as trial:
        for probe in model.cpu_probes(dtype, threads):
            d = decide(probe, forced=forced, context=tuple(sorted(trial.items())))
            trial[d.name] = d.choice
            decisions.append(d)
        choices = dict(trial)
    model.plan.replace(choices)
    return decisions
