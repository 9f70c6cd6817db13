"""build_runner: the one place that picks the runner backend (--engine-backend) and builds it.

    auto   GPU --device:  paddle where paddlepaddle-gpu is installed (Paddle built with
                          CUDA), else torch where torch sees a CUDA GPU, else an error
           --device cpu:  paddle (the CPU engine), or torch on a host with torch and no
                          Paddle at all
    paddle -> workers/engine/runner.py        ModelRunner
    torch  -> workers/engine/torch_runner.py  TorchModelRunner

`--device` means the same to both backends: "cpu", "gpu" (the first GPU) or "gpu:N"; torch
runs on "cuda:N". Each framework is imported only when its backend is chosen (a probe for
auto reads installed-package metadata first, so a CPU auto process imports neither twice).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.engine.device_names import is_gpu_device, torch_device_name
from workers.engine.engine_config import ENGINE_BACKENDS, EngineConfig

if TYPE_CHECKING:
    from workers.engine.loader import LoadedModel
    from workers.engine.runner_api import ModelRunnerAPI

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendProbe:
    """What auto resolution looks at, gathered once (tests give their own)."""

    paddle_gpu_installed: bool  # the paddlepaddle-gpu distribution
    torch_installed: bool
    torch_sees_cuda: Callable[[], bool]  # called only when it decides
    paddle_installed: bool = True  # paddle importable (a CPU or GPU build)

    @classmethod
    def of_this_host(cls) -> BackendProbe:
        return cls(
            paddle_gpu_installed=_distribution_installed("paddlepaddle-gpu"),
            torch_installed=importlib.util.find_spec("torch") is not None,
            torch_sees_cuda=_torch_sees_cuda,
            paddle_installed=importlib.util.find_spec("paddle") is not None,
        )


def resolve_backend(backend: str, device: str, probe: BackendProbe | None = None) -> str:
    """The backend ("paddle" or "torch") that --engine-backend `backend` means on this host
    for --device `device`."""
    if backend not in ENGINE_BACKENDS:
        raise ValueError(f"--engine-backend {backend!r}: use one of {', '.join(ENGINE_BACKENDS)}")
    if backend != "auto":
        return backend
    probe = probe or BackendProbe.of_this_host()
    if not is_gpu_device(device):
        return "torch" if probe.torch_installed and not probe.paddle_installed else "paddle"
    if probe.paddle_gpu_installed:
        return "paddle"
    if probe.torch_installed and probe.torch_sees_cuda():
        return "torch"
    raise ValueError(
        f"--device {device} with --engine-backend auto: neither paddlepaddle-gpu is installed "
        "nor does torch see a CUDA GPU; install one (make install-gpu, or make install-gpu "
        "BACKEND=torch) or run with --device cpu"
    )


def build_runner(config: EngineConfig) -> tuple[ModelRunnerAPI, LoadedModel]:
    """(the runner config asks for, the LoadedModel without its weights: config, tokenizer)."""
    backend = resolve_backend(config.engine_backend, config.device)
    log.info(
        "model runner: %s backend (--engine-backend %s) on --device %s, %s",
        backend,
        config.engine_backend,
        config.device,
        config.dtype,
    )
    if backend == "torch":
        if config.tensor_parallel_size > 1:
            raise ValueError(
                "--tensor-parallel-size > 1 runs on the Paddle backend only; the torch "
                "backend has no ranks yet (use --engine-backend paddle)"
            )
        from workers.engine.loader import load_model
        from workers.engine.torch_runner import TorchModelRunner

        loaded = load_model(
            config.model,
            dtype=config.dtype,
            seed=config.seed,
            cache_dir=config.cache_dir,
            framework="torch",
            device=torch_device_name(config.device),
        )
        runner: ModelRunnerAPI = TorchModelRunner(
            loaded,
            config.num_kv_blocks,
            config.block_size,
            config.device,
            cuda_graphs=config.cuda_graphs and is_gpu_device(config.device),
            decode_attention=config.decode_attention,
        )
        return runner, dataclasses.replace(loaded, weights={})
    try:
        from workers.engine.loader import load_model
        from workers.engine.runner import ModelRunner
    except ImportError as exc:
        raise ImportError(
            f"the engine needs Paddle ({exc}); install it with: pip install -e '.[cpu]' "
            "(or '.[gpu]' on a CUDA host), or run with --engine-backend torch"
        ) from exc
    if config.tensor_parallel_size > 1:
        from workers.engine.tp.runner import TPRunner

        tp_runner, whole = TPRunner.start(config)
        return tp_runner, whole
    loaded = load_model(
        config.model, dtype=config.dtype, seed=config.seed, cache_dir=config.cache_dir
    )
    runner = ModelRunner(loaded, config.num_kv_blocks, config.block_size, config.device)
    return runner, dataclasses.replace(loaded, weights={})


def _distribution_installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _torch_sees_cuda() -> bool:
    from workers.engine.torch_runtime import torch

    return bool(torch.cuda.is_available())
