"""CPU fast paths for the models' GEMMs: bfloat16 GEMMs native or widened, and activations fused into the epilogue.

**bfloat16 GEMMs, native or widened, decided by a probe** (``lab.ops.probes``). oneDNN's native bfloat16 GEMMs
run at ~0.25-0.65x the float32 rate on some AVX-512 CPUs without AMX and at ~3x on others (AVX512-BF16). The product
of two bfloat16 numbers is exact in float32, so a float32 GEMM over the bfloat16 values, with the result rounded to
bfloat16, does the arithmetic of a bfloat16 GEMM (exact products, float32 accumulation): the "widened" path. Which
one runs is decided per process by timing both at the model's shapes (``set_bf16_gemm``); widened GEMMs read one
float32 copy of each weight, made once per dtype switch (kept on the parameter, dropped when its data changes),
never one per call. ``LAB_CPU_BF16_GEMM=native`` / ``widened`` forces the choice. Native GEMMs call oneDNN's linear
op directly where torch has it for bfloat16 (``onednn_linear``, the bias added in the kernel's epilogue) rather than
``F.linear``, whose ``addmm`` runs the same oneDNN kernel after writing the bias into the output, a second pass over
an output that at an engine step's size no longer fits in cache (one AMD EPYC with AVX512-BF16, one thread, 8192
tokens, 384 -> 1152: 476 against 409 GFLOP/s; alike at 512 tokens, so a probe could not tell them apart).

**float32 GEMMs through BLAS or oneDNN, decided by a probe.** torch's CPU ``F.linear`` runs float32 through its
BLAS (MKL on x86 builds); oneDNN's float32 matmul (``torch.ops.mkldnn._linear_pointwise`` with no epilogue)
computes the same products in another order. On one 2-core AMD EPYC (AVX-512) it ran 1.1-1.4x faster at
SmolLM2's and MiniLM's shapes, one thread; elsewhere BLAS may win. ``set_f32_gemm`` (``blas`` / ``onednn``) is set
from the probe (``LAB_CPU_F32_GEMM`` forces it); oneDNN is used only under no-grad (it has no backward).

**Weights packed for oneDNN, decided by a probe.** oneDNN's matmul reorders its weight operand into a blocked
layout; handed a plain ``(out, in)`` weight it does so for blocks of it on every call. ``packed_weight`` reorders
each weight once (``torch.ops.mkldnn._reorder_linear_weight``, the op PyTorch's compiler uses to prepack CPU linear
weights) and keeps it on the parameter, per row block, until the parameter's data changes. On one AMD EPYC, one
thread, oneDNN ran 1.03-1.07x faster on packed weights at 128-1,024 rows and 1.5-1.8x at 7 rows, float32 and
bfloat16. Where a dtype's GEMMs go to oneDNN, the probe (``f32_weights`` / ``bf16_weights``: ``packed`` or
``plain``) decides; the packed copy costs one more copy of each projection weight.

**Fused activation.**

``torch.ops.mkldnn._linear_pointwise`` (the op PyTorch's own compiler emits for CPU linear + pointwise) runs the
activation inside the GEMM: no separate pass over the ``T x intermediate``
activations and one large buffer instead of two or three. Elsewhere (CUDA, other dtypes, a build without oneDNN)
the plain ops run; both paths compute the same function.

**Row blocks.** ``row_blocks`` runs an FFN (``down(inner(x))``) a block of tokens at a time, so the wide
intermediate activations of a block stay in cache between the GEMMs and the activation, and the down projection
writes straight into the output.

    >>> h = linear_act(x, w, b, "gelu", F.gelu)                  # BERT FFN up-projection
    >>> proj = Linear(576, 1536)                                 # nn.Linear with the bfloat16 rule above
    >>> out = row_blocks(x, down.weight, down.bias, 1024, lambda r: activation_inplace("gelu")(up(r)))
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

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


def row_blocks(x: torch.Tensor, down_w: torch.Tensor, down_b: torch.Tensor | None, rows: int,
               inner: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``linear(inner(x), down_w, down_b)`` for 2-D ``x``, ``rows`` tokens at a time, each block's result written
    into its rows of the output (module doc)."""
    t = x.shape[0]
    out = x.new_empty(t, down_w.shape[0])
    for s in range(0, t, rows):
        linear(inner(x[s : s + rows]), down_w, down_b, out=out[s : s + rows])
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
BF16_GEMM_MODES = ("native", "widened")
_BF16 = {"mode": "native"}  # process-wide, set from the probe (lab.runtime.runner) or LAB_CPU_BF16_GEMM
F32_GEMM_MODES = ("blas", "onednn")
_F32 = {"mode": "blas"}  # process-wide, set from the probe (lab.runtime.runner) or LAB_CPU_F32_GEMM
_DERIVED_LOCK = threading.Lock()
WEIGHT_LAYOUTS = ("packed", "plain")
# per dtype, set from the probes ``f32_weights`` / ``bf16_weights`` (lab.runtime.runner) or LAB_CPU_F32_WEIGHTS / ..._BF16_...
_PACK: dict[torch.dtype, str] = {torch.float32: "plain", torch.bfloat16: "plain"}
# tokens the packed layout is made for: oneDNN reorders for a GEMM of about this many rows (at 1 it keeps the plain
# layout); one AMD EPYC ran 7- to 1,024-row GEMMs alike with layouts made for 512 or 4,096 rows
PACK_ROWS = 512


