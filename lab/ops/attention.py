"""Kernel dispatch: Triton on CUDA, the torch references elsewhere, with an override (``attention_backend``).

Model code calls ``attention(q, k, v, meta, layer)`` and ``ops(meta)`` for fused norms / rotary; which
implementation runs is decided here from ``meta.backend`` (resolved once by the engine from its knob).

    >>> out = attention(q, k, v, meta, layer=0)     # q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D)
    >>> h = ops(meta).add_layer_norm(x, residual, w, b, eps)
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from lab.kernels import cpu_attention, reference
from lab.ops.batch import AttnMeta

BACKENDS = ("auto", "torch", "triton")
# Scores per group of sequences on the torch kernels' matmul path (``attention(..., kernel="matmul")``); a sequence
# with more (``Hq * L * L``: past 295 tokens for 12 heads) takes the fused kernel. 2 MiB in bfloat16. The fastest of
# 2^18 to 2^21, or close to it, at every length; 2^21 ran slower (measured: evals/README.md, "Measurements behind the
# code's choices").
MATMUL_SCORES = 1 << 20
# the torch backend's CPU attention kernels (``attention(..., kernel=)``, a probe's choice): torch's fused kernel,
# scores / softmax / weighted sum as three ops, prefill-lab's own compiled kernel (``lab.kernels.cpu_attention``),
# the two products as batched GEMMs over head-major copies (``bmm_attention``)
KERNELS = ("sdpa", "matmul", "lab", "bmm")
# Scores per group of sequences on the ``bmm`` kernel's path (``bmm_attention``), as ``MATMUL_SCORES``: a group's
# scores and weights (2 MiB each in bfloat16) stay in L2; whole runs of equal lengths as one group each ran far slower
# (measured: evals/README.md, "Measurements behind the code's choices").
BMM_SCORES = 1 << 20


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` on CUDA (when triton imports), else ``torch``; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention_backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the `triton` package; pip install triton")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' on CPU runs only in Triton's interpreter: set TRITON_INTERPRET=1 "
                "before importing torch/triton (slow, for debugging), or use attention_backend='torch'"
            )
    return backend


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_TORCH_OPS = SimpleNamespace(
    varlen_attention=reference.varlen_attention,
    add_layer_norm=reference.add_layer_norm,
    add_rms_norm=reference.add_rms_norm,
    apply_rotary=reference.apply_rotary,
    segment_pool=reference.segment_pool,
)
_TRITON_OPS: SimpleNamespace | None = None


def ops(meta_or_backend: AttnMeta | str) -> SimpleNamespace:
    """The kernel set for a backend name (or the backend an ``AttnMeta`` carries)."""
    global _TRITON_OPS
    backend = meta_or_backend if isinstance(meta_or_backend, str) else meta_or_backend.backend
    if backend != "triton":
        return _TORCH_OPS
    if _TRITON_OPS is None:
        from lab.kernels import attention as ka
        from lab.kernels import norms as kn
        from lab.kernels import pooling as kp
        from lab.kernels import rotary as kr

        _TRITON_OPS = SimpleNamespace(
            varlen_attention=ka.varlen_attention,
            add_layer_norm=kn.add_layer_norm,
            add_rms_norm=kn.add_rms_norm,
            apply_rotary=kr.apply_rotary,
            segment_pool=kp.segment_pool,
        )
    return _TRITON_OPS


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttnMeta,
    layer: int,
    *,
    causal_block: int | None = None,
    kernel: str = "sdpa",
) -> torch.Tensor:
    """Varlen attention for one layer of one packed step, reading and capturing cached K/V through ``meta.kv``.

    q ``(T, Hq, D)``, k/v ``(T, Hkv, D)`` -> ``(T, Hq, D)``. The torch kernels' options, both a CPU probe's choice
    and ignored by Triton: ``causal_block``, query blocks for long causal sequences; ``kernel`` (``KERNELS``) for
    steps without a cached prefix: ``sdpa``, torch's fused kernel; ``matmul``, scores, softmax and weighted sum in
    groups of ``MATMUL_SCORES`` scores (``lab.kernels.reference.varlen_attention``); ``lab``, prefill-lab's own CPU
    kernel (``lab.kernels.cpu_attention``; inputs it does not take, or a machine where it did not build, run
    ``sdpa``); ``bmm``, the two products as batched GEMMs over head-major copies, in groups of ``BMM_SCORES`` scores
    (``bmm_attention``).
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; valid: {', '.join(KERNELS)}")
    if torch.compiler.is_compiling():  # inside the compiled forward (``lab.runtime.compiled``): one opaque op
        return torch.ops.lab.varlen_attention(q, k, v, meta.cu_seqlens, meta.causal, kernel, causal_block or 0)
    return _attention(q, k, v, meta, layer, causal_block, kernel)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttnMeta,
    layer: int,
    causal_block: int | None,
    kernel: str,
) -> torch.Tensor:
    """``attention``'s eager kernels (what the registered op runs, whatever another thread is tracing: dynamo's
    ``is_compiling`` flag is one per process)."""
    if meta.key_lens is not None:
        return visible_keys_attention(q, k, v, meta)
    kw = {}
    kv = meta.kv
    if kv is not None:
        if kv.capture is not None:
            kv.capture(layer, k, v)
        if kv.has_prefix:
            kw = {
                "k_prefix": kv.prefix_k[layer],
                "v_prefix": kv.prefix_v[layer],
                "cu_prefix": kv.cu_prefix,
                "prefix_lens": kv.prefix_lens,
            }
    k_ops = ops(meta)
    if k_ops is _TORCH_OPS:
        if kernel == "lab" and not kw and cpu_attention.supports(q, k) and cpu_attention.available():
            return cpu_attention.varlen_attention(q, k, v, meta.cu_seqlens, meta.causal)
        if kernel == "bmm" and not kw:
            return bmm_attention(q, k, v, meta.seqlens, meta.causal, causal_block=causal_block)
        if causal_block:
            kw["causal_block"] = causal_block
        if kernel == "matmul":
            kw["matmul_scores"] = MATMUL_SCORES
    return k_ops.varlen_attention(
        q, k, v, meta.cu_seqlens, meta.max_seqlen, causal=meta.causal, seqlens=meta.seqlens, **kw
    )


