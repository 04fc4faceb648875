"""Rotary position embedding frequencies from a Hugging Face ``config.json`` dict.

Reads both spellings of the RoPE settings — transformers 5 ``rope_parameters`` (with ``rope_theta`` inside) and
transformers 4 ``rope_scaling`` next to a top-level ``rope_theta`` — and returns the per-pair inverse frequencies
plus the factor cos/sin are multiplied by. The formulas follow the papers and Meta's / Qwen's releases (default,
linear position interpolation, Llama 3.1 smoothed bands, YaRN); they are checked against transformers' rotary
embedding in ``tests/test_models_decoder.py``.

    >>> rope = rope_from_config(config)                     # RopeSpec(inv_freq (D/2,) float32, attention_scaling)
    >>> cos, sin = rotary_cos_sin(positions, rope.inv_freq, rope.attention_scaling)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
