"""An engine's live settings, changed as one between calls: the knobs in force, the LoRA adapters merged into the
weights, the weights' dtype, the attention backend and the CPU plan (``Engine.configure`` runs ``change`` inside its
gate; ``lab.engine.gate``).

``change`` works out everything a new setting needs first (the knobs checked on this model, adapters read and
merged, backend and dtype resolved), so an error changes nothing; only then does it swap weights, marking the state
``dirty`` until done. A ``change`` interrupted while swapping leaves ``dirty`` set, and the engine's next call runs
``repair``, which makes the weights and the plan agree with the knobs in force.

``gated_call`` and ``gated_change`` decorate the engine's public calls and its ``configure``.

    >>> live = LiveState(knobs, runner, adapters, facts, device)
    >>> live.change(live.validate({"dtype": "bfloat16"}, "org/name"))
"""

from __future__ import annotations

import functools

import torch

from lab.engine import knob_registry
from lab.engine.adapter_state import AdapterState
from lab.engine.knobs import Knobs, ModelFacts, check_for_model, resolve, resolve_dtype
from lab.ops.attention import resolve_backend
from lab.runtime import allocator

_FIXED_WHY = {"device": " (it moves every weight)", "revision": " (it is another snapshot of the weights)"}


class LiveState:
    def __init__(self, knobs: Knobs, runner, adapters: AdapterState, facts: ModelFacts, device: torch.device):
        self.knobs, self.runner, self.adapters, self.facts, self.device = knobs, runner, adapters, facts, device
        self.dirty = False  # a change was interrupted while swapping weights (``repair``)
        if knobs.adapters:
            merging, merged = self.merge(knobs.adapters)
            runner.weights.set_merged(merged)
            adapters.use(merging)
        self.check(knobs)
        self.backend = resolve_backend(knobs.attention_backend, device)
        runner.plan_cpu_paths(self.workers)

    @property
    def workers(self) -> int:
        """The CPU workers a packed step is shared among under the knobs in force (``Runner.cpu_workers``)."""
        return self.runner.cpu_workers(self.knobs.cpu_workers, self.backend)

    @property
    def cpu_paths(self) -> dict[str, str]:
        """The CPU fast paths in force, name -> choice (``Engine.cpu_paths``)."""
        return {**self.runner.model.layout, **{d.name: d.choice for d in self.runner.decisions}}

    def runtime(self, instruction: str | None) -> dict:
        """What ``lab.engine.knobs.resolve`` reads of the runtime besides the knobs (``Engine.resolved``)."""
        return {
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "device": str(self.device),
            "attention_backend": self.backend,
            "cpu_workers": self.workers,
            "adapters": self.adapters.names,
            "cpu_paths": self.cpu_paths,
            "malloc_tuning": allocator.in_effect(),
            "instruction": instruction,
        }

    def merge(self, paths: tuple[str, ...]):
        """``(adapters, merged weights)`` of ``paths`` over the base weights, swapping nothing in
        (``lab.engine.adapter_state``)."""
        return self.adapters.merge(paths, self.runner.model, self.runner.weights.base)

    def check(self, k: Knobs) -> None:
        """The knob values that depend on this model (sizes, layers, attention), checked by ``lab.engine.knobs``."""
        check_for_model(k, self.facts, resolve(k, self.facts, self.adapters.layout(k.adapters)).causal)

    def validate(self, changes: dict, model_name: str) -> Knobs:
        """The knobs in force with ``changes``, checked on this model (``Engine.validate``)."""
        registry = knob_registry.KNOBS
        fixed = [n for n, v in changes.items() if n in registry and not registry[n].live and v != self.knobs[n]]
        if fixed:  # a knob fixed at load (``Knob.live``)
            name = fixed[0]
            raise ValueError(
                f"{name} cannot change live{_FIXED_WHY.get(name, '')}; create a new Engine instead: "
                f"Engine({model_name!r}, {name}={changes[name]!r})"
            )
        new = self.knobs.replace(**changes)
        self.check(new)
        resolve_backend(new.attention_backend, self.device)
        resolve_dtype(new.dtype, self.device)
        return new

    def change(self, new: Knobs) -> None:
        """Run with the checked knobs ``new``: re-merge adapters when their list changed, re-cast the weights to the
        new dtype, re-plan the CPU paths when the dtype or the workers changed."""
        self.repair()
        backend = resolve_backend(new.attention_backend, self.device)
        adapters = None
        if new.adapters != self.knobs.adapters:  # computed before anything is swapped: an error changes nothing
            adapters, merged = self.merge(new.adapters)
        dtype = resolve_dtype(new.dtype, self.device)
        workers = self.runner.cpu_workers(new.cpu_workers, backend)
        replan = dtype != self.runner.dtype or workers != self.workers
        self.dirty = True  # from here to the end, an interrupt is repaired by the next call (``repair``)
        if adapters is not None:
            self.runner.weights.set_merged(merged)
            self.adapters.use(adapters)
        self.runner.weights.set_dtype(dtype)
        self.knobs, self.backend = new, backend
        if replan:
            self.runner.plan_cpu_paths(workers)
        self.dirty = False

    def repair(self) -> None:
        """After a ``change`` interrupted while it swapped weights: make the merged adapters, the weights' dtype and
        the CPU plan agree with the knobs in force (the old ones, or the new ones if it got that far)."""
        if not self.dirty:
            return
        k = self.knobs
        adapters, merged = self.merge(k.adapters) if k.adapters else ([], {})
        self.runner.weights.set_merged(merged)
        self.adapters.use(adapters)
        self.runner.weights.set_dtype(resolve_dtype(k.dtype, self.device), force=True)  # every weight from its source
        self.runner.plan_cpu_paths(self.workers)
        self.dirty = False


def gated_call(method):
    """Decorates an engine's public call: it enters the engine's gate as a call (``lab.engine.gate``: one at a
    time, never while a ``configure`` runs), after repairing an interrupted ``configure`` alone (``repair``)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self._live.dirty:
            with self._gate.change():
                self._live.repair()
        with self._gate.call():
            return method(self, *args, **kwargs)

    return call


def gated_change(method):
    """Decorates an engine's change (``configure``): it enters the gate alone, once the other threads' calls
    finished."""

    @functools.wraps(method)
    def change(self, *args, **kwargs):
        with self._gate.change():
            return method(self, *args, **kwargs)

    return change
