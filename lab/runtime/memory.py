"""Memory ceilings: how much a call may still allocate, and what one step of it needs, known before it allocates.

A process that asks for more memory than it may have is killed (a cgroup's OOM killer) or fails inside an
allocation, half-way through a layer (``RLIMIT_AS``). So before each wave of a call runs, the executor compares:

- **what may still be allocated** (``ceiling``): the least of the address space ``RLIMIT_AS`` leaves (its soft limit
  less ``VmSize``), what the process's cgroups leave (v2 ``memory.max`` less ``memory.current`` with its inactive
  file cache, for the process's group and every group above it; v1 ``memory.limit_in_bytes`` less
  ``memory.usage_in_bytes``), and what the machine has (``MemAvailable`` + ``SwapFree``);
- **what the wave needs** (``Need``): its largest step's activations, from the model's shapes and the step's tokens
  (``step_bytes``: per token, one layer's live tensors, since a prefill keeps nothing from the layers it has run,
  the compiled forward and the CPU workers included), the keys/values the KV path keeps (``state_bytes``) and the
  outputs the wave adds to the call's (``kept_bytes``), times ``MARGIN`` (``ADDRESS_SPACE_MARGIN`` against
  ``RLIMIT_AS``, which counts address space).

The check covers steps on the CPU (the engine's device); a GPU's own memory is not estimated, nor are the caches
of the libraries a step calls: oneDNN's float32 GEMM (``f32_gemm='onednn'``) keeps a compiled primitive per GEMM
shape, so its address space and resident memory grow with the shapes it has seen (up to oneDNN's primitive cache
capacity), outside a step's estimate. When the largest step does not fit but a smaller one does, the wave runs in
steps of fewer tokens (packed outputs do not depend on which sequences share a step) and the call's
``stats.memory_budget`` says the token budget it ran under (the engine warns once). When a single input's step does not
fit, or the outputs alone do not, the call stops with ``MemoryLimitError`` before the wave allocates, naming what was
needed, what was left and under which limit, and the knob to change (``max_length`` / ``long_inputs`` /
``chunked_prefill`` / ``dtype`` for a long input, ``output`` or fewer inputs per call for the outputs).
``LAB_MEMORY_CHECK=0`` turns the check off for the process.

    >>> memory.ceiling()                       # Ceiling(bytes=..., source='RLIMIT_AS ...') or None (no limit known)
    >>> memory.step_bytes(memory.shapes(model, torch.device("cpu"), torch.float32), tokens=16384, dtype_bytes=4)
"""

from __future__ import annotations

import math
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lab import env

ENV = "LAB_MEMORY_CHECK"
MARGIN = 1.5  # the estimate's slack: allocator rounding, temporaries of fused ops, steps overlapping in the workers
# RLIMIT_AS counts address space, which a step maps beyond its live tensors (the BLAS libraries' packing buffers and
# scratchpads, the allocator's mappings): the estimate is scaled by this under it instead of MARGIN
ADDRESS_SPACE_MARGIN = 3.0
RESERVE = 64 << 20  # bytes left aside for what a step allocates besides its tensors (threads' stacks, arenas)
_UNLIMITED_V1 = 1 << 60  # cgroup v1 writes "no limit" as a page-aligned LONG_MAX


class MemoryLimitError(MemoryError):
    """A call needs more memory than the process may allocate (``lab.runtime.memory``); raised before it
    allocates. The message names the knob to change."""


class MemoryNotice(UserWarning):
    """A call's steps were cut to fewer tokens than ``max_batch_tokens`` so that they fit the memory ceiling."""


@dataclass(frozen=True)
class Ceiling:
    """What the process may still allocate (``bytes``), the limit that says so (``source``) and how much a step's
    estimate is scaled by against it (``margin``)."""

    bytes: int
    source: str
    margin: float = MARGIN


def enabled() -> bool:
    """``$LAB_MEMORY_CHECK`` (a switch, default on)."""
    return env.flag(ENV, True)


def ceiling(root: Path = Path("/")) -> Ceiling | None:
    """The least of the limits in force (module doc), or ``None`` where none can be read. ``root``: where ``/proc``
    and ``/sys`` are (tests give a folder laid out like them)."""
    found = [c for c in (_address_space(root), *_cgroups(root), _machine(root)) if c is not None]
    return min(found, key=lambda c: c.bytes / c.margin, default=None)


