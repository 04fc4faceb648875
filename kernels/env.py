"""The one parser of prefill-lab's ``LAB_*`` environment variables: a switch (``flag``), a folder or file
(``path``) or one of a fixed set of choices (``choice``), each read when called and checked, a value it does not
accept failing with a ``ValueError`` that names the variable, the value and the spellings it takes.

It sits in ``kernels/`` (installed as ``lab.kernels.env``), the bottom of the package, because the C kernels read
two of the variables and ``kernels/`` imports nothing from ``lab``; ``lab.env`` re-exports it for the rest of the
package and ``evals/``, with the table of every variable. An empty value counts as unset (the default).

    >>> flag("LAB_CPU_NATIVE_KERNELS", True)          # 1/0, true/false, yes/no, on/off, any case
    >>> path("LAB_CACHE", "~/.cache/prefill-lab", folder=True)
    >>> choice("LAB_CPU_BERT_QKV", ("split", "stacked", "auto"), "auto")
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def flag(name: str, default: bool) -> bool:
    """``$name`` as a switch: one of ``ON`` / ``OFF`` in any case; unset or empty: ``default``."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value.lower() in ON:
        return True
    if value.lower() in OFF:
        return False
    raise ValueError(
        f"{name}={value!r} is not a valid value: use {name}=1 (or {', '.join(ON[1:])}) to turn it on, "
        f"{name}=0 (or {', '.join(OFF[1:])}) to turn it off, or leave it unset for the default "
        f"({'on' if default else 'off'})"
    )


def setting(name: str) -> str:
    """``NAME=value`` as the environment holds it (``NAME unset`` when absent), for messages."""
    value = os.environ.get(name)
    return f"{name} unset" if value is None else f"{name}={value}"


def path(name: str, default: str | os.PathLike, *, folder: bool = False) -> Path:
    """``$name`` as a path (``~`` expanded); unset or empty: ``default``. ``folder=True``: the path must be a folder
    or not exist yet (to be created), so a file in its place, or in place of one of the folders above it, fails
    here naming the variable rather than at the first write."""
    value = os.environ.get(name, "")
    out = Path(value or default).expanduser()
    if folder:
        first = next((p for p in (out, *out.parents) if p.exists()), None)  # the nearest part that exists
        if first is not None and not first.is_dir():
            what = "is a file" if first == out else f"is under {first}, which is a file"
            setting = f"{name}={value!r}" if value else f"{name} is unset and its default {str(out)!r}"
            raise ValueError(
                f"{setting} {what}, not a folder: point {name} at a folder (created if absent)"
                f"{f' or unset it for the default {default}' if value else ' or set it to one'}"
            )
    return out


def choice(name: str, choices: Sequence[str], default: str, *, what: str = "an accepted value") -> str:
    """``$name`` as one of ``choices`` (in any case; the spelling in ``choices`` is returned); unset or empty:
    ``default``. ``what`` describes the choices in the error (``"a bert_qkv choice"``)."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    match = next((c for c in choices if c.lower() == value.lower()), None)
    if match is None:
        raise ValueError(f"{name}={value!r} is not {what}; valid: {', '.join(choices)} (unset: {default})")
    return match
