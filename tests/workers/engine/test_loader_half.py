"""Half-precision checkpoints loaded as float32: exact widening, logged once per load.

The packaged demo model is stored in float16 and served in float32 on the CPU (Paddle's CPU
kernels need it). Widening is exact, so the loaded values must equal the file's half values bit
for bit once widened, computed here independently of Paddle: numpy's float16 -> float32 cast,
and for bfloat16 the raw 16 bits shifted into the top of a float32.
"""

from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from workers.engine.loader import load_model
from workers.engine.tiny import TinySpec, make_weights, write_checkpoint

LOADER_LOG = "workers.engine.loader"


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _save_bf16(tensors: dict[str, np.ndarray], path) -> None:
    """A safetensors file of BF16 tensors (numpy has no bfloat16, so the format by hand:
    8-byte little-endian header length, JSON header, then the raw data)."""
    header, chunks, offset = {}, [], 0
    for name, bits in tensors.items():
        data = bits.astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(bits.shape),
                        "data_offsets": [offset, offset + len(data)]}  # fmt: skip
        chunks.append(data)
        offset += len(data)
    raw_header = json.dumps(header).encode()
    raw_header += b" " * (-len(raw_header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw_header)) + raw_header + b"".join(chunks))


@pytest.fixture(scope="module")
def float32_weights():
    return make_weights(TinySpec(), seed=5)


def _checkpoint(folder, weights: dict[str, np.ndarray] | None = None):
    write_checkpoint(folder, TinySpec(), seed=5)
    if weights is not None:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _conversion_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOADER_LOG]


def test_float16_checkpoint_loads_as_exact_float32(tmp_path, float32_weights, caplog):
    half = {k: v.astype(np.float16) for k, v in float32_weights.items()}
    folder = _checkpoint(tmp_path, half)
    with caplog.at_level(logging.INFO, logger=LOADER_LOG):
        loaded = load_model(str(folder))
    assert loaded.config.dtype == "float32"
    assert sorted(loaded.weights) == sorted(half)
    for name, value in half.items():
        got = loaded.weights[name].numpy()
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(got, value.astype(np.float32), err_msg=name)
    # The rounding to half precision really happened (the test would be vacuous otherwise).
    embed = float32_weights["model.embed_tokens.weight"]
    assert not np.array_equal(loaded.weights["model.embed_tokens.weight"].numpy(), embed)
    assert _conversion_records(caplog) == [
        f"{folder}: {len(half)} tensors stored as F16 converted to the model dtype float32 "
        "(--dtype)"
    ]


def test_bfloat16_checkpoint_loads_as_exact_float32(tmp_path, float32_weights, caplog):
    bits = {k: _to_bf16_bits(v) for k, v in float32_weights.items()}
    folder = _checkpoint(tmp_path)
    _save_bf16(bits, folder / "model.safetensors")
    with caplog.at_level(logging.INFO, logger=LOADER_LOG):
        loaded = load_model(str(folder))
    for name, value in bits.items():
        expected = (value.astype(np.uint32) << np.uint32(16)).view(np.float32)
        got = loaded.weights[name].numpy()
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(got, expected, err_msg=name)
    assert _conversion_records(caplog) == [
        f"{folder}: {len(bits)} tensors stored as BF16 converted to the model dtype float32 "
        "(--dtype)"
    ]


def test_float32_checkpoint_logs_no_conversion(tmp_path, float32_weights, caplog):
    folder = _checkpoint(tmp_path)
    with caplog.at_level(logging.INFO, logger=LOADER_LOG):
        loaded = load_model(str(folder))
    np.testing.assert_array_equal(
        loaded.weights["model.norm.weight"].numpy(), float32_weights["model.norm.weight"]
    )
    assert _conversion_records(caplog) == []


def test_float16_checkpoint_kept_as_float16(tmp_path, float32_weights, caplog):
    half = {k: v.astype(np.float16) for k, v in float32_weights.items()}
    folder = _checkpoint(tmp_path, half)
    with caplog.at_level(logging.INFO, logger=LOADER_LOG):
        loaded = load_model(str(folder), dtype="float16")
    np.testing.assert_array_equal(
        loaded.weights["model.norm.weight"].numpy(), half["model.norm.weight"]
    )
    assert _conversion_records(caplog) == []
