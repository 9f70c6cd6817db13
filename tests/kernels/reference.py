"""Test helpers for swap_cache_layout: factories and a direct element-loop reference.

The reference walks every element with the index formulas written at the top of
kernels/swap_cache_layout.cu, independently of the byte-chunk arithmetic the implementations
use, so a wrong formula in either place shows up as a mismatch.
"""

from __future__ import annotations

import numpy as np

POISON_BYTE = 0xA5
DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def random_layers(
    rng: np.random.Generator,
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: type = np.uint16,
) -> list[np.ndarray]:
    """[K0, V0, K1, V1, ...] of random bit patterns, each [num_blocks, kv_heads, bs, dim]."""
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    info = np.iinfo(dtype)
    return [
        rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
        for _ in range(2 * num_layers)
    ]


def poisoned_like(layers: list[np.ndarray]) -> list[np.ndarray]:
    out = [np.empty_like(t) for t in layers]
    for t in out:
        t.view(np.uint8)[...] = POISON_BYTE
    return out


def poisoned_host(nbytes: int) -> np.ndarray:
    return np.full(nbytes, POISON_BYTE, dtype=np.uint8)


def scattered_ids(rng: np.random.Generator, limit: int, count: int) -> np.ndarray:
    return rng.choice(limit, size=count, replace=False).astype(np.int64)


def reference_swap(
    layers: list[np.ndarray],
    host: np.ndarray,
    block_ids: list[int],
    host_slots: list[int],
    mode: int,
) -> None:
    """Element by element, in place, with the .cu header's formulas:
    cache_j[b, h, t, d] = flat ((b * H + h) * BS + t) * D + d
    host[s, l, kv, h, t, d] = flat (((s * 2L + 2l + kv) * H + h) * BS + t) * D + d
    """
    num_tensors = len(layers)
    _, num_heads, block_size, head_dim = layers[0].shape
    host_flat = host.view(layers[0].dtype).reshape(-1)
    for b, s in zip(block_ids, host_slots, strict=True):
        for j in range(num_tensors):
            cache_flat = layers[j].reshape(-1)
            for h in range(num_heads):
                for t in range(block_size):
                    for d in range(head_dim):
                        c = ((b * num_heads + h) * block_size + t) * head_dim + d
                        x = (
                            ((s * num_tensors + j) * num_heads + h) * block_size + t
                        ) * head_dim + d
                        if mode == 0:
                            host_flat[x] = cache_flat[c]
                        else:
                            cache_flat[c] = host_flat[x]
