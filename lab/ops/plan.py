"""One engine's CPU plan: its fast-path choices and the weight copies made for them.

Every CPU fast-path choice (``bf16_gemm``, ``f32_gemm``, the weight layouts ``f32_weights`` / ``bf16_weights``, the
attention kernel, the norms, a family's own paths such as ``bert_ffn``) lives in one ``CpuPlan`` per model, and so
per engine: the layers hold a reference to their model's plan and read it on every call, and the GEMMs
(``lab.ops.gemm``) take it as an argument. Nothing about how an engine computes sits in module globals, so two
engines with different choices in one process (or two threads) each compute their own way.

The plan also keeps the copies derived from weights for those choices: a float32 copy of a bfloat16 weight for the
``widened`` GEMMs (``wide_weight``), oneDNN's blocked layout of a weight (``packed_weight``). Each is made once per
weight (and per row block of it) and kept until that weight's data changes (a dtype switch or an adapter merge
replaces ``.data``, an in-place change bumps its version), when it is remade; ``drop`` frees a weight's copies at
once when the runner swaps it.

**Trials.** The planner (``lab.runtime.planner``) decides a plan by timing candidates, and a family's candidate may
set its own choice before running a layer (``plan["bert_ffn"] = "blocks"``). Inside ``with plan.trial():`` reads and
writes from the planning thread go to a fresh set of choices, so calls running meanwhile on other threads keep
seeing the plan in force; ``replace`` installs the decided choices in one step.

    >>> plan = CpuPlan()
    >>> plan["attention_kernel"] = "lab"
    >>> y = linear(x, w, b, plan=plan)                      # lab.ops.gemm, with this plan's GEMM modes
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

DERIVED_KINDS = ("wide", "packed")


class CpuPlan:
    """Fast-path choices (name -> candidate; a missing name means the family's default) and derived weights."""

    def __init__(self, choices: dict[str, str] | None = None):
        self._choices: dict[str, str] = dict(choices or {})
        self._local = threading.local()  # ``trial`` choices of the thread that plans
        # (kind, id(base tensor)) -> (weakref to the base, held source, its version, {key: derived tensor})
        self._derived: dict[tuple[str, int], tuple] = {}
        self._lock = threading.Lock()  # CPU workers may ask for the same copy at once: one copy

    # ---------------------------------------------------------------------------------------------- choices
    def _view(self) -> dict[str, str]:
        trial = getattr(self._local, "trial", None)
        return self._choices if trial is None else trial

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._view().get(name, default)

    def __getitem__(self, name: str) -> str:
        return self._view()[name]

    def __setitem__(self, name: str, choice: str) -> None:
        self._view()[name] = choice

    def __contains__(self, name: str) -> bool:
        return name in self._view()

    def update(self, choices: dict[str, str]) -> None:
        self._view().update(choices)

    def clear(self) -> None:
        self._view().clear()

    def as_dict(self) -> dict[str, str]:
        return dict(self._view())

    def replace(self, choices: dict[str, str]) -> None:
        """Install ``choices`` as the plan in force, in one step."""
        self._choices = dict(choices)

    @contextmanager
    def trial(self) -> Iterator[dict[str, str]]:
        """In this thread, read and write a fresh set of choices (yielded) instead of the plan in force."""
        self._local.trial = {}
        try:
            yield self._local.trial
        finally:
            self._local.trial = None

    def __repr__(self) -> str:
        return f"CpuPlan({self._view()!r})"

    # -------------------------------------------------------------------------------------------- GEMM modes
    @property
    def bf16_gemm(self) -> str:
        """``native`` (oneDNN's bfloat16 kernels) or ``widened`` (float32 GEMMs over the bfloat16 values)."""
        return self.get("bf16_gemm") or "native"

    @property
    def f32_gemm(self) -> str:
        """``blas`` (torch's ``F.linear``) or ``onednn``."""
        return self.get("f32_gemm") or "blas"

    def weights(self, dtype: torch.dtype) -> str:
        """The layout oneDNN's GEMMs of ``dtype`` read their weights in: ``packed`` (reordered once) or ``plain``."""
        name = {torch.float32: "f32_weights", torch.bfloat16: "bf16_weights"}.get(dtype)
        return (self.get(name) if name else None) or "plain"

    # ------------------------------------------------------------------------------------------ derived copies
    def derived(self, w: torch.Tensor, kind: str, key, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``make(w)`` for weight ``w`` (a parameter, or a view of one such as a row block), made once and kept for
        ``w``'s base tensor under ``kind`` and ``key`` until the base's data changes, when every copy of that kind
        is dropped and remade."""
        base = w if w._base is None else w._base
        slot = (kind, id(base))
        entry = self._derived.get(slot)
        if not _current(entry, base) or key not in entry[3]:
            with self._lock:
                entry = self._derived.get(slot)
                if not _current(entry, base):
                    # the held source keeps its memory alive, so no other weight can take its address; the weak
                    # reference drops the entry when the base tensor itself goes away
                    ref = weakref.ref(base, lambda _, s=slot, d=self._derived: d.pop(s, None))
                    entry = (ref, base.detach(), _version(base), {})
                    self._derived[slot] = entry
                if key not in entry[3]:
                    entry[3][key] = make(w)
        return entry[3][key]

    def drop(self, t: torch.Tensor) -> None:
        """Forget the copies derived from ``t``: its data was just replaced, so they are stale, and their memory is
        freed now rather than when a call would have remade them."""
        for kind in DERIVED_KINDS:
            self._derived.pop((kind, id(t)), None)

    def copies(self) -> list[tuple[str, torch.Tensor, bool]]:
        """``(kind, base weight, current)`` for every weight with derived copies kept; ``current``: made from the
        weight's present data (a stale entry is remade on its next use, or dropped by ``drop``)."""
        out = []
        for (kind, _), entry in list(self._derived.items()):
            base = entry[0]()
            if base is not None:
                out.append((kind, base, _current(entry, base)))
        return out

    def derived_bytes(self) -> int:
        """Memory held by the derived copies (for reports: packed copies cost one more copy of each weight)."""
        return sum(
            c.numel() * c.element_size() for _, _, _, copies in list(self._derived.values()) for c in copies.values()
        )


def _version(t: torch.Tensor) -> int:
    """``t._version``; an inference tensor (made under ``torch.inference_mode``) has none: -1."""
    return -1 if t.is_inference() else t._version


def _current(entry: tuple | None, base: torch.Tensor) -> bool:
    """Whether ``entry`` (weak ref, held source, its version, copies) was made from ``base``'s present data."""
    return (
        entry is not None
        and entry[0]() is base
        and entry[1].data_ptr() == base.data_ptr()
        and entry[2] == _version(base)
    )
