"""swap_cache_layout with host_heads: the host's blocks hold more KV heads than the cache, and
only the cache's heads of each host chunk move (a reader of more ranks than the writer cuts
its heads out of the writer's shard). Checked against numpy indexing of the host viewed as
[slot, 2L, total heads, bs, dim], every untouched byte still poisoned."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import (
    MODE_DEVICE_TO_HOST,
    MODE_HOST_TO_DEVICE,
    HostHeads,
    SwapLayoutError,
    swap_cache_layout,
)
from tests.kernels.reference import POISON_BYTE, poisoned_host, poisoned_like, random_layers

LAYERS, BLOCKS, BS, DIM, TOTAL = 2, 7, 4, 6, 8


def _host_view(host: np.ndarray, num_slots: int) -> np.ndarray:
    """[slot, 2L, total heads, bs, dim] of uint16 over the host bytes."""
    return host.view(np.uint16).reshape(num_slots, 2 * LAYERS, TOTAL, BS, DIM)


@pytest.mark.parametrize(("start", "heads"), [(0, 4), (4, 4), (2, 2), (7, 1), (0, 8)])
def test_host_to_device_takes_only_the_cache_heads(start: int, heads: int) -> None:
    rng = np.random.default_rng(start * 10 + heads)
    num_slots = 5
    host = rng.integers(0, 256, size=num_slots * 2 * LAYERS * TOTAL * BS * DIM * 2, dtype=np.uint8)
    cache = poisoned_like(random_layers(rng, LAYERS, BLOCKS, heads, BS, DIM))
    ids, slots = [6, 0, 3], [4, 1, 2]
    swap_cache_layout(cache, host, ids, slots, MODE_HOST_TO_DEVICE,
                      host_heads=HostHeads(start, TOTAL))  # fmt: skip
    view = _host_view(host, num_slots)
    for j, tensor in enumerate(cache):
        np.testing.assert_array_equal(tensor[ids], view[slots, j, start : start + heads])
        untouched = [b for b in range(BLOCKS) if b not in ids]
        assert (tensor[untouched].view(np.uint8) == POISON_BYTE).all()


def test_device_to_host_writes_only_the_cache_heads() -> None:
    rng = np.random.default_rng(3)
    cache = random_layers(rng, LAYERS, BLOCKS, 2, BS, DIM)
    num_slots = 3
    host = poisoned_host(num_slots * 2 * LAYERS * TOTAL * BS * DIM * 2)
    swap_cache_layout(cache, host, [5, 1], [2, 0], MODE_DEVICE_TO_HOST,
                      host_heads=HostHeads(6, TOTAL))  # fmt: skip
    view = _host_view(host, num_slots)
    for j, tensor in enumerate(cache):
        np.testing.assert_array_equal(view[[2, 0], j, 6:8], tensor[[5, 1]])
    rest = view.copy()
    rest[[2, 0], :, 6:8] = POISON_BYTE * 0x101  # the moved heads aside, every byte is poison
    assert (rest.view(np.uint8) == POISON_BYTE).all()


def test_a_slot_is_the_size_of_a_block_of_every_host_head() -> None:
    cache = random_layers(np.random.default_rng(0), LAYERS, BLOCKS, 4, BS, DIM)
    slot = 2 * LAYERS * TOTAL * BS * DIM * 2
    host = poisoned_host(2 * slot + slot // 2)  # two whole slots of 8 heads, not three
    with pytest.raises(SwapLayoutError, match=r"host_slots\[0\] = 2 is out of range \[0, 2\)"):
        swap_cache_layout(cache, host, [0], [2], MODE_HOST_TO_DEVICE,
                          host_heads=HostHeads(4, TOTAL))  # fmt: skip


@pytest.mark.parametrize("heads", [HostHeads(5, TOTAL), HostHeads(-1, TOTAL), HostHeads(0, 3)])
def test_heads_outside_the_host_block_are_refused(heads: HostHeads) -> None:
    cache = random_layers(np.random.default_rng(0), LAYERS, BLOCKS, 4, BS, DIM)
    host = poisoned_host(4 * 2 * LAYERS * TOTAL * BS * DIM * 2)
    with pytest.raises(SwapLayoutError, match="do not fit a host block"):
        swap_cache_layout(cache, host, [0], [0], MODE_HOST_TO_DEVICE, host_heads=heads)
