"""Rotary position embedding frequencies from a Hugging Face ``config.json`` dict.

Reads both spellings of the RoPE settings — transformers 5 ``rope_parameters`` (with ``rope_theta`` inside) and
transformers 4 ``rope_scaling`` next to a top-level ``rope_theta`` — and returns the per-pair inverse frequencies
plus the factor cos/sin are multiplied by. The formulas follow the papers and Meta's / Qwen's releases (default,
linear position interpolation, Llama 3.1 smoothed bands, YaRN); they are checked against transformers' rotary
embedding in ``tests/test_models_decoder.py``.

    >>> rope = rope_from_config(config)                     # RopeSpec(inv_freq (D/2,) float32, attention_scaling)
    >>> cos, sin = rotary_cos_sin(positions, rope.inv_freq, rope.attention_scaling)

Two head layouts rotate the same pairs of features. transformers' (``halves``) pairs feature ``i`` of a query / key
head with feature ``i + D/2``; ``pairs`` stores the two side by side (``pairs_order``: ``0, D/2, 1, D/2 + 1, ...``)
so one head is ``D/2`` complex numbers and the rotation is one complex multiply in place (``rotate_pairs_``). A
model that permutes its query and key projection rows that way computes the same attention: a dot product does
not depend on the order of its terms, as long as queries and keys share it.

    >>> rope = RopeTables.at(positions, rope.inv_freq, rope.attention_scaling, "pairs", dtype)   # .cis (T, D/2)
    >>> rotate_pairs_(q, rope.cis)                                                             # q (T, H, D), in place
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lab.kernels.reference import apply_rotary, rotary_cos_sin

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass
class RopeSpec:
    """Inverse frequencies ``(D/2,)`` float32 on CPU, the cos/sin scale, and the context the frequencies are exact for.

    ``max_context`` is set for ``dynamic`` (NTK) scaling: transformers recomputes its frequencies once a batch runs
    past ``max_position_embeddings``, which depends on the batch; up to there they equal the default ones.
    """

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    rope_type: str = "default"
    max_context: int | None = None


def rope_parameters(config: dict) -> dict:
    """The RoPE settings as one flat dict with ``rope_type`` and ``rope_theta`` (either config spelling)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported by the Llama-family decoder")
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "partial_rotary_factor" not in params and config.get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = config["partial_rotary_factor"]
    if params["rope_type"] in ("llama3", "yarn"):
        # transformers gives a top-level original_max_position_embeddings priority (Phi-3 style configs)
        if config.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return params


def rope_from_config(config: dict, head_dim: int) -> RopeSpec:
    """Inverse frequencies and attention scaling for a Llama-family config (see ``ROPE_TYPES``)."""
    p = rope_parameters(config)
    kind = p["rope_type"]
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type {kind!r} is not implemented; supported: {', '.join(ROPE_TYPES)}")
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={p['partial_rotary_factor']} is not supported (full rotary only)")
    base = float(p["rope_theta"])
    inv_freq = _base_inv_freq(base, head_dim)
    if kind == "default":
        return RopeSpec(inv_freq)
    if kind == "linear":  # position interpolation: positions / factor == frequencies / factor
        return RopeSpec(inv_freq / float(p["factor"]), rope_type=kind)
    if kind == "dynamic":
        return RopeSpec(inv_freq, rope_type=kind, max_context=config.get("max_position_embeddings"))
    if kind == "llama3":
        return RopeSpec(_llama3(inv_freq, p), rope_type=kind)
    return _yarn(base, head_dim, p, config)


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    # integer exponents first, as the reference implementations do: keeps the float32 values bit-identical
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend linearly in between."""
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def _yarn(base: float, dim: int, p: dict, config: dict) -> RopeSpec:
    """YaRN (Peng et al. 2023): interpolate low-frequency pairs, extrapolate high ones, ramp between; scale cos/sin."""
    orig = float(p["original_max_position_embeddings"])
    factor = p.get("factor")
    if factor is None:
        factor = config["max_position_embeddings"] / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the pair index that turns `rotations` times over `orig`
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp  # 1 for high-frequency pairs (kept), 0 for low-frequency ones (interpolated)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return RopeSpec(inv_freq, attention_scaling=float(attn), rope_type="yarn")


# ----------------------------------------------------------------------------------------------- head layouts
def pairs_order(head_dim: int) -> torch.Tensor:
    """Where ``pairs`` takes each feature of a ``halves`` head from: ``[0, D/2, 1, D/2 + 1, ..., D/2 - 1, D - 1]``."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half, 2 * half)], dim=1).reshape(-1)


