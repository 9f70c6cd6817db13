"""swap_cache_layout on the CPU (numpy) against the direct element-loop reference."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import (
    MODE_DEVICE_TO_HOST,
    MODE_HOST_TO_DEVICE,
    HostBuffer,
    bytes_per_slot,
    slot_bytes,
    swap_cache_layout,
)
from tests.kernels.reference import (
    DTYPES,
    POISON_BYTE,
    poisoned_host,
    poisoned_like,
    random_layers,
    reference_swap,
    scattered_ids,
)

# (num_layers, num_blocks, num_kv_heads, block_size, head_dim, elem_bytes, num_moved, seed)
RANDOM_CASES = [
    (1, 1, 1, 1, 1, 1, 1, 0),
    (1, 6, 1, 3, 5, 1, 4, 1),
    (2, 9, 3, 5, 7, 2, 5, 2),
    (3, 12, 2, 4, 8, 4, 12, 3),
    (2, 20, 1, 16, 3, 2, 7, 4),
    (4, 7, 2, 2, 16, 4, 3, 5),
]


@pytest.mark.parametrize("case", RANDOM_CASES, ids=lambda c: "L{}N{}H{}B{}D{}e{}n{}".format(*c))
def test_device_to_host_matches_reference(case: tuple[int, ...]) -> None:
    num_layers, num_blocks, heads, bs, dim, elem_bytes, num_moved, seed = case
    rng = np.random.default_rng(seed)
    layers = random_layers(rng, num_layers, num_blocks, heads, bs, dim, DTYPES[elem_bytes])
    num_slots = num_moved + 3
    ids = scattered_ids(rng, num_blocks, num_moved)
    slots = scattered_ids(rng, num_slots, num_moved)
    host = poisoned_host(num_slots * bytes_per_slot(layers))
    expected = host.copy()
    reference_swap(layers, expected, ids.tolist(), slots.tolist(), MODE_DEVICE_TO_HOST)
    before = [t.copy() for t in layers]

    handle = swap_cache_layout(layers, host, ids, slots, MODE_DEVICE_TO_HOST)

    assert handle.done()
    np.testing.assert_array_equal(host, expected)
    for src, orig in zip(layers, before, strict=True):
        np.testing.assert_array_equal(src, orig)
    untouched = sorted(set(range(num_slots)) - set(slots.tolist()))
    slot_view = host.reshape(num_slots, -1)
    assert (slot_view[untouched] == POISON_BYTE).all()


@pytest.mark.parametrize("case", RANDOM_CASES, ids=lambda c: "L{}N{}H{}B{}D{}e{}n{}".format(*c))
def test_host_to_device_matches_reference(case: tuple[int, ...]) -> None:
    num_layers, num_blocks, heads, bs, dim, elem_bytes, num_moved, seed = case
    rng = np.random.default_rng(100 + seed)
    layers = poisoned_like(
        random_layers(rng, num_layers, num_blocks, heads, bs, dim, DTYPES[elem_bytes])
    )
    num_slots = num_moved + 2
    host = rng.integers(0, 256, size=num_slots * bytes_per_slot(layers), dtype=np.uint8)
    host_before = host.copy()
    ids = scattered_ids(rng, num_blocks, num_moved)
    slots = scattered_ids(rng, num_slots, num_moved)
    expected = [t.copy() for t in layers]
    reference_swap(expected, host.copy(), ids.tolist(), slots.tolist(), MODE_HOST_TO_DEVICE)

    swap_cache_layout(layers, host, ids.tolist(), slots.tolist(), MODE_HOST_TO_DEVICE).wait()

    for got, want in zip(layers, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(host, host_before)
    untouched = sorted(set(range(num_blocks)) - set(ids.tolist()))
    for got in layers:
        assert (got[untouched].view(np.uint8) == POISON_BYTE).all()


def test_slot_offsets_by_hand() -> None:
    # 2 layers, 1 head, block_size 1, head_dim 2, uint8: a chunk is 2 bytes, a slot 8 bytes.
    layers = [np.arange(6, dtype=np.uint8).reshape(3, 1, 1, 2) + 10 * (j + 1) for j in range(4)]
    host = poisoned_host(3 * 8)

    swap_cache_layout(layers, host, [2, 0], [1, 2], MODE_DEVICE_TO_HOST)

    assert bytes_per_slot(layers) == slot_bytes(2, 1, 1, 2, 1) == 8
    p = POISON_BYTE
    assert host.tolist() == [
        *[p] * 8,
        *[14, 15, 24, 25, 34, 35, 44, 45],  # slot 1 <- block 2: K0 V0 K1 V1
        *[10, 11, 20, 21, 30, 31, 40, 41],  # slot 2 <- block 0
    ]


def test_round_trip_to_other_blocks() -> None:
    rng = np.random.default_rng(7)
    source = random_layers(rng, 3, 16, 2, 4, 8, np.uint16)
    host = poisoned_host(10 * bytes_per_slot(source))
    src_ids, slots, dst_ids = [3, 15, 0, 9], [8, 1, 5, 2], [11, 4, 6, 0]

    swap_cache_layout(source, host, src_ids, slots, MODE_DEVICE_TO_HOST)
    target = poisoned_like(source)
    swap_cache_layout(target, host, dst_ids, slots, MODE_HOST_TO_DEVICE)

    for src, dst in zip(source, target, strict=True):
        np.testing.assert_array_equal(dst[dst_ids], src[src_ids])
        others = sorted(set(range(16)) - set(dst_ids))
        assert (dst[others].view(np.uint8) == POISON_BYTE).all()


def test_float_bits_survive_exactly() -> None:
    bits = np.array([0x7FC00001, 0xFF800000, 0x80000000, 0x00000001], dtype=np.uint32)
    layers = [np.tile(bits, 2).view(np.float32).reshape(2, 1, 1, 4) for _ in range(2)]
    host = np.zeros(2 * bytes_per_slot(layers), dtype=np.uint8)

    swap_cache_layout(layers, host, [1], [1], MODE_DEVICE_TO_HOST)

    assert host.view(np.uint32).tolist() == [0] * 8 + bits.tolist() * 2


def test_raw_host_pointer_same_as_array() -> None:
    rng = np.random.default_rng(11)
    layers = random_layers(rng, 2, 8, 2, 4, 4, np.uint32)
    backing = poisoned_host(6 * bytes_per_slot(layers))
    expected = backing.copy()
    ids, slots = [5, 1, 7], [4, 0, 3]
    swap_cache_layout(layers, expected, ids, slots, MODE_DEVICE_TO_HOST)

    raw = HostBuffer(backing.ctypes.data, backing.nbytes)
    swap_cache_layout(layers, raw, ids, slots, MODE_DEVICE_TO_HOST)
    np.testing.assert_array_equal(backing, expected)

    target = poisoned_like(layers)
    swap_cache_layout(target, raw, ids, slots, MODE_HOST_TO_DEVICE)
    for got, want in zip(target, layers, strict=True):
        np.testing.assert_array_equal(got[ids], want[ids])


def test_host_of_another_dtype_is_used_as_bytes() -> None:
    rng = np.random.default_rng(12)
    layers = random_layers(rng, 1, 4, 1, 2, 4, np.uint16)
    host_f32 = np.zeros(2 * bytes_per_slot(layers) // 4, dtype=np.float32)

    swap_cache_layout(layers, host_f32, [3], [1], MODE_DEVICE_TO_HOST)

    halves = host_f32.view(np.uint16).reshape(2, 2, 8)
    np.testing.assert_array_equal(halves[1, 0], layers[0][3].reshape(-1))
    np.testing.assert_array_equal(halves[1, 1], layers[1][3].reshape(-1))
    assert (halves[0] == 0).all()


def test_repeated_sources_are_allowed() -> None:
    # One block into two slots (mode 0) and one slot into two blocks (mode 1) are well defined.
    layers = [np.arange(8, dtype=np.uint8).reshape(4, 1, 1, 2) for _ in range(2)]
    host = np.zeros(3 * 4, dtype=np.uint8)
    swap_cache_layout(layers, host, [2, 2], [0, 2], MODE_DEVICE_TO_HOST)
    assert host.tolist() == [4, 5, 4, 5, 0, 0, 0, 0, 4, 5, 4, 5]

    target = poisoned_like(layers)
    swap_cache_layout(target, host, [1, 3], [2, 2], MODE_HOST_TO_DEVICE)
    assert target[0][[1, 3]].reshape(-1).tolist() == [4, 5, 4, 5]


def test_no_blocks_is_a_no_op() -> None:
    layers = [np.ones((2, 1, 1, 4), dtype=np.uint8) for _ in range(2)]
    host = poisoned_host(16)
    handle = swap_cache_layout(layers, host, [], [], MODE_DEVICE_TO_HOST)
    assert handle.done()
    assert (host == POISON_BYTE).all()


def test_host_tail_past_the_last_slot_is_untouched() -> None:
    rng = np.random.default_rng(13)
    layers = random_layers(rng, 1, 4, 1, 2, 3, np.uint8)  # 6-byte chunks, 12-byte slots
    host = poisoned_host(2 * 12 + 7)  # two slots and 7 spare bytes
    swap_cache_layout(layers, host, [3, 0], [1, 0], MODE_DEVICE_TO_HOST)
    assert host[:24].tolist() == [
        *layers[0][0].reshape(-1), *layers[1][0].reshape(-1),
        *layers[0][3].reshape(-1), *layers[1][3].reshape(-1),
    ]  # fmt: skip
    assert (host[24:] == POISON_BYTE).all()