def _status_kb(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _address_space(root: Path) -> Ceiling | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = _status_kb(root / "proc/self/status", "VmSize")
    if used is None:
        return None
    return Ceiling(
        max(0, soft - used), f"RLIMIT_AS (address space: {_gb(soft)} limit, {_gb(used)} mapped)", ADDRESS_SPACE_MARGIN
    )


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _inactive_file(stat: Path) -> int:
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name in ("inactive_file", "total_inactive_file"):
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroups(root: Path) -> list[Ceiling]:
    """One ceiling per cgroup level with a memory limit, the process's group and every group above it."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        hid, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":  # v2: one unified hierarchy (under unified/ on a hybrid layout)
            base, limit_name, usage_name = root / "sys/fs/cgroup", "memory.max", "memory.current"
            if not (base / "cgroup.controllers").exists():
                base = base / "unified"
        elif "memory" in controllers.split(","):  # v1: the memory controller's hierarchy
            base, limit_name, usage_name = (
                root / "sys/fs/cgroup/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        group = base / rel.strip("/")
        if not group.is_dir():  # a container's namespace: its own group is the hierarchy's root
            group = base
        while True:
            limit, usage = _read_int(group / limit_name), _read_int(group / usage_name)
            if limit is not None and usage is not None and limit < _UNLIMITED_V1:
                used = usage - _inactive_file(group / "memory.stat")
                out.append(
                    Ceiling(
                        max(0, limit - used), f"cgroup {group / limit_name} ({_gb(limit)} limit, {_gb(used)} in use)"
                    )
                )
            if group == base:
                break
            group = group.parent
    return out


def _machine(root: Path) -> Ceiling | None:
    meminfo = root / "proc/meminfo"
    avail = _status_kb(meminfo, "MemAvailable")
    if avail is None:
        return None
    swap = _status_kb(meminfo, "SwapFree") or 0
    return Ceiling(avail + swap, f"the machine's available memory (MemAvailable {_gb(avail)} + SwapFree {_gb(swap)})")


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------------- estimates
@dataclass(frozen=True)
class Shapes:
    """What a step's memory depends on: ``hidden``, ``intermediate`` (the MLP's width), ``q_dim`` (query heads x
    head size), ``kv_dim`` (key/value heads x head size), ``layers``, ``heads``; ``padded``: the model pads its
    sequences to the longest (transformers' forward, whose eager attention holds ``heads x L x L`` scores);
    ``ffn_rows``: the most tokens whose MLP inner rows are live at once (``PackedModel.ffn_rows``; ``None``: all)."""

    hidden: int
    intermediate: int
    q_dim: int
    kv_dim: int
    layers: int
    heads: int
    padded: bool = False
    ffn_rows: int | None = None


def shapes(model, device, dtype, *, eager: bool = True) -> Shapes:
    """A model's ``Shapes`` on ``device`` in ``dtype`` from its ``config.json`` (``model.config``) and attributes;
    missing sizes take a transformer's usual ones (4 x hidden for the MLP, keys/values as wide as the queries).
    ``eager``: the step runs the eager forward (the compiled one computes the MLP for every row at once)."""
    cfg, hidden = model.config or {}, int(model.hidden_size)

    def size(*keys, default: int) -> int:
        for key in keys:
            value = cfg.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return default

    heads = size("num_attention_heads", "n_head", "num_heads", default=max(1, hidden // 64))
    head_dim = size("head_dim", default=max(1, hidden // heads))
    kv_heads = size("num_key_value_heads", default=heads)
    return Shapes(
        hidden=hidden,
        intermediate=size("intermediate_size", "ffn_dim", "n_inner", default=4 * hidden),
        q_dim=heads * head_dim,
        kv_dim=kv_heads * head_dim,
        layers=model.num_layers or size("num_hidden_layers", default=1),
        heads=heads,
        padded=not model.packed,
        ffn_rows=model.ffn_rows(device, dtype) if eager else None,
    )


def step_bytes(sh: Shapes, tokens: int, *, dtype_bytes: int, sequences: int = 1, longest: int = 0) -> int:
    """The most one step of ``tokens`` packed tokens holds at once: one layer's live tensors per token (the residual
    stream and its normed copy, queries, keys, values, the attention's output and the MLP's output: ``4 hidden + 2
    q_dim + 2 kv_dim`` values) plus a float32 copy of two hidden rows (norms widen bfloat16), and the MLP's gate, up
    and activated rows (``3 intermediate`` values) for at most ``ffn_rows`` tokens. A ``padded`` model computes
    ``sequences x longest`` tokens and holds ``heads x longest^2`` float32 scores per sequence, twice (scores and
    weights)."""
    if sh.padded:
        tokens = max(tokens, sequences * longest)
    width = max(dtype_bytes, 4)  # counted as float32: a bfloat16 step widens most of its activations on CPU
    per_token = width * (4 * sh.hidden + 2 * sh.q_dim + 2 * sh.kv_dim) + 8 * sh.hidden
    inner = min(tokens, sh.ffn_rows or tokens) * width * 3 * sh.intermediate
    scores = 2 * 4 * sh.heads * sequences * longest * longest if sh.padded else 0
    return tokens * per_token + inner + scores


def state_bytes(sh: Shapes, tokens: int, prefix: int, *, dtype_bytes: int) -> int:
    """What the KV path (``lab.engine.kv_path``) keeps between steps: for ``tokens`` tokens of long inputs their
    hidden states and one layer's keys/values, plus a shared prefix's keys/values of every layer."""
    return dtype_bytes * (tokens * (sh.hidden + 2 * sh.kv_dim) + prefix * 2 * sh.kv_dim * sh.layers)


def kept_bytes(shape, lengths: list[int], hidden: int) -> int:
    """What the outputs of inputs of ``lengths`` tokens add to a call's results (float32), by the pooler's
    ``shape`` (``lab.outputs.heads``): a fixed shape per row; ``None`` (per-token rows) ``length x hidden``; a
    sparse row at most one (column, value) pair per token; a dict: the sum of its outputs (``colbert`` counted as
    wide as ``tokens``)."""
    if isinstance(shape, dict):
        return sum(kept_bytes(s, lengths, hidden) for s in shape.values())
    if shape is None:
        return 4 * hidden * sum(lengths)
    if isinstance(shape, tuple):
        return 4 * math.prod(shape) * len(lengths)
    return 12 * sum(lengths)  # SparseShape: float32 value + int64 column (upper bound)


# ----------------------------------------------------------------------------------------------- the check
@dataclass(frozen=True)
class Need:
    """A wave's memory: ``step(tokens)`` for a step of that many tokens, ``kept`` for its outputs."""

    step: Callable[[int], int]
    kept: int