def set_bf16_gemm(mode: str) -> None:
    """Run CPU bfloat16 GEMMs ``native`` (oneDNN's bfloat16 kernels) or ``widened`` (float32 GEMMs over the
    bfloat16 values)."""
    if mode not in BF16_GEMM_MODES:
        raise ValueError(f"bfloat16 GEMM mode {mode!r}; valid: {', '.join(BF16_GEMM_MODES)}")
    _BF16["mode"] = mode


def bf16_gemm() -> str:
    return _BF16["mode"]


def onednn_cpu() -> bool:
    """Whether this torch build has oneDNN's CPU linear op (``torch.ops.mkldnn._linear_pointwise``)."""
    return _FUSED_CPU


def onednn_bf16() -> bool:
    """Whether that op takes bfloat16 on this CPU (then native bfloat16 GEMMs call it: ``linear``)."""
    return _ONEDNN_BF16


def set_f32_gemm(mode: str) -> None:
    """Run CPU float32 GEMMs through torch's BLAS (``blas``, ``F.linear``) or oneDNN (``onednn``)."""
    if mode not in F32_GEMM_MODES:
        raise ValueError(f"float32 GEMM mode {mode!r}; valid: {', '.join(F32_GEMM_MODES)}")
    if mode == "onednn" and not _FUSED_CPU:
        raise ValueError("float32 GEMM mode 'onednn' needs a torch build with oneDNN (torch.backends.mkldnn)")
    _F32["mode"] = mode


def f32_gemm() -> str:
    return _F32["mode"]


def onednn_packing() -> bool:
    """Whether this torch build can reorder a weight into oneDNN's blocked layout (``packed_weight``)."""
    return _FUSED_CPU and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _set_weights(dtype: torch.dtype, mode: str) -> None:
    if mode not in WEIGHT_LAYOUTS:
        raise ValueError(f"GEMM weight layout {mode!r}; valid: {', '.join(WEIGHT_LAYOUTS)}")
    if mode == "packed" and not onednn_packing():
        raise ValueError("GEMM weight layout 'packed' needs torch.ops.mkldnn._reorder_linear_weight (oneDNN)")
    _PACK[dtype] = mode


def set_f32_weights(mode: str) -> None:
    """Hand oneDNN's float32 GEMMs each weight reordered once into its blocked layout (``packed``) or as stored
    (``plain``, oneDNN then reorders blocks of it on every call)."""
    _set_weights(torch.float32, mode)


def set_bf16_weights(mode: str) -> None:
    """``set_f32_weights`` for native bfloat16 GEMMs."""
    _set_weights(torch.bfloat16, mode)


def gemm_weights(dtype: torch.dtype) -> str:
    return _PACK.get(dtype, "plain")


