"""CPU fast paths for the models' GEMMs: bfloat16 GEMMs native or widened, float32 through BLAS or oneDNN, weights
packed for oneDNN, and activations fused into the epilogue. Every choice is read from the ``CpuPlan`` handed in
(``lab.ops.plan``: one per engine, decided by probes on the running machine; ``None`` runs the defaults).

**bfloat16 GEMMs, native or widened, decided by a probe** (``lab.ops.probes``). oneDNN's native bfloat16 GEMMs
run well below the float32 rate on some AVX-512 CPUs without AMX and well above it on others (AVX512-BF16; measured:
evals/README.md, "Measurements behind the code's choices"). The product
of two bfloat16 numbers is exact in float32, so a float32 GEMM over the bfloat16 values, with the result rounded to
bfloat16, does the arithmetic of a bfloat16 GEMM (exact products, float32 accumulation): the "widened" path. Which
one runs is decided per engine by timing both at the model's shapes (the plan's ``bf16_gemm``); widened GEMMs read
one float32 copy of each weight, made once per dtype switch (kept by the plan, dropped when the weight's data
changes), never one per call. ``cpu_paths={"bf16_gemm": "widened"}`` or ``LAB_CPU_BF16_GEMM`` forces the choice. Native
GEMMs call oneDNN's linear op directly where torch has it for bfloat16 (``onednn_linear``, the bias added in the
kernel's epilogue) rather than ``F.linear``, whose ``addmm`` runs the same oneDNN kernel after writing the bias into
the output, a second pass over an output that at an engine step's size no longer fits in cache (faster there, alike at
a probe's size, so a probe could not tell them apart; measured: evals/README.md, "Measurements behind the code's
choices").

**float32 GEMMs through BLAS or oneDNN, decided by a probe.** torch's CPU ``F.linear`` runs float32 through its
BLAS (MKL on x86 builds); oneDNN's float32 matmul (``torch.ops.mkldnn._linear_pointwise`` with no epilogue)
computes the same products in another order. Which is faster depends on the CPU (oneDNN on an AMD EPYC with
AVX-512, MKL's BLAS on an Intel Xeon with AMX; measured: evals/README.md, "Measurements behind the code's choices").
The plan's ``f32_gemm`` (``blas`` / ``onednn``) comes from the probe; oneDNN is used only under no-grad (it has no
backward).

**Weights packed for oneDNN, decided by a probe.** oneDNN's matmul reorders its weight operand into a blocked
layout; handed a plain ``(out, in)`` weight it does so for blocks of it on every call. ``packed_weight`` reorders
each weight once (``torch.ops.mkldnn._reorder_linear_weight``, the op PyTorch's compiler uses to prepack CPU linear
weights) and the plan keeps it, per row block, until the parameter's data changes: oneDNN runs faster on packed
weights, most at few rows, float32 and bfloat16 (measured: evals/README.md, "Measurements behind the code's
choices"). Where a dtype's GEMMs go to oneDNN, the probe (``f32_weights`` / ``bf16_weights``: ``packed`` or
``plain``) decides; the packed copy costs one more copy of each projection weight.

**Fused activation.**

``torch.ops.mkldnn._linear_pointwise`` (the op PyTorch's own compiler emits for CPU linear + pointwise) runs the
activation inside the GEMM: no separate pass over the ``T x intermediate``
activations and one large buffer instead of two or three. Elsewhere (CUDA, other dtypes, a build without oneDNN)
the plain ops run; both paths compute the same function.

**Row blocks.** ``row_blocks`` runs an FFN (``down(inner(x))``) a block of tokens at a time, so the wide
intermediate activations of a block stay in cache between the GEMMs and the activation, and the down projection
writes straight into the output.

    >>> h = linear_act(x, w, b, "gelu", F.gelu, plan=plan)       # BERT FFN up-projection
    >>> proj = Linear(576, 1536, plan=plan)                      # nn.Linear with the plan's GEMM choices
    >>> out = row_blocks(x, down.weight, down.bias, 1024, lambda r: activation_inplace("gelu")(up(r)))
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lab.ops.plan import CpuPlan

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}  # transformers' ``hidden_act`` names the models accept


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; known: {', '.join(ACTIVATIONS)}")


def activation_inplace(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ACTIVATIONS[name]`` overwriting its input (a GEMM output nothing else reads); returns that input."""
    if ACTIVATIONS[name] is F.silu:
        return lambda x: F.silu(x, inplace=True)
    if ACTIVATIONS[name] is F.relu:
        return torch.relu_
    approximate = "none" if ACTIVATIONS[name] is F.gelu else "tanh"
    return lambda x: torch.ops.aten.gelu_(x, approximate=approximate)


