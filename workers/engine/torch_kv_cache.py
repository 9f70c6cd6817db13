"""TorchKVCache: the paged KV cache of the PyTorch backend, in the Paddle KVCache's layout.

    per layer, K and V each: [num_blocks, num_kv_heads, block_size, head_dim], C-contiguous
    position p of a sequence lives in block block_ids[p // block_size], row p % block_size

`tensors` is [K0, V0, K1, V1, ...], the order the swap_cache_layout kernel and the pool's
block-major objects assume (workers/engine/kv_cache.py), so a torch worker and a Paddle
worker exchange blocks through the pool byte for byte.
"""

from __future__ import annotations

from typing import Any

from workers.engine.config import ModelConfig
from workers.engine.kv_cache import kv_block_shape
from workers.engine.torch_runtime import torch


class TorchKVCache:
    """Zero-initialized per-layer K/V torch tensors on `device` (a torch.device)."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = config.num_layers
        # One block more than the pool's: block num_blocks is scratch, where a CUDA graph's
        # padding rows write (torch_graphs.py). Nothing else sees it: `tensors` are views of
        # the first num_blocks blocks (a leading slice: contiguous, the same addresses).
        self.scratch_block = num_blocks
        shape = (num_blocks + 1, *kv_block_shape(config, block_size))
        dtype = getattr(torch, config.dtype)
        # [num_blocks + 1, num_kv_heads, block_size, head_dim] each, K then V per layer
        self.with_scratch: list[Any] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * config.num_layers)
        ]
        # [num_blocks, num_kv_heads, block_size, head_dim] each
        self.tensors: list[Any] = [t[:num_blocks] for t in self.with_scratch]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src into block dst in every layer's K and V, for each (src, dst) in
        order (as the Paddle cache does): a forked sequence's own copy of its prompt's partial
        last block."""
        with torch.no_grad():
            for tensor in self.tensors:
                for src, dst in pairs:
                    tensor[dst].copy_(tensor[src])

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
