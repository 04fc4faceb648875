"""CPU fast paths for the FFN: activations fused into the GEMM epilogue through oneDNN.

``torch.ops.mkldnn._linear_pointwise`` (the op PyTorch's own compiler emits for CPU linear + pointwise) runs the
activation, or a multiply with another tensor, inside the GEMM: no separate pass over the ``T x intermediate``
activations and one large buffer instead of two or three. Elsewhere (CUDA, other dtypes, a build without oneDNN)
the plain ops run; both paths compute the same function.

    >>> h = linear_act(x, w, b, "gelu", F.gelu)                  # BERT FFN up-projection
    >>> h = gated_mlp(x, w_gate, w_up, "silu", F.silu)           # Llama-style silu(x Wg) * (x Wu)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _has_linear_pointwise() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_FUSED_CPU = _has_linear_pointwise()
_ONEDNN_ACT = {"gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"), "gelu_pytorch_tanh": ("gelu", "tanh"),
               "relu": ("relu", ""), "silu": ("swish", ""), "swish": ("swish", "")}


def fusable(x: torch.Tensor, act_name: str) -> bool:
    """Whether the oneDNN fused path applies to ``x`` (CPU, float32/bfloat16) and this activation."""
    return _FUSED_CPU and x.device.type == "cpu" and act_name in _ONEDNN_ACT and x.dtype in (torch.float32,
                                                                                           torch.bfloat16)


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act_name: str, act) -> torch.Tensor:
    """``act(x @ weight.T + bias)``; on CPU one oneDNN call with the activation in the GEMM's epilogue."""
    if fusable(x, act_name):
        kind, algorithm = _ONEDNN_ACT[act_name]
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, kind, [], algorithm)
    return act(F.linear(x, weight, bias))


def gated_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act_name: str, act,
              b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x Wg^T + bg) * (x Wu^T + bu)``; on CPU two oneDNN GEMMs, the second multiplying in its epilogue."""
    if fusable(x, act_name):
        gate = linear_act(x, w_gate, b_gate, act_name, act)
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, w_up, b_up, "mul")
    return act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)