def pairs_rows(heads: int, head_dim: int) -> torch.Tensor:
    """Row order of a ``(heads * head_dim, ...)`` projection weight (or bias) in the ``pairs`` layout."""
    return (torch.arange(heads)[:, None] * head_dim + pairs_order(head_dim)[None, :]).reshape(-1)


@dataclass
class RopeTables:
    """One step's rotation, per token: ``cos`` / ``sin`` ``(T, D/2)`` in the activations' dtype for ``halves``, or
    ``cis = cos + i sin`` ``(T, D/2)`` complex64 for ``pairs`` (the rotation runs in float32 whatever the dtype;
    in the compiled forward ``(T, D/2, 2)`` float32 pairs ``(cos, sin)``, as ``rotate_pairs_`` takes them too);
    ``cis is None`` tells the layouts apart."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    cis: torch.Tensor | None = None

    @classmethod
    def at(
        cls, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, layout: str, dtype: torch.dtype
    ) -> RopeTables:
        if layout == "pairs":
            cos, sin = rotary_cos_sin(positions, inv_freq, attention_scaling)
            if torch.compiler.is_compiling():  # real pairs: inductor generates no code for complex tensors
                return cls(cis=torch.stack((cos, sin), -1))
            return cls(cis=torch.complex(cos, sin))
        cos, sin = rotary_cos_sin(positions, inv_freq, attention_scaling, dtype=dtype)
        return cls(cos=cos, sin=sin)

    def rows(self, index: torch.Tensor) -> RopeTables:
        """The tables of the tokens ``index`` only."""
        if self.cis is not None:
            return RopeTables(cis=self.cis[index])
        return RopeTables(cos=self.cos[index], sin=self.sin[index])


def rotate_pairs_(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, H, D)`` (``pairs`` layout) in place by ``cis`` ``(T, D/2)`` (or its real ``(T, D/2, 2)``
    pairs, ``RopeTables``); returns ``x``.

    float32 / float64 rotate as a complex view of ``x`` itself (its last dim contiguous, other strides even: the
    q/k columns of a fused projection qualify); other dtypes through one float32 copy, rounded once at the end.
    Faster than the six half-width passes of the ``halves`` rotation, most in float32 (measured: evals/README.md,
    "Measurements behind the code's choices")."""
    t, h, d = x.shape
    if not cis.is_complex():  # (T, D/2, 2) real (cos, sin) pairs (``RopeTables.at`` under compilation)
        xf = x.float().view(t, h, d // 2, 2)
        a, b, c, s = xf[..., 0], xf[..., 1], cis[:, None, :, 0], cis[:, None, :, 1]
        return x.copy_(torch.stack((a * c - b * s, a * s + b * c), -1).view(t, h, d))
    wide = x.dtype == torch.float64
    cis = cis.to(torch.complex128 if wide else torch.complex64)[:, None, :]
    if x.dtype in (torch.float32, torch.float64) and x.stride(-1) == 1 and all(s % 2 == 0 for s in x.stride()[:-1]):
        torch.view_as_complex(x.view(t, h, d // 2, 2)).mul_(cis)
        return x
    xf = x.to(torch.float64 if wide else torch.float32, copy=True).contiguous()
    torch.view_as_complex(xf.view(t, h, d // 2, 2)).mul_(cis)
    return x.copy_(xf)


def rotate_qk_(
    q: torch.Tensor,
    k: torch.Tensor,
    rope: RopeTables,
    q_rope: RopeTables | None = None,
    both: torch.Tensor | None = None,
    apply_halves=apply_rotary,
    apply_pairs=rotate_pairs_,
) -> None:
    """Rotate queries ``q`` ``(Tq, Hq, D)`` and keys ``k`` ``(T, Hkv, D)`` in place, in ``rope``'s layout
    (``q_rope``: the queries' own tables when they are a subset of the rows). ``halves`` goes through
    ``apply_halves`` (the backend's kernel); ``pairs`` through ``apply_pairs`` (torch's ``rotate_pairs_``, or the
    ``rope_kernel`` probe's pick, ``lab.kernels.cpu_rope``'s), rotating ``both`` in one pass when given, the
    ``(T, Hq + Hkv, D)`` view of a fused projection's q/k columns that ``q`` and ``k`` are views of."""
    q_rope = rope if q_rope is None else q_rope
    if rope.cis is None:
        apply_halves(q, q_rope.cos, q_rope.sin)
        apply_halves(k, rope.cos, rope.sin)
    elif both is not None:
        apply_pairs(both, rope.cis)
    else:
        apply_pairs(q, q_rope.cis)
        apply_pairs(k, rope.cis)
