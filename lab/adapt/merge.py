"""PEFT LoRA adapters merged into our packed models' weights, live (``Engine(path, adapters=[...])``,
``configure(adapters=...)``): ``merged_weights``.

Each LoRA module of an adapter ``lab.adapt.adapters`` read adds ``scale * B @ A`` to one transformers ``nn.Linear``
weight. Our models fuse some of those Linears (q/k/v, gate/up), so each model class says where every transformers
Linear lives in its parameters (``hf_linear_map()``: module name -> our parameter and its rows, a slice or an index
tensor) and how to strip checkpoint prefixes from a name (``hf_module_name``). Several adapters merge in order, each
on top of the last (as llm2vec stacks its MNTP and SimCSE adapters): ``W = ((W0 + d1) + d2) ...``, all in float32
from the runner's float32 master copy.

Every module's name and shapes are checked against the base before any weight is computed, and every merged weight
must come out finite, so an adapter that does not fit raises and leaves the model as it was. Refused with a clear
error: modules or shapes that do not fit the base, LoRA on embeddings or ``lm_head``.

    >>> ads = [read_adapter("runs/mntp"), read_adapter("runs/simcse")]
    >>> merged = merged_weights(model, base_weights, ads)   # {our parameter name: float32 merged weight}
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lab._warn import warn
from lab.adapt.adapters import LoraAdapter
from lab.models.checks import check_finite


def merged_weights(model, base: Mapping[str, torch.Tensor], adapters: list[LoraAdapter]) -> dict[str, torch.Tensor]:
    """``{parameter name: float32 merged weight}`` for the parameters the adapters touch, merged in order on top
    of ``base`` (the runner's master copy; untouched parameters are left out). Checks every module's name and
    shapes against ``model.hf_linear_map()`` before computing anything."""
    if not adapters:
        return {}
    table = model.hf_linear_map()  # a model that cannot map transformers' Linear layers raises a clear error
    plan = []
    for ad in adapters:
        where = f"adapter {str(ad.path)!r}"
        for m in ad.modules:
            name = model.hf_module_name(m.module)
            if name not in table:
                valid = [k for k, v in table.items() if v is not None][:4]
                raise ValueError(
                    f"{where}: module {m.module!r} does not fit this {_arch(model)} base: it has no Linear layer "
                    f"{name!r}{_why_missing(name)}. Was the adapter trained on another model? This base's LoRA "
                    f"targets are named like {', '.join(valid)}"
                )
            target = table[name]
            if target is None:  # a module our forward never runs (BERT's pooler without a classification head)
                warn(
                    f"{where}: LoRA on {m.module!r} is ignored: this model never runs that module "
                    "(embeddings do not use it)",
                )
                continue
            param, rows = target
            w = base[param][rows]
            if m.A.shape[1] != w.shape[1] or m.B.shape[0] != w.shape[0]:
                raise ValueError(
                    f"{where}: module {m.module!r} does not fit this base's shapes: the adapter has lora_A "
                    f"{tuple(m.A.shape)} and lora_B {tuple(m.B.shape)}, this base's weight is {tuple(w.shape)} "
                    f"(out, in), so lora_A must be (r, {w.shape[1]}) and lora_B ({w.shape[0]}, r). Was the "
                    "adapter trained on another model size?"
                )
            plan.append((param, rows, m))
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for param, rows, m in plan:  # adapter order: each adapter on top of the ones before it
            if param not in merged:
                merged[param] = base[param].to(torch.float32, copy=True)
            dev = merged[param].device
            delta = (m.B.to(dev) @ m.A.to(dev)) * m.scale  # peft's get_delta_weight
            merged[param][rows] += delta
        for param, weight in merged.items():  # finite inputs can still overflow float32
            modules = ", ".join(sorted({f"{m.module!r}" for p, _, m in plan if p == param}))
            check_finite(
                weight,
                f"the merged weight {param!r} (LoRA modules {modules} of "
                f"{', '.join(repr(str(ad.path)) for ad in adapters)})",
                "The adapters' lora_alpha / r or weights are too large for float32; nothing was changed",
            )
    return merged


def _arch(model) -> str:
    config = model.config or {}
    archs = config.get("architectures") or [config.get("model_type") or type(model).__name__]
    return str(archs[0])


def _why_missing(name: str) -> str:
    if "embed" in name or "lm_head" in name or name.endswith(("wte", "word_embeddings")):
        return " (LoRA on embeddings / lm_head is not supported: only the transformer blocks' Linear layers)"
    return ""
