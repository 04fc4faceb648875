"""The one table of tolerances for comparing each Triton kernel of ``lab.kernels`` with its torch reference.

Read by the kernel tests (``tests/test_kernels_*.py``) and by ``evals/gpu_check.py``: change a value here, nowhere
else. Imports only torch (no triton, nothing from ``lab``). Keys are the kernels' function names (also the
``kernel`` column of gpu_check's CSV) and the dtype under test; each entry is ``(atol, rtol)``, read one of two ways:

- **direct**: ``torch.testing.assert_close(kernel_out, reference_out, **tolerance(kernel, dtype))``, i.e.
  ``|got - want| <= atol + rtol * |want|`` elementwise. Every kernel in float32, and ``segment_pool`` in every input
  dtype (kernel and reference both accumulate in float32 and return float32).
- **low precision** (float16 / bfloat16 ``varlen_attention``, norms, ``apply_rotary``, whose outputs are rounded to
  that dtype): against the float32 oracle, the kernel's max abs error may be at most ``TORCH_ERROR_FACTOR`` times
  the torch reference's own error in the same dtype, plus ``atol`` as a floor (``rtol`` is 0); see
  :func:`error_bound`.

    >>> torch.testing.assert_close(got, want, **tolerance("apply_rotary", torch.float32))
    >>> assert max_abs_err(got, exact) <= error_bound("add_rms_norm", torch.float16, torch_err)
"""

from __future__ import annotations

import torch

TORCH_ERROR_FACTOR = 2.0  # low precision: the kernel may be off by twice torch's own error (plus the atol floor)

# the atol floor of the low-precision rule (kernels whose outputs are rounded to float16 / bfloat16)
_LOW_PRECISION_FLOOR = {torch.float16: (1e-3, 0.0), torch.bfloat16: (8e-3, 0.0)}
_ELEMENTWISE = {torch.float32: (1e-5, 1e-5), **_LOW_PRECISION_FLOOR}  # norms and rotary

# kernel -> dtype -> (atol, rtol)
TOLERANCES: dict[str, dict[torch.dtype, tuple[float, float]]] = {
    # against the float32 oracle reference.varlen_attention_naive
    "varlen_attention": {torch.float32: (1e-4, 0.0), **_LOW_PRECISION_FLOOR},
    "add_layer_norm": _ELEMENTWISE,
    "add_rms_norm": _ELEMENTWISE,
    "apply_rotary": _ELEMENTWISE,
    "segment_pool": {  # keyed by the dtype of `hidden`; the output is float32 for every input dtype
        torch.float32: (1e-5, 1e-5),
        torch.float16: (1e-4, 0.0),
        torch.bfloat16: (1e-4, 0.0),
    },
}

_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _entry(kernel: str, dtype: torch.dtype | str) -> tuple[float, float]:
    if kernel not in TOLERANCES:
        raise KeyError(f"no tolerances for kernel {kernel!r}; valid kernels: {', '.join(TOLERANCES)}")
    key = _DTYPE_NAMES.get(dtype.removeprefix("torch."), dtype) if isinstance(dtype, str) else dtype
    table = TOLERANCES[kernel]
    if key not in table:
        valid = ", ".join(str(d).removeprefix("torch.") for d in table)
        raise KeyError(f"no tolerances for {kernel!r} in dtype {dtype!r}; valid dtypes: {valid}")
    return table[key]


def tolerance(kernel: str, dtype: torch.dtype | str) -> dict[str, float]:
    """``{"atol": ..., "rtol": ...}`` for ``kernel`` (e.g. ``"segment_pool"``) in ``dtype`` (``torch.float16`` or
    ``"float16"``), ready for ``torch.testing.assert_close``; KeyError naming the valid keys otherwise."""
    atol, rtol = _entry(kernel, dtype)
    return {"atol": atol, "rtol": rtol}


def error_bound(kernel: str, dtype: torch.dtype | str, torch_err: float | None = None, *, scale: float = 0.0) -> float:
    """The largest max-abs error allowed, as one number.

    With ``torch_err`` (the torch reference's max abs error against the float32 oracle in ``dtype``): the low
    precision rule, ``TORCH_ERROR_FACTOR * torch_err + atol``. Without it: a direct comparison reduced to a scalar,
    ``atol + rtol * scale`` where ``scale`` is the largest ``|reference|`` (a little looser than the elementwise
    ``assert_close``, never stricter).
    """
    atol, rtol = _entry(kernel, dtype)
    bound = atol + rtol * scale
    return bound if torch_err is None else TORCH_ERROR_FACTOR * torch_err + bound
