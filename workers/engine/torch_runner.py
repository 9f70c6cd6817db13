"""TorchModelRunner: the PyTorch backend of the runner seam (workers/engine/runner_api.py).

    loaded = load_model("demo", framework="torch", device=torch_device_name("gpu"))
    runner = TorchModelRunner(loaded, num_blocks=256, block_size=16, device="gpu")
    out = runner.run(batch)        # RunnerOutput(logits=float32 [chunks needing logits, vocab])
    runner.kv_caches               # [K0, V0, K1, V1, ...], each [num_blocks, kv_heads, bs, dim]

The same contract as the Paddle ModelRunner: the same StepInput (step_input.py), the same
decoder math (torch_model.py), the same cache layout (torch_kv_cache.py), returned logits as
float32 numpy. `device` takes the worker's --device spelling ("cpu", "gpu", "gpu:N").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from workers.engine.batch import RunnerOutput, ScheduledBatch
from workers.engine.config import ModelConfig
from workers.engine.device_names import torch_device_name
from workers.engine.loader import LoadedModel
from workers.engine.runner_api import PagedRunner, begin_step
from workers.engine.torch_graphs import DecodeGraphs
from workers.engine.torch_kv_cache import TorchKVCache
from workers.engine.torch_model import TorchLlamaDecoder
from workers.engine.torch_runtime import torch


class TorchModelRunner(PagedRunner):
    """Decoder weights on a torch device plus the paged KV cache. Not thread-safe: one engine
    thread calls run(). The caller may drop the LoadedModel once this is built."""

    backend = "torch"

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        device: str = "cpu",
        all_reduce: Callable[[Any], Any] | None = None,
        cuda_graphs: bool = False,
        decode_attention: str = "sdpa",
    ) -> None:
        """loaded: from load_model(..., framework="torch"); its tensors are moved to `device`
        if they are elsewhere. Allocates a zeroed cache of `num_blocks` x `block_size` tokens.
        all_reduce: a tensor-parallel rank's sum over ranks (loaded is then its shard).
        cuda_graphs: replay plain decode steps as CUDA graphs per shape bucket
        (torch_graphs.py); on the CPU the same padded steps run eagerly (how tests check it).
        decode_attention: "sdpa" (gather the blocks, then SDPA) or "triton" (decodes read the
        cache in place: paged_decode.py; block_size >= 16, no sliding window)."""
        first = next(iter(loaded.weights.values()), None)
        if first is not None and not isinstance(first, torch.Tensor):
            raise TypeError(
                f"TorchModelRunner needs torch weights, got {type(first).__module__} tensors: "
                "load with load_model(..., framework='torch')"
            )
        self.config = loaded.config
        self.device = device
        self.torch_device = torch.device(torch_device_name(device))
        if self.torch_device.type == "cuda":
            torch.cuda.set_device(self.torch_device)  # the kernels' streams and CuPy's
        self.block_size = block_size
        self.num_blocks = num_blocks
        weights = {name: t.to(self.torch_device) for name, t in loaded.weights.items()}
        # No sequence can outgrow its blocks, so rope tables need not cover more positions.
        max_positions = min(self.config.max_position_embeddings, num_blocks * block_size)
        self.model = TorchLlamaDecoder(
            self.config,
            weights,
            max_positions=max_positions,
            all_reduce=all_reduce,
            paged_decode=_paged_decode(decode_attention, self.config, block_size),
        )
        self.kv_cache = TorchKVCache(self.config, num_blocks, block_size, self.torch_device)
        self.graphs = None
        if cuda_graphs:
            capture = self.torch_device.type == "cuda"
            self.graphs = DecodeGraphs(self.model, self.kv_cache, capture=capture)

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        """Compute every chunk's K/V into the cache and the logits after each chunk that
        needs them; returns once the K/V writes have completed on the device. Raises
        ValueError naming the request of a malformed chunk."""
        step = begin_step(self, batch)
        if step is None:
            return RunnerOutput(logits=np.zeros((0, self.vocab_size), dtype=np.float32))
        if self.graphs is not None and self.graphs.fits(step):
            logits = self.graphs.run(step)
        else:
            logits = self.model.forward(step, self.kv_caches)
        if logits.shape[0] == 0 and self.torch_device.type == "cuda":
            # Returned means written: the prefill worker copies a chunk's blocks out on its
            # own stream as soon as the step that computed them is over (a step with logits
            # waits for the stream in the blocking .cpu() below).
            torch.cuda.current_stream(self.torch_device).synchronize()
        return RunnerOutput.from_rows(batch, logits.cpu().numpy())


def _paged_decode(decode_attention: str, config: ModelConfig, block_size: int) -> bool:
    """Whether decodes go through the Triton paged kernel; raises for a choice that cannot."""
    if decode_attention == "sdpa":
        return False
    if decode_attention != "triton":
        raise ValueError(f"--decode-attention {decode_attention!r}: use sdpa or triton")
    from workers.engine.paged_decode import supports

    if not supports(block_size, config.head_dim, config.sliding_window):
        raise ValueError(
            f"--decode-attention triton needs a power-of-two --block-size >= 16 (got "
            f"{block_size}), a power-of-two head_dim (got {config.head_dim}) and no sliding "
            f"window (got {config.sliding_window})"
        )
    return True
