"""What every Triton launcher in ``lab.kernels`` checks first: whether a tensor may be handed to a kernel.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, i.e. when a kernel module is imported
(which imports this one); ``INTERPRET`` is snapshot at that moment so the launchers agree with how the kernels were
built: CUDA tensors always, CPU tensors only under the interpreter.
"""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``t`` when it is on a device the kernels cannot run on here."""
    if not (t.is_cuda or INTERPRET):
        raise ValueError(
            f"{name} is on {t.device}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before triton "
            "is imported); use lab.kernels.reference on CPU"
        )
