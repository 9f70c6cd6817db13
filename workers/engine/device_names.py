"""--device spellings: the worker's ("cpu", "gpu", "gpu:N", Paddle's) and torch's.

Both runner backends take the worker's spelling, so `--device` means the same whatever
--engine-backend is; the PyTorch runner translates it here ("gpu:N" -> "cuda:N").
"""

from __future__ import annotations


def is_gpu_device(device: str) -> bool:
    return device == "gpu" or device.startswith("gpu:")


def torch_device_name(device: str) -> str:
    """--device ("cpu", "gpu", "gpu:N") as torch spells it ("cpu", "cuda:0", "cuda:N")."""
    if device == "cpu":
        return "cpu"
    if device == "gpu":
        return "cuda:0"
    if device.startswith("gpu:") and device[4:].isdigit():
        return f"cuda:{int(device[4:])}"
    raise ValueError(f"--device {device!r}: use 'cpu', 'gpu' or 'gpu:N'")
