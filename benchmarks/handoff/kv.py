"""The KV cache the handoff benchmark moves: its shape, the prompts, and a checkable content.

    cache tensor t (t = 2*layer + kv):  [num_blocks, num_kv_heads, block_size, head_dim], 2-byte
    element i of tensor t (flat index):  pattern(t)[i] = ((i + t * 0x9E3779B1) * 0x85EBCA6B) >> 13

P fills its cache with the pattern; D recomputes it to check, block for block, that what
arrived in its (scattered) blocks is exactly what left P's (other, scattered) blocks. The
pattern is uint32 arithmetic that wraps the same way in numpy and CuPy, so one function serves
both backends. bf16 is stored as uint16: the copy path only sees 2-byte elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

TAIL_SHORT_TOKENS = 3  # a prompt of N - 3 tokens: its last block is partial at any block size >= 4


@dataclass(frozen=True)
class KvShape:
    """Model dimensions that size a block (Llama-3-8B by default)."""

    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    elem_bytes: int = 2  # bf16

    @property
    def num_tensors(self) -> int:
        return 2 * self.num_layers

    def slot_bytes(self, block_size: int) -> int:
        """One block, K and V of every layer: one pool object."""
        return self.num_tensors * self.num_kv_heads * block_size * self.head_dim * self.elem_bytes

    def describe(self) -> str:
        return f"{self.num_layers} layers, {self.num_kv_heads} KV heads, head dim {self.head_dim}"


LLAMA3_8B = KvShape()
TINY = KvShape(num_layers=2, num_kv_heads=2, head_dim=16)


@dataclass(frozen=True)
class Prompt:
    """A prompt of `nominal_tokens - TAIL_SHORT_TOKENS` tokens cut into blocks of block_size."""

    nominal_tokens: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.nominal_tokens - TAIL_SHORT_TOKENS

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def tail_tokens(self) -> int:
        """Tokens in the last block when it is partial, else 0."""
        return self.num_tokens % self.block_size

    @property
    def label(self) -> str:
        n = self.nominal_tokens
        return f"{n // 1024}K" if n % 1024 == 0 else str(n)

    def keys(self, prefix: str) -> list[str]:
        """One pool key per block; the partial last block's key says how many tokens it holds
        (the key scheme of workers/pool/keys.py does the same with chained hashes)."""
        keys = [f"{prefix}/{i}" for i in range(self.num_blocks)]
        if self.tail_tokens:
            keys[-1] += f":partial:{self.tail_tokens}"
        return keys


def scattered_ids(num_cache_blocks: int, count: int, seed: int) -> list[int]:
    """count distinct block ids in random order: a handoff never moves one contiguous run."""
    rng = np.random.default_rng(seed)
    return [int(b) for b in rng.permutation(num_cache_blocks)[:count]]


def pattern(xp: ModuleType, tensor_index: int, num_elems: int) -> object:
    """The content of cache tensor tensor_index, flat, as uint16 (numpy or CuPy)."""
    x = xp.arange(num_elems, dtype=xp.uint32)
    x += xp.uint32((tensor_index * 0x9E3779B1) & 0xFFFFFFFF)
    x *= xp.uint32(0x85EBCA6B)
    x >>= xp.uint32(13)
    return x.astype(xp.uint16)


class KvCache:
    """The paged cache of one side: 2 * num_layers tensors on the GPU (CuPy) or CPU (numpy)."""

    def __init__(self, xp: ModuleType, shape: KvShape, num_blocks: int, block_size: int) -> None:
        self.xp = xp
        self.tensor_shape = (num_blocks, shape.num_kv_heads, block_size, shape.head_dim)
        # [num_blocks, num_kv_heads, block_size, head_dim] each, K0, V0, K1, V1, ...
        self.tensors = [
            xp.zeros(self.tensor_shape, dtype=xp.uint16) for _ in range(shape.num_tensors)
        ]

    def fill(self) -> None:
        for t, tensor in enumerate(self.tensors):
            tensor.reshape(-1)[...] = pattern(self.xp, t, tensor.size)

    def zero_blocks(self, block_ids: list[int]) -> None:
        ids = self.xp.asarray(block_ids, dtype=self.xp.int64)
        for tensor in self.tensors:
            tensor[ids] = 0

    def holds(self, block_ids: list[int], source_ids: list[int]) -> bool:
        """Whether block block_ids[j] holds exactly what P's filled block source_ids[j] held."""
        xp = self.xp
        ids = xp.asarray(block_ids, dtype=xp.int64)
        src = xp.asarray(source_ids, dtype=xp.int64)
        for t, tensor in enumerate(self.tensors):
            expected = pattern(xp, t, tensor.size).reshape(self.tensor_shape)[src]
            if not bool(xp.array_equal(tensor[ids], expected)):
                return False
        return True

    def nbytes(self) -> int:
        return sum(int(t.nbytes) for t in self.tensors)
