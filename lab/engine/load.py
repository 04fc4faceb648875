"""What an ``Engine`` loads, in the order a failure should stop it: the model named (a hub id resolved to its snapshot,
a local folder, a ``.gguf`` file, an adapter folder over its base), its folder's spec, the device, the forced CPU
paths and ``compile`` checked, the allocator tuned, then the tokenizer, the model, the runner, and the adapter
state (``lab.engine.adapter_state``). A bad argument is refused before any weight is read.

    >>> loaded = load("sentence-transformers/all-MiniLM-L6-v2", Knobs(), cpu_paths=None, tune_allocator=None,
    ...               compile=None)
    >>> loaded.runner, loaded.knobs.adapters
"""

from __future__ import annotations

import dataclasses
import os

import torch

from lab.adapt.adapters import split_adapter_model
from lab.engine.adapter_state import AdapterState
from lab.engine.knobs import Knobs, ModelFacts, resolve_device, resolve_dtype
from lab.models import hub
from lab.models.build import build_model
from lab.models.folder import load_tokenizer, read_folder
from lab.models.spec import ModelSpec
from lab.ops.probes import check_forced
from lab.runtime import allocator
from lab.runtime.compiled import check_compile
from lab.runtime.runner import Runner


@dataclasses.dataclass(frozen=True)
class Loaded:
    """An engine's loaded parts. ``knobs``: the knobs given, with the adapters that came with the folder first."""

    source: hub.Source
    model_path: str
    spec: ModelSpec
    device: torch.device
    tokenizer: object
    model: torch.nn.Module
    runner: Runner
    facts: ModelFacts
    adapters: AdapterState
    knobs: Knobs


def load(model, k: Knobs, *, cpu_paths: dict[str, str] | None, tune_allocator: bool | None, compile: bool | None):
    """``Engine(model, cpu_paths=, tune_allocator=, compile=, **knobs)``'s loading (``k``: the knobs, checked)."""
    tune = allocator.malloc_tuning_requested(tune_allocator)  # a bad LAB_MALLOC_TUNING fails before anything loads
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a local model folder or a hub id ('org/name'), got {type(model).__name__}")
    source = hub.resolve(model, k.revision)  # a hub id: its snapshot folder, fetched if need be
    by_id = not os.path.exists(os.path.expanduser(os.fspath(model)))  # named by hub id, not by path
    folder = str(source.folder)  # as given: llm2vec's base argument (lab.engine.llm2vec)
    base, adapters = split_adapter_model(folder, k.adapters)  # an adapter-only folder: its base
    auto = adapters[: len(adapters) - len(k.adapters)]  # the adapters that came with the folder
    spec = read_folder(base)
    device = resolve_device(k.device)
    forced = check_forced(cpu_paths)  # before anything loads: a bad name or choice changes nothing
    check_compile(compile, forced)
    if tune and device.type == "cpu":
        allocator.tune_cpu_allocator()
    tokenizer = load_tokenizer(spec)
    dtype = resolve_dtype(k.dtype, device)
    built = build_model(spec, device, dtype, forced)
    facts = ModelFacts.of(built, tokenizer, spec)  # what the knobs resolve against
    state = AdapterState(
        folder,
        auto=auto,
        repo_id=source.repo_id if by_id else None,
        decoder=bool(built.is_decoder),
        base=str(base),
        architecture=spec.architecture,
    )
    return Loaded(
        source=source,
        model_path=str(base),
        spec=spec,
        device=device,
        tokenizer=tokenizer,
        model=built,
        runner=Runner(built, device=device, dtype=dtype, cpu_paths=forced, compile=compile),
        facts=facts,
        adapters=state,
        knobs=k.replace(adapters=adapters),
    )
