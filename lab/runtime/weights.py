"""A model's weights: the master copy as loaded, float32 merged copies of what adapters change, and the live casts.

``configure(dtype=...)`` re-casts the live weights from the master copy (no reload, reversible); LoRA adapters are
merged into float32 copies of the parameters they change (``lab.adapt.merge.merged_weights``), which then become
those parameters' source. Every swap drops the copies the model's CPU plan derived from the old data
(``CpuPlan.drop``: packed or widened weights), so none is kept stale.

    >>> weights = Weights(model, device=torch.device("cpu"), dtype=torch.float32)
    >>> weights.set_dtype(torch.bfloat16); weights.set_merged(merged)     # live casts from master / merged copies
"""

from __future__ import annotations

import hashlib

import torch

from lab.models.base import PackedModel


class Weights:
    def __init__(self, model: PackedModel, *, device: torch.device, dtype: torch.dtype):
        self.model, self.device = model, device
        # master weights in their loaded precision; the live module holds casts of them
        self._master = {name: p.detach() for name, p in model.named_parameters()}
        # float32 copies of the parameters LoRA adapters changed (``set_merged``); the live weights cast these
        self._merged: dict[str, torch.Tensor] = {}
        self._digest = "base"  # of ``_merged`` (``state``)
        self.dtype: torch.dtype | None = None
        self.set_dtype(dtype)

    @property
    def base(self) -> dict[str, torch.Tensor]:
        """The master copy of every parameter as loaded (no adapters merged); read it, do not change it."""
        return self._master

    @property
    def state(self) -> tuple[str, str]:
        """What the live weights hold: their dtype and a digest of the merged copies (``"base"``: none), the key
        under which a compiled forward froze them (``lab.runtime.compiled``)."""
        return str(self.dtype), self._digest

    def set_dtype(self, dtype: torch.dtype, *, force: bool = False) -> None:
        """Re-cast the live weights from the master copy, or a parameter's merged copy when adapters changed it
        (float32 shares the master's / merged copy's storage); ``force`` re-casts even when nothing seems to have
        changed. Interrupt-safe: all casts are made before any weight is swapped, and a call always leaves every
        weight in ``dtype`` (it repairs a half-done switch)."""
        params = dict(self.model.named_parameters())
        if not force and dtype == self.dtype and all(p.dtype == dtype for p in params.values()):
            return
        # every cast first: an interrupt here leaves the live weights as they were. Detached, not under
        # ``torch.no_grad()``: an interrupt landing on a ``with`` line's exit skips ``__exit__`` and leaves grad mode
        # off for the whole thread
        live = {name: self._merged.get(name, self._master[name]).detach().to(self.device, dtype) for name in params}
        self.dtype = None  # in transition: an interrupt during the swaps below leaves a state the next call repairs
        self._swap(params, live)
        self.dtype = dtype

    def set_merged(self, merged: dict[str, torch.Tensor]) -> None:
        """Make ``merged`` (parameter name -> float32 weight: base + LoRA deltas) the source of those parameters, and
        every other parameter its master again; ``{}`` restores the base weights exactly. The live weights are cast
        before any is swapped, so an error leaves them as they were."""
        params = dict(self.model.named_parameters())
        unknown = sorted(set(merged) - set(params))
        if unknown:
            raise KeyError(f"merged weights for unknown parameters: {', '.join(unknown[:5])}")
        for name, t in merged.items():
            if t.shape != self._master[name].shape:
                raise ValueError(f"merged {name}: shape {tuple(t.shape)} != {tuple(self._master[name].shape)}")
        live = {
            name: merged.get(name, self._master[name]).detach().to(self.device, self.dtype)
            for name in set(self._merged) | set(merged)
        }
        digest = _digest(merged)
        self._swap(params, live)
        self._merged, self._digest = dict(merged), digest

    def _swap(self, params: dict[str, torch.nn.Parameter], live: dict[str, torch.Tensor]) -> None:
        for name, t in live.items():
            params[name].data = t
            self.model.plan.drop(params[name])


def _digest(merged: dict[str, torch.Tensor]) -> str:
    """A digest of merged weights by name and content (``"base"`` for none)."""
    if not merged:
        return "base"
    h = hashlib.blake2b(digest_size=12)
    for name in sorted(merged):
        t = merged[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().data)
    return h.hexdigest()
