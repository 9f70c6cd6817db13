"""ModelRunner: runs one ScheduledBatch through the decoder and returns next-token logits.

    runner = ModelRunner(load_model("tiny"), num_blocks=256, block_size=16)
    out = runner.run(batch)        # RunnerOutput(logits=float32 [chunks needing logits, vocab])
    runner.kv_caches               # [K0, V0, K1, V1, ...], each [num_blocks, kv_heads, bs, dim]

The runner owns the device placement, the weights and the KV cache; it knows nothing of
requests beyond the chunks it is handed (the scheduler owns blocks and sampling).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from workers.engine.batch import RunnerOutput, ScheduledBatch
from workers.engine.kv_cache import KVCache
from workers.engine.loader import LoadedModel
from workers.engine.runner_api import PagedRunner, begin_step


class ModelRunner(PagedRunner):
    """The data plane of one engine on Paddle: decoder weights on the device plus the paged KV
    cache (runner_api.ModelRunnerAPI; torch_runner.TorchModelRunner is the PyTorch twin).

    Not thread-safe: one engine thread calls run(). The caller may drop the LoadedModel once
    this is built (the decoder keeps fused copies, so the loaded tensors are no longer needed).
    """

    backend = "paddle"

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        device: str = "cpu",
        all_reduce: Callable[[Any], Any] | None = None,
    ) -> None:
        """Place the weights on `device` (a Paddle device string: "cpu", "gpu", "gpu:1")
        and allocate a zeroed cache of `num_blocks` blocks of `block_size` tokens.
        all_reduce: a tensor-parallel rank's (loaded is then its shard: workers/engine/tp/)."""
        from workers.engine.model import LlamaDecoder
        from workers.engine.paddle_runtime import paddle

        if device.startswith("cpu") and loaded.config.dtype != "float32":
            # Paddle's CPU kernels (matmul, gather) are registered for float32 only.
            raise ValueError(
                f"dtype {loaded.config.dtype!r} needs a GPU device; on {device!r} use float32"
            )
        paddle.set_device(device)
        if device.startswith("cpu"):
            _prefer_fast_mkl_path_on_amd()
        self.config = loaded.config
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        weights = {name: _to_device(t, device) for name, t in loaded.weights.items()}
        # No sequence can outgrow its blocks, so rope tables need not cover more positions.
        max_positions = min(self.config.max_position_embeddings, num_blocks * block_size)
        self.model = LlamaDecoder(
            self.config, weights, max_positions=max_positions, all_reduce=all_reduce
        )
        self.kv_cache = KVCache(self.config, num_blocks, block_size)

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        """Compute every chunk's K/V into the cache and the logits after each chunk that
        needs them; returns once the K/V writes have completed on the device. Raises
        ValueError naming the request of a malformed chunk."""
        step = begin_step(self, batch)
        if step is None:
            return RunnerOutput(logits=np.zeros((0, self.vocab_size), dtype=np.float32))
        logits = self.model.forward(step, self.kv_caches)
        if logits.shape[0] == 0 and not self.device.startswith("cpu"):
            # Returned means written: the prefill worker copies a chunk's blocks out on its
            # own stream as soon as the step that computed them is over (a step with logits
            # waits for the stream in .numpy() below).
            from workers.engine.paddle_runtime import paddle

            paddle.device.synchronize()
        return RunnerOutput.from_rows(batch, logits.numpy())


def _prefer_fast_mkl_path_on_amd() -> None:
    """Paddle's CPU matmul is MKL, which takes a generic slow path on AMD CPUs unless told
    otherwise: measured 3.5x slower GEMMs on this project's AMD EPYC hosts (4.0 vs 1.2 ms for
    [32, 512] x [512, 2816]). MKL reads the variable at its first GEMM, so setting it here,
    before the first forward, is enough; a value the user set is kept, Intel CPUs are untouched.
    """
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            is_amd = "AuthenticAMD" in f.read(4096)
    except OSError:
        return
    if is_amd:
        os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")


def _to_device(tensor: Any, device: str) -> Any:
    if device == "cpu":
        return tensor
    return tensor.to(device)