def row_blocks(
    x: torch.Tensor,
    down_w: torch.Tensor,
    down_b: torch.Tensor | None,
    rows: int,
    inner: Callable[[torch.Tensor], torch.Tensor],
    *,
    plan: CpuPlan | None = None,
) -> torch.Tensor:
    """``linear(inner(x), down_w, down_b)`` for 2-D ``x``, ``rows`` tokens at a time, each block's result written
    into its rows of the output (module doc)."""
    if torch.compiler.is_compiling():  # the compiled forward: one graph, inductor tiles it
        return linear(inner(x), down_w, down_b, plan=plan)
    t = x.shape[0]
    out = x.new_empty(t, down_w.shape[0])
    for s in range(0, t, rows):
        linear(inner(x[s : s + rows]), down_w, down_b, plan=plan, out=out[s : s + rows])
    return out


def _has_linear_pointwise() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _has_onednn_bf16() -> bool:
    try:
        return _FUSED_CPU and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


_FUSED_CPU = _has_linear_pointwise()
_ONEDNN_BF16 = _has_onednn_bf16()  # oneDNN's linear op takes bfloat16 on this CPU
# tokens the packed layout is made for: oneDNN reorders for a GEMM of about this many rows (at 1 it keeps the plain
# layout); GEMMs of other row counts ran as fast on layouts made for other row counts (measured: evals/README.md,
# "Measurements behind the code's choices")
PACK_ROWS = 512


def onednn_cpu() -> bool:
    """Whether this torch build has oneDNN's CPU linear op (``torch.ops.mkldnn._linear_pointwise``)."""
    return _FUSED_CPU


def onednn_bf16() -> bool:
    """Whether that op takes bfloat16 on this CPU (then native bfloat16 GEMMs call it: ``linear``)."""
    return _ONEDNN_BF16


