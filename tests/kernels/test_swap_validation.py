"""Every unusable argument of swap_cache_layout raises SwapLayoutError naming it, before any
byte moves."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import (
    DeviceBuffer,
    HostBuffer,
    SwapLayoutError,
    bytes_per_slot,
    slot_bytes,
    swap_cache_layout,
)
from tests.kernels.reference import POISON_BYTE, poisoned_host

NUM_BLOCKS = 6
SLOT_BYTES = 64  # 2 layers x (K, V) x 1 head x block 2 x dim 4 x 2-byte elements


def _layers(count: int = 4, dtype: type = np.float16) -> list[np.ndarray]:
    return [np.full((NUM_BLOCKS, 1, 2, 4), j, dtype=dtype) for j in range(count)]


def _expect(match: str, *args: object, **kwargs: object) -> None:
    with pytest.raises(SwapLayoutError, match=match):
        swap_cache_layout(*args, **kwargs)  # type: ignore[arg-type]


def test_slot_size_matches_geometry() -> None:
    assert bytes_per_slot(_layers()) == SLOT_BYTES == slot_bytes(2, 1, 2, 4, 2)


@pytest.mark.parametrize("mode", [2, -1, True, "0", None])
def test_bad_mode(mode: object) -> None:
    _expect("mode must be 0", _layers(), poisoned_host(SLOT_BYTES), [0], [0], mode)


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ([], r"an even, non-zero count\), got 0"),
        (_layers(3), r"an even, non-zero count\), got 3"),
        (np.zeros((2, NUM_BLOCKS, 1, 2, 4), np.float16), "must be a list"),
        ([np.zeros((6, 2, 4), np.float16)] * 2, r"got shape \(6, 2, 4\)"),
        ([np.zeros((6, 1, 0, 4), np.float16)] * 2, "positive sizes"),
        (_layers(4, np.float64), "8-byte elements"),
        (_layers(2) + [np.zeros((NUM_BLOCKS, 1, 2, 5), np.float16)] * 2, r"\[2\] has shape"),
        (_layers(2) + _layers(2, np.float32), r"\[2\] has 4-byte elements"),
        ([*_layers(1), np.zeros((4, 2, 1, NUM_BLOCKS), np.float16).T], r"\[1\] must be C-cont"),
        ([[[[[0]]]]] * 2, "is a list; expected a numpy array"),
    ],
    ids=["empty", "odd", "ndarray", "3d", "zero-dim", "8-byte", "shape", "elem", "strided", "list"],
)
def test_bad_layer_tensors(layers: object, match: str) -> None:
    _expect(match, layers, poisoned_host(4 * SLOT_BYTES), [0], [0], 0)


def test_misaligned_layer_tensor() -> None:
    backing = np.zeros(NUM_BLOCKS * 8 * 2 + 1, dtype=np.uint8)
    odd = backing[1:].view(np.float16).reshape(NUM_BLOCKS, 1, 2, 4)
    _expect(
        r"layer_tensors\[1\] address .* not aligned", [_layers(1)[0], odd], backing, [0], [0], 0
    )


@pytest.mark.parametrize(
    ("ids", "slots", "match"),
    [
        (
            [NUM_BLOCKS],
            [0],
            r"device_block_ids\[0\] = 6 is out of range \[0, 6\): the cache has 6 blocks",
        ),
        ([0, -1], [0, 1], r"device_block_ids\[1\] = -1 is out of range"),
        (
            [0],
            [3],
            r"host_slots\[0\] = 3 is out of range \[0, 3\): the host buffer of 192 bytes "
            "holds 3 slots of 64",
        ),
        ([0], [-2], r"host_slots\[0\] = -2 is out of range"),
        ([0, 1], [0], "has 2 entries but host_slots has 1"),
        ([0.0], [0], "must hold integers, got dtype float64"),
        ([[0]], [[0]], r"1-D sequence of ints, got shape \(1, 1\)"),
        ([0, 1], [2, 2], "host_slots repeats 2: two blocks would be written into one host slot"),
    ],
)
def test_bad_ids_and_slots_device_to_host(ids: list, slots: list, match: str) -> None:
    host = poisoned_host(3 * SLOT_BYTES)
    _expect(match, _layers(), host, ids, slots, 0)
    assert (host == POISON_BYTE).all()


def test_repeated_destination_block_host_to_device() -> None:
    layers = _layers()
    _expect("device_block_ids repeats 4: two slots would be written", layers,
            poisoned_host(3 * SLOT_BYTES), [4, 1, 4], [0, 1, 2], 1)  # fmt: skip
    assert all((t == j).all() for j, t in enumerate(layers))


@pytest.mark.parametrize(
    ("host", "match"),
    [
        (poisoned_host(SLOT_BYTES - 1), "smaller than one slot"),
        (np.zeros(0, np.uint8), "host buffer is empty"),
        (poisoned_host(4 * SLOT_BYTES)[::2], "host buffer must be C-contiguous"),
        (bytearray(4 * SLOT_BYTES), "host buffer is a bytearray"),
        (HostBuffer(0, 4 * SLOT_BYTES), "non-null address"),
        (poisoned_host(4 * SLOT_BYTES + 1)[1:], "host buffer address .* not aligned"),
    ],
    ids=["small", "empty", "strided", "bytearray", "null", "misaligned"],
)
def test_bad_host(host: object, match: str) -> None:
    _expect(match, _layers(), host, [0], [0], 0)


def test_read_only_host_for_device_to_host() -> None:
    host = poisoned_host(2 * SLOT_BYTES)
    host.flags.writeable = False
    _expect("read-only but mode 0", _layers(), host, [0], [0], 0)
    swap_cache_layout(_layers(), host, [0], [0], 1)  # reading it is fine


def test_device_buffer_with_cpu_tensors() -> None:
    _expect(
        "DeviceBuffer .* on the CPU", _layers(), DeviceBuffer(4096, 4 * SLOT_BYTES), [0], [0], 0
    )


def test_stream_with_cpu_tensors() -> None:
    _expect("GPU layer tensors only", _layers(), poisoned_host(SLOT_BYTES), [0], [0], 0, stream=7)


@pytest.mark.parametrize(
    "args", [(0, 1, 1, 1, 2), (1, -1, 1, 1, 2), (1, 1, 1, 1, 8), (1, 1, 1, 1, 3)]
)
def test_bad_slot_bytes_arguments(args: tuple[int, ...]) -> None:
    with pytest.raises(SwapLayoutError):
        slot_bytes(*args)