@torch.library.custom_op("lab::varlen_attention", mutates_args=())
def compiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    kernel: str,
    causal_block: int,
) -> torch.Tensor:
    """``attention`` as one registered op (``torch.ops.lab.varlen_attention``), what the compiled forward
    (``lab.runtime.compiled``) calls: the graph stays whole across it, and at run time it reads the step's lengths
    from ``cu_seqlens`` (one host copy) and runs the kernel the plan chose, eagerly. Plain prefill steps only (no
    cached keys/values, every key visible): the compiled forward takes no other."""
    seqlens = torch.diff(cu_seqlens).tolist()
    meta = AttnMeta(cu_seqlens, max(seqlens, default=0), causal, seqlens)
    return _attention(q, k, v, meta, 0, causal_block or None, kernel).contiguous()


@compiled_attention.register_fake
def _(q, k, v, cu_seqlens, causal, kernel, causal_block):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def bmm_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: list[int],
    causal: bool,
    *,
    scale: float | None = None,
    max_scores: int = BMM_SCORES,
    causal_block: int | None = None,
) -> torch.Tensor:
    """Varlen attention as two batched GEMMs per group of equal-length sequences (the ``bmm`` kernel): q ``(T, Hq,
    D)``, k/v ``(T, Hkv, D)``, ``seqlens`` the packed sequences' lengths, no cached prefix -> ``(T, Hq, D)``.

    Consecutive sequences of one length form a run (the length-sorted scheduler makes them); a run is cut into groups
    of at most ``max_scores`` scores (at least one sequence). A group's queries, keys and values are copied once
    into head-major ``(n * Hkv, ., D)`` tensors, the ``Hq / Hkv`` query heads sharing a key/value head stacked along
    the query axis (no copy of the keys per query head). Then ``torch.baddbmm`` computes ``scale * Q K^T`` (plus the
    causal mask as an additive ``-inf`` bias), ``torch.softmax`` the weights and ``torch.bmm`` their sum of the
    values: on CPU, oneDNN's batched GEMMs, in bfloat16 its native kernels (AVX512-BF16 or AMX where the CPU has
    them; exact products, float32 accumulation), and the softmax's arithmetic in float32 (torch's CPU softmax widens
    bfloat16). The group's output is copied into the packed ``(T, Hq, D)`` result. In bfloat16 the scores are
    rounded to bfloat16 once (the scale applied to the float32 sums) and so are the weights, as torch's fused kernel
    rounds them before its second product; so, like ``matmul``, an encoder's path only
    (``lab.ops.probes.attention_probe``).

    A sequence with more scores than ``max_scores`` (``Hq * L * L``) takes ``lab.kernels.reference.varlen_attention``
    (torch's fused kernel, or its query blocks of ``causal_block`` for a long causal sequence): its memory does not
    grow with the square of the length."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if sum(seqlens) != t:
        raise ValueError(f"seqlens add up to {sum(seqlens)} tokens, but q holds {t}")
    rep, scale = hq // hkv, d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    s, i = 0, 0
    while i < len(seqlens):
        length, j = seqlens[i], i + 1
        while j < len(seqlens) and seqlens[j] == length:
            j += 1
        e = s + (j - i) * length
        if length and hq * length * length > max_scores:
            n = j - i
            cu = torch.arange(0, (n + 1) * length, length, dtype=torch.int32)
            out[s:e] = reference.varlen_attention(
                q[s:e],
                k[s:e],
                v[s:e],
                cu,
                length,
                causal=causal,
                scale=scale,
                seqlens=[length] * n,
                causal_block=causal_block,
            )
        elif length:
            bias = None
            if causal:  # (rep * L, L): query row r of a stacked head is position r % L
                bias = torch.full((length, length), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
                bias = bias.repeat(rep, 1)
            group = max(1, max_scores // (hq * length * length))
            for gs in range(s, e, group * length):
                ge = min(e, gs + group * length)
                _bmm_group(q[gs:ge], k[gs:ge], v[gs:ge], out[gs:ge], length, rep, scale, bias)
        s, i = e, j
    return out


def _bmm_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    length: int,
    rep: int,
    scale: float,
    bias: torch.Tensor | None,
) -> None:
    """``bmm_attention`` on ``n`` packed sequences of ``length`` tokens (q ``(n * L, Hq, D)``, k/v ``(n * L, Hkv,
    D)``), written into ``out`` (like q)."""
    n, hkv, d = q.shape[0] // length, k.shape[1], q.shape[2]
    qh = q.view(n, length, hkv, rep, d).permute(0, 2, 3, 1, 4).reshape(n * hkv, rep * length, d)
    kh, vh = (x.view(n, length, hkv, d).transpose(1, 2).reshape(n * hkv, length, d) for x in (k, v))
    if bias is None:
        scores = torch.baddbmm(
            qh.new_empty(n * hkv, rep * length, length), qh, kh.transpose(1, 2), beta=0, alpha=scale
        )
    else:
        scores = torch.baddbmm(bias, qh, kh.transpose(1, 2), alpha=scale)
    o = torch.bmm(torch.softmax(scores, dim=-1), vh)  # (n * Hkv, rep * L, D)
    out.view(n, length, hkv, rep, d).copy_(o.view(n, hkv, rep, length, d).permute(0, 3, 1, 2, 4))


def visible_keys_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """Bidirectional attention where every token of sequence ``i`` attends to its first ``meta.key_lens[i]`` tokens
    only (ColBERT's query expansion: ``[MASK]`` tokens read the query, nobody reads them). Torch on every backend:
    sequences of one (length, visible keys) shape are stacked into one ``scaled_dot_product_attention`` call.

    q ``(T, Hq, D)``, k/v ``(T, Hkv, D)`` -> ``(T, Hq, D)``; no cached prefix, no causal mask."""
    if meta.causal or (meta.kv is not None and meta.kv.has_prefix):
        raise ValueError("attention over a leading part of each sequence is bidirectional and prefix-free only")
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    starts = meta.cu_seqlens[:-1].tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (n, kl) in enumerate(zip(meta.seqlens, meta.key_lens)):
        if n:
            groups.setdefault((n, max(1, min(kl, n))), []).append(starts[i])
    for (n, kl), firsts in groups.items():
        rows = (torch.tensor(firsts, device=q.device)[:, None] + torch.arange(n, device=q.device)).reshape(-1)
        qg = q[rows].view(len(firsts), n, hq, -1).transpose(1, 2)  # (G, Hq, n, D)
        kg, vg = (x[rows].view(len(firsts), n, hkv, -1)[:, :kl].transpose(1, 2) for x in (k, v))
        if hq != hkv:
            kg, vg = kg.repeat_interleave(hq // hkv, dim=1), vg.repeat_interleave(hq // hkv, dim=1)
        og = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg)
        out[rows] = og.transpose(1, 2).reshape(len(firsts) * n, hq, -1)
    return out
