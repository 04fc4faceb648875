"""Every ``LAB_*`` environment variable prefill-lab reads (``VARIABLES``), and the checked readers every one of them
goes through: ``flag`` (a switch), ``path`` (a folder or file), ``choice`` (one of fixed choices). A value a reader
does not accept is a ``ValueError`` naming the variable, the value and the accepted spellings, never a silent
default. The readers live in ``lab.kernels.env`` (``kernels/`` reads two of the variables and imports nothing from
``lab``); this module is their home for ``lab/`` and ``evals/``. ``table()`` is the README's table of them.

    >>> from lab import env
    >>> env.flag("LAB_SMOKE", False)                  # LAB_SMOKE=yes -> True, LAB_SMOKE=maybe -> ValueError
    >>> print(env.table())
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from lab.kernels.env import OFF, ON, choice, flag, path, setting

__all__ = ["OFF", "ON", "VARIABLES", "Variable", "cache_root", "choice", "flag", "path", "setting", "table"]


class Variable(NamedTuple):
    accepted: str
    default: str
    effect: str


_SWITCH = f"a switch: {' / '.join(ON)} or {' / '.join(OFF)} (any case)"
# name -> what it takes, its default and what it does; tests/test_env.py holds this to the names the source reads
VARIABLES: dict[str, Variable] = {
    "LAB_CPU_<NAME>": Variable(
        "one of that fast path's choices (the CPU fast paths above), or `auto` (any case)",
        "unset: measured at load",
        "forces a CPU fast path for the process (`lab.ops.probes.decide`); an engine's `cpu_paths` wins over it; a "
        "`LAB_CPU_` name that is no fast path is refused when an engine loads",
    ),
    "LAB_CPU_NATIVE_KERNELS": Variable(
        _SWITCH,
        "on",
        "off: never build or offer the C kernels (attention, norms, rotary; `lab.kernels.cpu_attention`)",
    ),
    "LAB_KERNEL_CACHE": Variable(
        "a folder (created if absent)",
        "`~/.cache/prefill-lab/kernels`",
        "where the C kernels are compiled to (keyed by source, compiler and CPU flags)",
    ),
    "LAB_MALLOC_TUNING": Variable(
        _SWITCH,
        "off",
        "on: tune glibc's allocator for the process (as `Engine(tune_allocator=True)`, which wins "
        "over it); keeps the peak heap",
    ),
    "LAB_MEMORY_CHECK": Variable(
        _SWITCH,
        "on",
        "off: calls skip the memory check (`lab.runtime.memory`: steps cut to fit, or refused, under "
        "`RLIMIT_AS`, a cgroup's limit or the machine's available memory)",
    ),
    "LAB_CACHE": Variable(
        "a folder (created if absent)",
        "`~/.cache/prefill-lab`",
        "where a `.gguf` file is converted to a safetensors folder, once (`lab.models.gguf`)",
    ),
    "LAB_MTEB_CACHE": Variable(
        "a folder", "`evals/results/cache`", "mteb's result cache for `lab.evaluate` / `evals.run`"
    ),
    "LAB_EVAL_DATA": Variable(
        "a folder", "`evals/data`", "the evaluation data (`evals/tasks.py`, `evals/rerank_twitter.py`)"
    ),
    "LAB_SMOKE": Variable(
        _SWITCH,
        "off",
        "on: notebooks, `evals/bench_peers.py` and `evals/llm2vec_study.py` shrink every workload to seconds",
    ),
    "LAB_PEERS_CACHE": Variable(
        "a folder", "`~/.cache/prefill-lab`", "where `evals/bench_peers.py` builds the peers' virtual environment"
    ),
    "LAB_LLM2VEC_VENV": Variable(
        "a folder", "`~/.cache/prefill-lab/venvs/llm2vec`", "llm2vec's virtual environment (`evals/llm2vec_parity.py`)"
    ),
}


def cache_root() -> Path:
    """``$LAB_CACHE`` or ``~/.cache/prefill-lab``; a file in its place is a ``ValueError`` naming the variable."""
    return path("LAB_CACHE", Path.home() / ".cache" / "prefill-lab", folder=True)


def table() -> str:
    """``VARIABLES`` as a Markdown table (variable, accepted values, default, effect)."""
    rows = ["| variable | accepted values | default | effect |", "|---|---|---|---|"]
    rows += [f"| `{name}` | {v.accepted} | {v.default} | {v.effect} |" for name, v in VARIABLES.items()]
    return "\n".join(rows)
