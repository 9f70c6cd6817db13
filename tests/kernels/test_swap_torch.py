"""swap_cache_layout on PyTorch cache tensors (the torch runner's): CPU tensors zero-copy
through a same-width integer view (bfloat16 included), equal to the element-loop reference;
CUDA tensors through their device pointer (marker gpu, skipped without a GPU and CuPy)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import (
    MODE_DEVICE_TO_HOST,
    MODE_HOST_TO_DEVICE,
    SwapLayoutError,
    bytes_per_slot,
    swap_cache_layout,
)
from tests.kernels.reference import POISON_BYTE, poisoned_host, reference_swap

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

# torch dtype -> the integer dtype of the same width its raw bits are made in.
BITS = {"bfloat16": np.int16, "float16": np.int16, "float32": np.int32, "uint8": np.uint8}
SHAPE = (7, 2, 4, 8)  # [num_blocks, kv_heads, block_size, head_dim]


def _layers(rng: np.random.Generator, dtype: str, count: int) -> list[np.ndarray]:
    # Below 2**(bits - 2): no NaN or inf whose payload a conversion might canonicalise.
    width = BITS[dtype]
    high = 256 if width == np.uint8 else 2 ** (8 * np.dtype(width).itemsize - 2)
    return [rng.integers(0, high, size=SHAPE).astype(width) for _ in range(count)]


def _torch(bits: np.ndarray, dtype: str):
    tensor = torch.from_numpy(bits.copy())
    return tensor if dtype == "uint8" else tensor.view(getattr(torch, dtype))


def _bits(tensor) -> np.ndarray:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()]
    return tensor.cpu().view(width).numpy().copy()


@pytest.mark.parametrize("dtype", list(BITS))
def test_torch_cpu_round_trip_equals_the_reference(dtype: str) -> None:
    rng = np.random.default_rng(5)
    bits = _layers(rng, dtype, 4)  # two layers, K and V
    caches = [_torch(b, dtype) for b in bits]
    ids, slots = [6, 0, 3], [2, 0, 4]
    host = poisoned_host(5 * bytes_per_slot(caches))
    assert swap_cache_layout(caches, host, ids, slots, MODE_DEVICE_TO_HOST).wait() is None
    want = poisoned_host(host.nbytes)
    reference_swap([b.copy() for b in bits], want, ids, slots, MODE_DEVICE_TO_HOST)
    assert np.array_equal(host, want)

    back_bits = [np.full(SHAPE, 0, BITS[dtype]) for _ in range(4)]
    for b in back_bits:
        b.view(np.uint8)[...] = POISON_BYTE
    back = [_torch(b, dtype) for b in back_bits]
    swap_cache_layout(back, host, [1, 5, 2], slots, MODE_HOST_TO_DEVICE).wait()
    reference_swap(back_bits, host, [1, 5, 2], slots, MODE_HOST_TO_DEVICE)
    for mine, theirs in zip(back, back_bits, strict=True):
        assert np.array_equal(_bits(mine), theirs)  # moved blocks and untouched poison alike


def test_a_non_contiguous_torch_tensor_is_refused_by_name() -> None:
    caches = [torch.zeros(SHAPE) for _ in range(2)]
    caches[1] = torch.zeros((7, 2, 8, 4)).transpose(2, 3)
    with pytest.raises(SwapLayoutError, match=r"layer_tensors\[1\] must be contiguous"):
        bytes_per_slot(caches)


@pytest.mark.gpu
def test_torch_cuda_tensors_go_through_pinned_host_memory() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU visible to torch")
    pytest.importorskip("cupy", reason="the CUDA kernel is launched through CuPy")
    from kernels.pinned_host import PinnedHostBuffer

    rng = np.random.default_rng(9)
    bits = _layers(rng, "bfloat16", 4)
    caches = [_torch(b, "bfloat16").cuda() for b in bits]
    slot = bytes_per_slot(caches)
    pinned = PinnedHostBuffer(4 * slot)
    try:
        host = pinned.buffer
        swap_cache_layout(caches, host, [6, 1], [3, 0], MODE_DEVICE_TO_HOST).wait()
        back = [torch.zeros_like(c) for c in caches]
        swap_cache_layout(back, host, [2, 4], [3, 0], MODE_HOST_TO_DEVICE).wait()
        for mine, theirs in zip(back, caches, strict=True):
            assert torch.equal(mine[2], theirs[6]) and torch.equal(mine[4], theirs[1])
            assert not mine[[0, 1, 3, 5, 6]].any()
    finally:
        torch.cuda.synchronize()
        pinned.close()
