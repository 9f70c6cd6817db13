"""--engine-backend: auto's resolution on every kind of host, the --device spelling torch gets,
and the flag with its environment mirror. Pure: neither framework is imported."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdrouter.common.flags import add_flags, from_args
from tests.repo import REPO_ROOT
from workers.engine.device_names import torch_device_name
from workers.engine.engine_config import EngineConfig
from workers.engine.runner_factory import BackendProbe, resolve_backend


def _probe(
    paddle_gpu: bool, torch_installed: bool, cuda: bool, paddle: bool = True
) -> BackendProbe:
    def sees_cuda() -> bool:
        assert torch_installed, "torch probed for CUDA where it is not installed"
        return cuda

    return BackendProbe(paddle_gpu, torch_installed, sees_cuda, paddle_installed=paddle)


@pytest.mark.parametrize(
    ("device", "paddle_gpu", "torch_installed", "cuda", "expected"),
    [
        ("gpu", True, True, True, "paddle"),  # paddlepaddle-gpu wins where installed
        ("gpu", False, True, True, "torch"),  # the usual GPU host: torch with CUDA
        ("gpu:1", False, True, True, "torch"),
        ("cpu", False, True, True, "paddle"),  # Paddle is the CPU engine
        ("cpu", True, True, True, "paddle"),
        ("cpu", False, False, False, "paddle"),
    ],
)
def test_auto_resolution(device, paddle_gpu, torch_installed, cuda, expected):
    probe = _probe(paddle_gpu, torch_installed, cuda)
    assert resolve_backend("auto", device, probe) == expected


def test_auto_on_the_cpu_of_a_host_with_torch_and_no_paddle_takes_torch():
    assert resolve_backend("auto", "cpu", _probe(False, True, False, paddle=False)) == "torch"
    # Neither installed: paddle, whose import then says what to install.
    assert resolve_backend("auto", "cpu", _probe(False, False, False, paddle=False)) == "paddle"


@pytest.mark.parametrize(("torch_installed", "cuda"), [(True, False), (False, False)])
def test_auto_on_a_gpu_device_without_either_gpu_framework_says_what_to_install(
    torch_installed, cuda
):
    with pytest.raises(ValueError) as err:
        resolve_backend("auto", "gpu", _probe(False, torch_installed, cuda))
    assert str(err.value) == (
        "--device gpu with --engine-backend auto: neither paddlepaddle-gpu is installed nor "
        "does torch see a CUDA GPU; install one (make install-gpu, or make install-gpu "
        "BACKEND=torch) or run with --device cpu"
    )


def test_explicit_backends_are_kept_and_bad_ones_refused():
    never = _probe(False, False, False)
    assert resolve_backend("torch", "cpu", never) == "torch"
    assert resolve_backend("paddle", "gpu", never) == "paddle"
    with pytest.raises(ValueError, match="--engine-backend 'jax': use one of auto, paddle, torch"):
        resolve_backend("jax", "cpu", never)
    with pytest.raises(ValueError, match="engine_backend must be one of auto, paddle, torch"):
        EngineConfig(engine_backend="jax")


def test_device_spelling_for_torch():
    assert [torch_device_name(d) for d in ("cpu", "gpu", "gpu:0", "gpu:3")] == [
        "cpu", "cuda:0", "cuda:0", "cuda:3"]  # fmt: skip
    with pytest.raises(ValueError, match="--device 'cuda:1': use 'cpu', 'gpu' or 'gpu:N'"):
        torch_device_name("cuda:1")


def test_flag_and_default():
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    assert from_args(EngineConfig, parser.parse_args([])).engine_backend == "auto"
    args = parser.parse_args(["--engine-backend", "torch"])
    assert from_args(EngineConfig, args).engine_backend == "torch"
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine-backend", "jax"])


def test_environment_mirror_reaches_pdworker_help():
    """PDWORKER_ENGINE_BACKEND is parsed like the flag: a bad value fails with exit 2."""
    env = {"PDWORKER_ENGINE_BACKEND": "jax", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "workers.cli", "serve", "--role", "mixed"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "argument --engine-backend: invalid choice: 'jax'" in proc.stderr
    assert "PDWORKER_ENGINE_BACKEND" in proc.stderr


def test_torch_backend_refuses_tensor_parallel_ranks_before_loading():
    from workers.engine.runner_factory import build_runner

    config = EngineConfig(engine_backend="torch", tensor_parallel_size=2)
    with pytest.raises(ValueError) as err:
        build_runner(config)
    assert str(err.value) == (
        "--tensor-parallel-size > 1 runs on the Paddle backend only; the torch backend has no "
        "ranks yet (use --engine-backend paddle)"
    )
