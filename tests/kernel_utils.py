"""Shared helpers for the Triton kernel tests (``tests/test_kernels_*.py``): where and how the kernels run.

How ``TRITON_INTERPRET`` is handled (checked against triton 3.9). Triton does not read the variable once: it is
read when ``@triton.jit`` *decorates* a function — ``import triton`` decorates triton.language's own helpers
(``tl.zeros``, ``tl.sum``, ...), importing ``lab.kernels.attention`` decorates ours — and again at the first
launch, when triton lazily imports ``triton.experimental.gluon`` (which asserts the interpreter flag). Whoever
imports ``triton`` first fixes the mode for the whole process, and ``import sentence_transformers`` already
imports it. Setting the variable at the top of a test module therefore works only by luck of import order, and
leaves it set for every other test (``lab.ops.attention.resolve_backend`` reads it). So each kernel test module asks
:func:`kernel_module` which of three modes applies:

- ``TRITON_INTERPRET=1`` already in the environment (``TRITON_INTERPRET=1 pytest -m interpreter``, Triton's own
  convention): the interpreter in this process, CPU tensors, one pytest result per case.
- else CUDA available: the real compiled kernels on ``cuda`` tensors.
- else (a plain ``pytest`` on CPU): the module's cases are skipped here and its one ``test_interpreter_subprocess``
  runs them in a fresh ``python -m pytest`` with ``TRITON_INTERPRET=1`` set from the start (one child for all
  kernel test files), failing with the child's report. Import order in this process cannot matter, and nothing
  leaks into other tests. For one result per case, run ``TRITON_INTERPRET=1 pytest -m interpreter``.

    >>> ka, DEVICE = kernel_module("attention", __file__)    # ka None -> cases run in the subprocess
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_REASON = "no CUDA and TRITON_INTERPRET unset here: these cases run in test_interpreter_subprocess"


def kernel_module(name: str, test_file: str) -> tuple[ModuleType | None, str]:
    """``(lab.kernels.<name>, device)``, or ``(None, "cpu")`` when ``test_file``'s cases must run in a subprocess."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        if "triton" in sys.modules:  # imported in this process, so already in interpreter mode (env set at start)
            import triton.language as tl
            from triton.runtime.interpreter import InterpretedFunction

            assert isinstance(tl.zeros, InterpretedFunction), "triton was imported before TRITON_INTERPRET=1 was set"
        return importlib.import_module(f"lab.kernels.{name}"), "cpu"
    if torch.cuda.is_available():
        return importlib.import_module(f"lab.kernels.{name}"), "cuda"
    _PENDING.append(str(Path(test_file).resolve().relative_to(REPO)))
    return None, "cpu"


_PENDING: list[str] = []  # test files (relative to the repo) whose cases run in the subprocess
_CHILD: subprocess.CompletedProcess | None = None


def run_module_in_subprocess(test_file: str, timeout: float = 300) -> None:
    """Fail if ``test_file``'s cases fail in a fresh ``TRITON_INTERPRET=1`` pytest process.

    One child runs every pending kernel test file (collection registered them), so the torch/triton start-up is
    paid once; each file's own subprocess test then reports only its file's failures.
    """
    global _CHILD
    rel = str(Path(test_file).resolve().relative_to(REPO))
    if _CHILD is None:
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *(_PENDING or [rel])]
        env = dict(os.environ, TRITON_INTERPRET="1")
        _CHILD = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    out = _CHILD.stdout + _CHILD.stderr
    mine = [line for line in out.splitlines() if line.startswith((f"FAILED {rel}", f"ERROR {rel}"))]
    if _CHILD.returncode not in (0, 1) or mine:
        pytest.fail(
            f"{' '.join(_CHILD.args)} (rc={_CHILD.returncode}), failures in {rel}:\n"
            + "\n".join(mine)
            + f"\n--- child output (tail) ---\n{out[-8000:]}"
        )


def ragged_lengths(gen: torch.Generator, n: int, max_len: int, *, with_one: bool = True) -> list[int]:
    """``n`` random lengths in ``1..max_len``; the first is forced to 1 when ``with_one`` (the edge case)."""
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen).tolist()
    if with_one:
        lengths[0] = 1
    return lengths


def cu_from(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    """``(B + 1,)`` int32 cumulative lengths."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