# probe decisions that set a process-wide GEMM mode: decision name -> its setter (``lab.runtime.runner`` applies them)
GEMM_SETTERS = {"bf16_gemm": set_bf16_gemm, "f32_gemm": set_f32_gemm, "f32_weights": set_f32_weights,
                "bf16_weights": set_bf16_weights}


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` as oneDNN's matmul (float32, or bfloat16 where ``_ONEDNN_BF16``), the bias in its epilogue."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_gemms(dtype: torch.dtype) -> bool:
    """Whether ``linear`` sends CPU GEMMs of ``dtype`` to oneDNN: float32 where the probe chose ``onednn``,
    bfloat16 in native mode where oneDNN takes it."""
    if dtype == torch.float32:
        return _F32["mode"] == "onednn"
    return dtype == torch.bfloat16 and _BF16["mode"] == "native" and _ONEDNN_BF16


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` calls ``onednn_linear`` (``onednn_gemms``): CPU, matching contiguous weight, no autograd
    (the op has no backward)."""
    return (onednn_gemms(x.dtype) and x.device.type == "cpu" and weight.dtype == x.dtype and weight.is_contiguous()
            and not torch.is_grad_enabled())


def _widen(x: torch.Tensor) -> bool:
    return _BF16["mode"] == "widened" and x.dtype == torch.bfloat16 and x.device.type == "cpu"


def _version(t: torch.Tensor) -> int:
    """``t._version``; an inference tensor (made under ``torch.inference_mode``) has none: -1."""
    return -1 if t.is_inference() else t._version


def _derived(w: torch.Tensor, name: str, key, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(w)`` for weight ``w`` (a parameter, or a view of one such as a row block), made once and kept on ``w``'s
    base tensor under ``name`` and ``key`` until the base's data changes (a dtype switch or an adapter merge replaces
    ``.data``; an in-place change bumps its version), when every entry under ``name`` is dropped and remade."""
    base = w if w._base is None else w._base
    entry = getattr(base, name, None)
    if not _current(entry, base) or key not in entry[2]:
        with _DERIVED_LOCK:  # CPU workers may ask at once; one copy
            entry = getattr(base, name, None)
            if not _current(entry, base):
                # ``held`` keeps the source's memory alive, so its address cannot be reused by another weight
                entry = (base.detach(), _version(base), {})
            if key not in entry[2]:
                entry[2][key] = make(w)
            setattr(base, name, entry)
    return entry[2][key]


def _current(entry: tuple | None, base: torch.Tensor) -> bool:
    """Whether ``_derived``'s ``entry`` (held source, its version, copies) was made from ``base``'s present data."""
    return entry is not None and entry[0].data_ptr() == base.data_ptr() and entry[1] == _version(base)


DERIVED = ("_lab_wide", "_lab_packed")  # the attributes ``_derived`` keeps copies under


def drop_derived(t: torch.Tensor) -> None:
    """Forget the copies derived from ``t`` (``wide_weight``, ``packed_weight``): its data was just replaced, so
    they are stale, and their memory is freed now rather than at the next call that would have remade them (a
    ``widened`` bfloat16 run never asks for the float32 packed copies)."""
    for name in DERIVED:
        t.__dict__.pop(name, None)


def wide_weight(w: torch.Tensor) -> torch.Tensor:
    """A float32 copy of bfloat16 weight ``w`` (a parameter or a view of one), one per base tensor (``_derived``):
    a view of ``w`` reads the same view of its base's copy."""
    base = w if w._base is None else w._base
    wide = _derived(base, "_lab_wide", None, lambda b: b.detach().float())
    if w is base:
        return wide
    return wide.as_strided(w.size(), w.stride(), w.storage_offset() - base.storage_offset())


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` (``(out, in)``, contiguous; a parameter or a row block of one) reordered once into oneDNN's blocked
    layout for its GEMMs at engine-step sizes (``PACK_ROWS``), kept per base tensor and view (``_derived``)."""
    return _derived(w, "_lab_packed", (w.storage_offset(), tuple(w.shape)),
                    lambda v: torch.ops.mkldnn._reorder_linear_weight(v.detach(), PACK_ROWS))


def gemm_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The weight ``onednn_linear`` / ``linear_act`` hand oneDNN for input ``x``: ``packed_weight(w)`` where the
    probe chose ``packed`` for ``x``'s dtype, else ``w``."""
    return packed_weight(w) if gemm_weights(x.dtype) == "packed" else w


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else wide_weight(t)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; CPU bfloat16 runs as a float32 GEMM over the bfloat16 values when the probe chose ``widened``
    and through ``onednn_linear`` when it chose ``native`` (where oneDNN takes bfloat16), CPU float32 through
    ``onednn_linear`` when its probe chose ``onednn``.
    ``out``: a contiguous ``(T, N)`` tensor (a row block of a larger one) to write into, for 2-D ``x``."""
    if _widen(x):
        y = F.linear(x.float(), wide_weight(weight), _f32(bias))
        return y.to(torch.bfloat16) if out is None else out.copy_(y)
    if _onednn(x, weight):
        y = onednn_linear(x, gemm_weight(x, weight), bias)
        return y if out is None else out.copy_(y)
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``linear`` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
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
        if _widen(x):  # activation on the float32 accumulator, rounded once (as oneDNN's bfloat16 epilogue does)
            out = torch.ops.mkldnn._linear_pointwise(x.float(), wide_weight(weight), _f32(bias), kind, [],
                                                     algorithm)
            return out.to(torch.bfloat16)
        w = gemm_weight(x, weight) if weight.is_contiguous() and not torch.is_grad_enabled() else weight
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, kind, [], algorithm)
    return act(linear(x, weight, bias))