def onednn_packing() -> bool:
    """Whether this torch build can reorder a weight into oneDNN's blocked layout (``packed_weight``)."""
    return _FUSED_CPU and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` as oneDNN's matmul (float32, or bfloat16 where ``_ONEDNN_BF16``), the bias in its epilogue."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_gemms(dtype: torch.dtype, plan: CpuPlan | None) -> bool:
    """Whether ``linear`` sends CPU GEMMs of ``dtype`` to oneDNN under ``plan``: float32 where it chose ``onednn``,
    bfloat16 in ``native`` mode (the default) where oneDNN takes it."""
    if dtype == torch.float32:
        return plan is not None and plan.f32_gemm == "onednn"
    return dtype == torch.bfloat16 and (plan is None or plan.bf16_gemm == "native") and _ONEDNN_BF16


def _onednn(x: torch.Tensor, weight: torch.Tensor, plan: CpuPlan | None) -> bool:
    """Whether ``linear`` calls ``onednn_linear`` (``onednn_gemms``): CPU, matching contiguous weight, no autograd
    (the op has no backward)."""
    if torch.compiler.is_compiling():
        return False
    return (
        onednn_gemms(x.dtype, plan)
        and x.device.type == "cpu"
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
    )


def _widen(x: torch.Tensor, plan: CpuPlan | None) -> bool:
    if torch.compiler.is_compiling():
        return False
    return plan is not None and plan.bf16_gemm == "widened" and x.dtype == torch.bfloat16 and x.device.type == "cpu"


def wide_weight(w: torch.Tensor, plan: CpuPlan) -> torch.Tensor:
    """A float32 copy of bfloat16 weight ``w`` (a parameter or a view of one), one per base tensor, kept by
    ``plan`` (``CpuPlan.derived``): a view of ``w`` reads the same view of its base's copy."""
    base = w if w._base is None else w._base
    wide = plan.derived(base, "wide", None, lambda b: b.detach().float())
    if w is base:
        return wide
    return wide.as_strided(w.size(), w.stride(), w.storage_offset() - base.storage_offset())


def packed_weight(w: torch.Tensor, plan: CpuPlan) -> torch.Tensor:
    """``w`` (``(out, in)``, contiguous; a parameter or a row block of one) reordered once into oneDNN's blocked
    layout for its GEMMs at engine-step sizes (``PACK_ROWS``), kept by ``plan`` per base tensor and view."""
    return plan.derived(
        w,
        "packed",
        (w.storage_offset(), tuple(w.shape)),
        lambda v: torch.ops.mkldnn._reorder_linear_weight(v.detach(), PACK_ROWS),
    )


def gemm_weight(x: torch.Tensor, w: torch.Tensor, plan: CpuPlan | None) -> torch.Tensor:
    """The weight ``onednn_linear`` / ``linear_act`` hand oneDNN for input ``x``: ``packed_weight(w)`` where
    ``plan`` chose ``packed`` for ``x``'s dtype, else ``w``."""
    return packed_weight(w, plan) if plan is not None and plan.weights(x.dtype) == "packed" else w


def _f32(t: torch.Tensor | None, plan: CpuPlan) -> torch.Tensor | None:
    return None if t is None else wide_weight(t, plan)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    plan: CpuPlan | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear`` under ``plan`` (``None``: every default): CPU bfloat16 runs as a float32 GEMM over the bfloat16
    values when the plan chose ``widened`` and through ``onednn_linear`` when it chose ``native`` (where oneDNN takes
    bfloat16), CPU float32 through ``onednn_linear`` when it chose ``onednn``.
    ``out``: a contiguous ``(T, N)`` tensor (a row block of a larger one) to write into, for 2-D ``x``."""
    if _widen(x, plan):
        y = F.linear(x.float(), wide_weight(weight, plan), _f32(bias, plan))
        return y.to(torch.bfloat16) if out is None else out.copy_(y)
    if _onednn(x, weight, plan):
        y = onednn_linear(x, gemm_weight(x, weight, plan), bias)
        return y if out is None else out.copy_(y)
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``linear`` above, under its model's plan (``plan``; ``None``: the defaults)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, plan: CpuPlan | None = None):
        super().__init__(in_features, out_features, bias=bias)
        self.plan = plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, plan=self.plan)


_ONEDNN_ACT = {
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
    "silu": ("swish", ""),
    "swish": ("swish", ""),
}


def fusable(x: torch.Tensor, act_name: str, plan: CpuPlan | None = None) -> bool:
    """Whether the oneDNN fused path applies to ``x`` and this activation under ``plan``: CPU float32, or bfloat16
    where oneDNN's linear takes it on this CPU (``onednn_bf16``) or the plan widens it to float32 (on a CPU without
    AVX-512 oneDNN has no bfloat16 linear)."""
    if not (_FUSED_CPU and x.device.type == "cpu" and act_name in _ONEDNN_ACT) or torch.compiler.is_compiling():
        return False
    return x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and (_ONEDNN_BF16 or _widen(x, plan)))


def linear_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    act_name: str,
    act,
    *,
    plan: CpuPlan | None = None,
) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` under ``plan``; on CPU one oneDNN call with the activation in the GEMM's
    epilogue."""
    if fusable(x, act_name, plan):
        kind, algorithm = _ONEDNN_ACT[act_name]
        if _widen(x, plan):  # activation on the float32 accumulator, rounded once (as oneDNN's bfloat16 epilogue)
            out = torch.ops.mkldnn._linear_pointwise(
                x.float(), wide_weight(weight, plan), _f32(bias, plan), kind, [], algorithm
            )
            return out.to(torch.bfloat16)
        w = gemm_weight(x, weight, plan) if weight.is_contiguous() and not torch.is_grad_enabled() else weight
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, kind, [], algorithm)
    return act(linear(x, weight, bias, plan=plan))
