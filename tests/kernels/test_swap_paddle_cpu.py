"""swap_cache_layout on Paddle CPU tensors: zero-copy through dlpack, bfloat16 included."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest

from kernels import MODE_DEVICE_TO_HOST, MODE_HOST_TO_DEVICE, bytes_per_slot, swap_cache_layout
from tests.kernels.reference import POISON_BYTE, poisoned_host, reference_swap

# Paddle (CPU) is a dependency here and in CI; the GPU machine has none (its tests reach the
# kernel through CuPy and PyTorch tensors instead): skip this module there, not fail collection.
paddle = pytest.importorskip("paddle", reason="Paddle is not installed (e.g. on the GPU machine)")

# Paddle dtype -> the same-width integer dtype its raw bits travel in (to_tensor, then view).
BIT_DTYPES = {"bfloat16": np.int16, "float16": np.int16, "float32": np.int32, "uint8": np.uint8}


def _paddle_from_bits(bits: np.ndarray, dtype: str) -> paddle.Tensor:
    tensor = paddle.to_tensor(bits)
    return tensor if dtype == "uint8" else tensor.view(dtype)


def _paddle_layers(rng: np.random.Generator, dtype: str, count: int, shape: tuple) -> list:
    # Random bit patterns below 2**(bits - 2): sign and top exponent bit stay clear, so no NaN
    # or inf whose payload a conversion might canonicalise.
    width = BIT_DTYPES[dtype]
    high = 256 if width == np.uint8 else 2 ** (8 * np.dtype(width).itemsize - 2)
    return [
        _paddle_from_bits(rng.integers(0, high, size=shape).astype(width), dtype)
        for _ in range(count)
    ]


def _poisoned_paddle(dtype: str, count: int, shape: tuple) -> list:
    width = BIT_DTYPES[dtype]
    return [
        _paddle_from_bits(
            np.full((*shape[:-1], shape[-1] * np.dtype(width).itemsize), POISON_BYTE, np.uint8)
            .view(width)
            .copy(),
            dtype,
        )
        for _ in range(count)
    ]


def _bits(tensor: paddle.Tensor) -> np.ndarray:
    width = {1: "uint8", 2: "int16", 4: "int32"}[tensor.element_size()]
    return tensor.view(width).numpy().copy()


@pytest.mark.parametrize("dtype", list(BIT_DTYPES))
def test_paddle_round_trip_in_place(dtype: str) -> None:
    rng = np.random.default_rng(21)
    shape = (7, 2, 4, 8)  # [num_blocks, kv_heads, block_size, head_dim]
    layers = _paddle_layers(rng, dtype, 4, shape)
    source_bits = [_bits(t) for t in layers]
    host = poisoned_host(5 * bytes_per_slot(layers))
    ids, slots = [6, 0, 3], [2, 4, 0]

    swap_cache_layout(layers, host, ids, slots, MODE_DEVICE_TO_HOST)

    expected = poisoned_host(host.nbytes)
    reference_swap(source_bits, expected, ids, slots, MODE_DEVICE_TO_HOST)
    np.testing.assert_array_equal(host, expected)

    targets = _poisoned_paddle(dtype, 4, shape)
    swap_cache_layout(targets, host, [1, 5, 2], slots, MODE_HOST_TO_DEVICE)

    for target, src in zip(targets, source_bits, strict=True):
        got = _bits(target)  # read back through Paddle: the copy landed in its memory
        np.testing.assert_array_equal(got[[1, 5, 2]], src[ids])
        assert (got[[0, 3, 4, 6]].view(np.uint8) == POISON_BYTE).all()


def test_paddle_slot_size_uses_element_size() -> None:
    layers = [paddle.zeros([3, 2, 16, 64], dtype="bfloat16") for _ in range(6)]
    assert bytes_per_slot(layers) == 6 * 2 * 16 * 64 * 2
