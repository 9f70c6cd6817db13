"""KVCache: the worker's paged KV cache, one K and one V tensor per layer.

    per layer, K and V each: [num_blocks, num_kv_heads, block_size, head_dim]
    position p of a sequence lives in block block_ids[p // block_size], row p % block_size

`tensors` is the flat list [K0, V0, K1, V1, ...] that the decoder writes and the
`swap_cache_layout` kernel copies to and from the pool's block-major layout.
Sizing helpers are Paddle-free so the control plane can size the cache from a byte budget.
"""

from __future__ import annotations

from typing import Any

from workers.engine.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_block_shape(config: ModelConfig, block_size: int) -> tuple[int, int, int]:
    """Shape of one block of one layer's K (or V): (num_kv_heads, block_size, head_dim)."""
    return (config.num_kv_heads, block_size, config.head_dim)


def kv_block_bytes(config: ModelConfig, block_size: int) -> int:
    """Bytes of one block across all layers, K and V: one pool object per block
    ([num_layers, 2, num_kv_heads, block_size, head_dim])."""
    heads, rows, dim = kv_block_shape(config, block_size)
    return config.num_layers * 2 * heads * rows * dim * DTYPE_BYTES[config.dtype]


def num_blocks_for_bytes(config: ModelConfig, block_size: int, budget_bytes: int) -> int:
    return budget_bytes // kv_block_bytes(config, block_size)


class KVCache:
    """Zero-initialized per-layer K/V tensors on the current Paddle device."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int) -> None:
        from workers.engine.paddle_runtime import paddle

        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = config.num_layers
        shape = [num_blocks, *kv_block_shape(config, block_size)]
        # [num_blocks, num_kv_heads, block_size, head_dim] each, K then V per layer
        self.tensors: list[Any] = [
            paddle.zeros(shape, dtype=config.dtype) for _ in range(2 * config.num_layers)
        ]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src into block dst in every layer's K and V, for each (src, dst): a
        forked sequence's own copy of its prompt's partial last block."""
        for tensor in self.tensors:
            for src, dst in pairs:
                tensor[dst] = tensor[src]

    def key(self, layer: int) -> Any:
        return self.tensors[2 * layer]

    def value(self, layer: int) -> Any:
        return self.tensors[2 * layer + 1]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensors[0].shape)

    @property
    def total_bytes(self) -> int:
        return sum(int(t.numel()) * t.element_size() for t in self.tensors)
