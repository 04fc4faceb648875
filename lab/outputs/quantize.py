"""Quantized embeddings: ``int8`` / ``uint8`` scalar buckets and ``binary`` / ``ubinary`` sign bits.

The semantics are sentence-transformers' ``quantize_embeddings`` (so vectors quantized here and there compare):

- ``int8`` / ``uint8``: per dimension, 256 equal buckets between that dimension's minimum and maximum over
  ``ranges`` (a ``(2, dim)`` array), else over ``calibration_embeddings``, else over the embeddings themselves
  (which needs more than one embedding); ``floor((x - min) / step)`` clipped to ``[0, 255]``, minus 128 for
  ``int8``. A dimension whose range is empty gets step 1.
- ``binary`` / ``ubinary``: one bit per dimension (``x > 0``), packed big-endian 8 per byte (``ceil(dim / 8)``
  bytes); ``binary`` shifts the byte by -128 into ``int8``.
- A list of ``(L_i, dim)`` matrices (token vectors) is quantized with one set of ranges for all of them.
- ``quantize_output``: ``Engine.embed``'s result (an array, a list of matrices, or a dict of outputs) at a precision.

    >>> q = quantize_embeddings(E, "ubinary")              # (N, ceil(dim / 8)) uint8
    >>> q = quantize_embeddings(E, "int8", calibration_embeddings=corpus_sample)
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PRECISIONS", "check_precision", "quantization_ranges", "quantize_embeddings", "quantize_output"]

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


def check_precision(precision: str, rows: int | None = None) -> str:
    """``precision`` if it is one of ``PRECISIONS``; with ``rows`` (the embeddings a call will quantize with ranges
    of their own), also refuses ``int8`` / ``uint8`` on a single row, before any work."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(map(repr, PRECISIONS))}")
    if rows == 1 and precision in ("int8", "uint8"):
        quantization_ranges(np.zeros((1, 1), dtype=np.float32))  # the error: ranges need several embeddings
    return precision


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    x = np.asarray(x)
    if x.dtype in (np.int8, np.uint8):
        raise ValueError(
            "embeddings to quantize must be floating point, got already quantized "
            f"{x.dtype} values; quantize the float32 embeddings"
        )
    return x


def quantization_ranges(calibration: np.ndarray) -> np.ndarray:
    """``(2, dim)``: each dimension's minimum and maximum over ``calibration`` ``(n, dim)``, n > 1."""
    calibration = _as_numpy(calibration)
    if calibration.ndim != 2 or calibration.shape[0] < 2:
        raise ValueError(
            f"int8 / uint8 ranges need several embeddings to take each dimension's min and max from, got "
            f"shape {calibration.shape}; pass ranges= or calibration_embeddings= from a representative "
            "set (e.g. a sample of the corpus)"
        )
    return np.stack([calibration.min(axis=0), calibration.max(axis=0)])


def quantize_embeddings(
    embeddings, precision: str, ranges: np.ndarray | None = None, calibration_embeddings: np.ndarray | None = None
):
    """``embeddings`` (``(N, dim)`` array / tensor, or a list of ``(L_i, dim)`` matrices) at ``precision``: an
    array (``float32``, ``int8`` or ``uint8``), or a list of them for a list input. See the module docstring."""
    check_precision(precision)
    if isinstance(embeddings, list | tuple):
        mats = [_as_numpy(m) for m in embeddings]
        if not mats:
            return []
        if mats[0].ndim == 2:  # token vectors: one set of ranges for every matrix
            if precision in ("int8", "uint8") and ranges is None:
                calib = np.concatenate(mats) if calibration_embeddings is None else calibration_embeddings
                ranges = quantization_ranges(calib) if len(calib) else None
            return [quantize_embeddings(m, precision, ranges, calibration_embeddings) for m in mats]
        embeddings = np.stack(mats)
    x = _as_numpy(embeddings)
    if precision == "float32":
        return x.astype(np.float32)
    if precision in ("binary", "ubinary"):
        bits = np.packbits(x > 0, axis=-1)
        return (bits.astype(np.int16) - 128).astype(np.int8) if precision == "binary" else bits
    if x.ndim == 2 and x.shape[0] == 0:
        return np.zeros(x.shape, dtype=np.int8 if precision == "int8" else np.uint8)
    if ranges is None:
        ranges = quantization_ranges(x if calibration_embeddings is None else calibration_embeddings)
    ranges = np.asarray(ranges, dtype=np.float32)
    if ranges.shape != (2, x.shape[-1]):
        raise ValueError(f"ranges must have shape (2, {x.shape[-1]}) (per-dimension min and max), got {ranges.shape}")
    start = ranges[0]
    step = (ranges[1] - start) / 255
    step = np.where(step == 0, 1, step)
    buckets = np.clip(np.floor((x - start) / step), 0, 255)
    return (buckets - 128).astype(np.int8) if precision == "int8" else buckets.astype(np.uint8)


def quantize_output(out, precision: str):
    """``embed``'s result at ``precision``: dense arrays and lists of token / ColBERT matrices (one set of int8
    ranges per list), each output of a dict on its own; float32 returns ``out`` as it is."""
    if precision == "float32":
        return out
    if isinstance(out, dict):
        return {name: quantize_output(value, precision) for name, value in out.items()}
    return quantize_embeddings(out, precision)
