"""The two KV layouts that swap_cache_layout moves between, as sizes.

Worker cache, one tensor per (layer, K|V), blocks scattered by id:

    layer_tensors[2*l + kv]          # [num_blocks, num_kv_heads, block_size, head_dim]
    chunk (l, kv, b) = bytes [b * chunk_bytes, (b + 1) * chunk_bytes) of that tensor

Host buffer, block-major and layer-minor, one slot per moved block:

    host[slot]                       # [num_layers, 2, num_kv_heads, block_size, head_dim]
    chunk (l, kv) of slot s = bytes [s * slot_bytes + (2*l + kv) * chunk_bytes, ... + chunk_bytes)

    |<------------------------------ slot_bytes ------------------------------->|
    | K0 chunk | V0 chunk | K1 chunk | V1 chunk | ... | K(L-1) chunk | V(L-1) chunk |

so a chunk (one layer's K or V of one block) is contiguous on both sides and
slot_bytes = 2 * num_layers * chunk_bytes.

A host side of more heads (HostHeads: its blocks hold `total` KV heads, the cache's are
[start, start + num_kv_heads) of them) has chunks of total / num_kv_heads times the size; the
copy moves only the cache's heads, a contiguous run inside each host chunk:

    host chunk (l, kv) of slot s = bytes [s * host_slot + (2*l + kv) * host_chunk, ...)
    moved part                   = bytes [+ start * head_chunk, + (start + H) * head_chunk)

That is how a reader of more ranks than the writer cuts its heads out of the writer's shard.
"""

from __future__ import annotations

from dataclasses import dataclass

MODE_DEVICE_TO_HOST = 0
MODE_HOST_TO_DEVICE = 1
SUPPORTED_ELEM_BYTES = (1, 2, 4)


class SwapLayoutError(ValueError):
    """A swap_cache_layout argument is unusable; the message names the argument and why."""


@dataclass(frozen=True)
class CacheGeometry:
    """Shape of one worker KV cache: 2 * num_layers tensors of identical shape and dtype."""

    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    elem_bytes: int

    @property
    def num_tensors(self) -> int:
        """Tensors in `layer_tensors`: K and V of every layer."""
        return 2 * self.num_layers

    @property
    def chunk_bytes(self) -> int:
        """One layer's K (or V) of one block: contiguous on both sides."""
        return self.num_kv_heads * self.block_size * self.head_dim * self.elem_bytes

    @property
    def slot_bytes(self) -> int:
        """One block's K and V of every layer in the host buffer."""
        return self.num_tensors * self.chunk_bytes

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one layer tensor."""
        return self.num_blocks * self.chunk_bytes


@dataclass(frozen=True)
class HostHeads:
    """The host side's blocks hold `total` KV heads; the cache's heads are [start, start +
    the cache's head count) of them."""

    start: int
    total: int

    def check(self, cache_heads: int) -> None:
        if self.start < 0 or self.start + cache_heads > self.total:
            raise SwapLayoutError(
                f"host_heads: the cache's {cache_heads} heads from head {self.start} do not fit "
                f"a host block of {self.total} heads"
            )


def slot_bytes(
    num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, elem_bytes: int
) -> int:
    """Bytes of one host slot (one block, K and V of every layer); slot s starts at s * this."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("block_size", block_size),
        ("head_dim", head_dim),
    ):
        if value <= 0:
            raise SwapLayoutError(f"{name} must be positive, got {value}")
    if elem_bytes not in SUPPORTED_ELEM_BYTES:
        raise SwapLayoutError(f"elem_bytes must be one of {SUPPORTED_ELEM_BYTES}, got {elem_bytes}")
    return 2 * num_layers * num_kv_heads * block_size * head_dim * elem_bytes
