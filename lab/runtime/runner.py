"""The prefill-only runner: one model on its device with its weights, its CPU plan, its worker pool, and the forward.

Each concern has its own object, and the runner ties them for the engine:

- ``weights`` (``lab.runtime.weights.Weights``): the master copy, dtype casts, adapter merges;
- ``plan`` (the model's ``lab.ops.plan.CpuPlan``): the CPU fast-path choices and the weight copies made for them,
  decided by ``plan_cpu_paths`` (``lab.runtime.planner``) with this engine's forced choices (``cpu_paths``);
- ``pool`` (``lab.runtime.pool.WorkerPool``): the CPU worker threads a packed step is shared among.

Which steps run, on which path, and how outputs are pooled is the executor's business (``lab.engine.executor``).

    >>> runner = Runner(model, device=torch.device("cpu"), dtype=torch.float32)
    >>> runner.plan_cpu_paths(workers=2)
    >>> hidden = runner.forward(batch)                                   # (T, hidden)
"""

from __future__ import annotations

import torch

from lab.models.base import PackedModel
from lab.ops.batch import OutputRows, PackedBatch
from lab.ops.probes import Decision, check_forced
from lab.runtime.planner import plan_cpu_paths
from lab.runtime.pool import WorkerPool, workers_for
from lab.runtime.weights import Weights


class Runner:
    def __init__(self, model: PackedModel, *, device: torch.device, dtype: torch.dtype,
                 cpu_paths: dict[str, str] | None = None):
        self.model = model.eval().to(device)
        self.device = device
        self.plan = self.model.plan
        self.forced = check_forced(cpu_paths)  # this engine's forced CPU choices
        self.weights = Weights(self.model, device=device, dtype=dtype)
        self.pool = WorkerPool()
        self.decisions: list[Decision] = []  # how the plan in force was decided (``plan_cpu_paths``)

    @property
    def dtype(self) -> torch.dtype | None:
        """The live weights' dtype (``None`` while a switch is half done)."""
        return self.weights.dtype

    def plan_cpu_paths(self, workers: int) -> list[Decision]:
        """Decide this model's CPU plan for the current dtype, timed with one worker's share of the intra-op threads
        (``lab.runtime.planner.plan_cpu_paths``)."""
        self.decisions = plan_cpu_paths(self.model, self.weights.dtype, self.device, workers, self.forced)
        return self.decisions

    def cpu_workers(self, knob: int | None, backend: str) -> int:
        """Workers a step may be split across under the ``cpu_workers`` knob (``lab.runtime.pool.workers_for``)."""
        return workers_for(knob, device=self.device, packed=self.model.packed, backend=backend)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, num_layers: int | None = None,
                output_rows: OutputRows | None = None) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` of one packed step after its first ``num_layers`` layers (``None`` = all;
        the Engine's ``layer`` knob, resolved), or with ``output_rows`` only those rows ``(B, hidden)``."""
        return self.model(batch.input_ids, batch.positions, batch.meta, batch.token_type_ids,
                          output_rows=output_rows, num_layers=num_layers)