def fit_budget(need: Need, *, budget: int, tokens: int, longest: int, limit: Ceiling | None = None) -> int:
    """The step token budget a wave of ``tokens`` tokens runs under: ``budget`` (the ``max_batch_tokens`` knob) when
    its largest step (``min(budget, tokens)``, at least ``longest``) fits the ceiling, else the largest one that
    does (at least ``longest``: one input per step). Raises ``MemoryLimitError`` when the outputs alone or a step of
    the ``longest`` input does not fit, naming the knobs that shrink them. ``limit``: the ceiling (read now when not
    given); with none known, or ``$LAB_MEMORY_CHECK`` off, ``budget``."""
    if limit is None:
        if not enabled():
            return budget
        limit = ceiling()
        if limit is None:
            return budget
    room = limit.bytes - RESERVE

    def needs(step_tokens: int) -> int:
        return int(limit.margin * (need.step(step_tokens) + need.kept))

    largest = max(longest, min(budget, tokens))
    if needs(largest) <= room:
        return budget
    where = f"can still be allocated under {limit.source}"
    if int(limit.margin * need.kept) > room:
        raise MemoryLimitError(
            f"the outputs of this call need about {_gb(limit.margin * need.kept)} but {_gb(max(room, 0))} {where}: "
            "embed fewer inputs per call (or write them to disk with lab.distributed.embed_dataset), or ask for "
            "a smaller output (output='dense' instead of 'tokens' / 'colbert')"
        )
    if needs(longest) > room:
        raise MemoryLimitError(
            f"one step of the longest input ({longest} tokens) needs about {_gb(needs(longest))} but "
            f"{_gb(max(room, 0))} {where}: lower max_length, split long inputs into windows (long_inputs='chunk'), "
            "use chunked_prefill on a causal model, or a smaller dtype ('bfloat16'); LAB_MEMORY_CHECK=0 turns this "
            "check off"
        )
    lo, hi = longest, largest  # needs(lo) fits, needs(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if needs(mid) <= room else (lo, mid)
    return lo


def status_bytes(field: str) -> int | None:
    """A size from this process's ``/proc/self/status`` in bytes: ``VmSize`` (what ``RLIMIT_AS`` counts),
    ``VmRSS``, ``VmHWM`` (the peak ``VmRSS``); ``None`` off Linux."""
    return _status_kb(Path("/proc/self/status"), field)


def reset_peak() -> bool:
    """Reset this process's peak resident memory (``VmHWM``) to its current ``VmRSS`` (Linux); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
