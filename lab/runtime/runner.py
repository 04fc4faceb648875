"""The prefill-only runner: one model on its device with its weights, its CPU plan, its worker pool, and the forward.

Each concern has its own object, and the runner ties them for the engine:

- ``weights`` (``lab.runtime.weights.Weights``): the master copy, dtype casts, adapter merges;
- ``plan`` (the model's ``lab.ops.plan.CpuPlan``): the CPU fast-path choices and the weight copies made for them,
  decided by ``plan_cpu_paths`` (``lab.runtime.planner``) with this engine's forced choices (``cpu_paths``);
- ``pool`` (``lab.runtime.pool.WorkerPool``): the CPU worker threads a packed step is shared among;
- ``compiled`` (``lab.runtime.compiled.CompiledForward``): the forward through ``torch.compile``, which a call runs
  where ``forward_path`` chooses it (``compile``: ``None`` measures, ``True`` / ``False`` force).

Which steps run, on which path, and how outputs are pooled is the executor's business (``lab.engine.executor``).

    >>> runner = Runner(model, device=torch.device("cpu"), dtype=torch.float32)
    >>> runner.plan_cpu_paths(workers=2)
    >>> hidden = runner.forward(batch)                                   # (T, hidden)
"""

from __future__ import annotations

import torch

from lab._warn import warn
from lab.models.base import PackedModel
from lab.ops.batch import OutputRows, PackedBatch
from lab.ops.probes import Decision, check_forced
from lab.runtime import compiled
from lab.runtime.planner import forward_choice, plan_cpu_paths
from lab.runtime.pool import WorkerPool, worker_threads, workers_for
from lab.runtime.weights import Weights


class Runner:
    def __init__(
        self,
        model: PackedModel,
        *,
        device: torch.device,
        dtype: torch.dtype,
        cpu_paths: dict[str, str] | None = None,
        compile: bool | None = None,
    ):
        self.model = model.eval().to(device)
        self.device = device
        self.plan = self.model.plan
        self.forced = check_forced(cpu_paths)  # this engine's forced CPU choices
        self.compile = compiled.check_compile(compile, self.forced)
        if self.compile and not (self.model.packed and self.model.staged):
            warn(
                f"compile=True: {type(self.model).__name__} runs transformers' padded forward, which the "
                "compiled forward does not take; it runs eagerly",
            )
        self.weights = Weights(self.model, device=device, dtype=dtype)
        self.pool = WorkerPool()
        self.compiled = compiled.CompiledForward(self.model, self.weights)
        self._plan_decisions: list[Decision] = []  # how the plan in force was decided (``plan_cpu_paths``)
        self._forward: Decision | None = None  # how the last call's forward path was decided (``forward_path``)

    @property
    def decisions(self) -> list[Decision]:
        """How the CPU plan in force was decided, then (once a call chose it) the forward path (``forward``)."""
        return self._plan_decisions + ([self._forward] if self._forward is not None else [])

    @property
    def dtype(self) -> torch.dtype | None:
        """The live weights' dtype (``None`` while a switch is half done)."""
        return self.weights.dtype

    def plan_cpu_paths(self, workers: int) -> list[Decision]:
        """Decide this model's CPU plan for the current dtype, timed with one worker's share of the intra-op threads
        (``lab.runtime.planner.plan_cpu_paths``)."""
        self._plan_decisions = plan_cpu_paths(self.model, self.weights.dtype, self.device, workers, self.forced)
        return self.decisions

    def forward_path(self, tokens: int, *, causal: bool, num_layers: int | None, workers: int) -> str:
        """``"compiled"`` or ``"eager"``: how a call of about ``tokens`` tokens runs its packed steps
        (``lab.runtime.planner.forward_choice``: forced by ``compile`` / ``cpu_paths`` / ``LAB_CPU_FORWARD``, else
        measured once the call's eager time pays the compile back)."""
        depth = self.model.layers_to_run(num_layers)
        d = forward_choice(self, tokens, causal=causal, depth=depth, threads=worker_threads(workers))
        if d is not None:
            self._forward = d
        return "eager" if d is None else d.choice

    def cpu_workers(self, knob: int | None, backend: str) -> int:
        """Workers a step may be split across under the ``cpu_workers`` knob (``lab.runtime.pool.workers_for``)."""
        return workers_for(knob, device=self.device, packed=self.model.packed, backend=backend)

    @torch.inference_mode()
    def forward(
        self,
        batch: PackedBatch,
        num_layers: int | None = None,
        output_rows: OutputRows | None = None,
        *,
        path: str = "eager",
    ) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` of one packed step after its first ``num_layers`` layers (``None`` = all;
        the Engine's ``layer`` knob, resolved), or with ``output_rows`` only those rows ``(B, hidden)``. ``path``
        ``"compiled"`` (``forward_path``) runs the compiled graph where it takes the step
        (``lab.runtime.compiled.supports``: every row computed, then the kept ones taken), else the eager forward."""
        if path == "compiled":
            depth = self.model.layers_to_run(num_layers)
            if compiled.supports(self.model, batch, depth):
                hidden = self.compiled(batch, depth)
                return hidden if output_rows is None else hidden[output_rows.rows]
        return self.model(
            batch.input_ids,
            batch.positions,
            batch.meta,
            batch.token_type_ids,
            output_rows=output_rows,
            num_layers=num_layers,
        )
