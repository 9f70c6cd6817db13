"""Rotary position embedding tables (numpy; the decoder uploads them once).

Llama's half rotation: a head vector x = [x1 | x2] (two halves of head_dim / 2) at position p
becomes  x * cos(p * f) + rotate_half(x) * sin(p * f),  rotate_half(x) = [-x2 | x1],
with the frequencies f repeated over both halves. Scaling variants only change f:

    default  f_i = theta ** (-2i / head_dim)
    linear   f_i / factor                              (positions stretched by `factor`)
    llama3   long wavelengths divided by factor, short ones kept, a smooth blend between
             (Llama 3.1's scheme, bounded by low/high_freq_factor and the original context)
"""

from __future__ import annotations

import math

import numpy as np

from workers.engine.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """float64 [head_dim // 2]: the rotation frequency of each pair of channels."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(inv, scaling)
    raise ValueError(f"rope_scaling type {scaling.rope_type!r} not supported")


def _llama3(inv: np.ndarray, s: RopeScaling) -> np.ndarray:
    old_ctx = s.original_max_position_embeddings
    low_freq_wavelen = old_ctx / s.low_freq_factor
    high_freq_wavelen = old_ctx / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_freq_wavelen, inv / s.factor, inv)
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled)


def cos_sin_tables(
    head_dim: int, theta: float, scaling: RopeScaling | None, num_positions: int
) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos and sin, each [num_positions, head_dim] (frequencies repeated per half)."""
    inv = inv_frequencies(head_dim, theta, scaling)
    angles = np.outer(np.arange(num_positions, dtype=np.float64), inv)  # [pos, head_dim / 2]
    angles = np.concatenate([angles, angles], axis=1)  # [pos, head_dim]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
