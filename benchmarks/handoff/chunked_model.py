"""A real model's chunked prefill for benchmarks.handoff.chunked (--model PATH): each chunk is
one TorchModelRunner step over that chunk's tokens, writing its blocks' KV into the runner's
paged cache, which P's pool client then copies out (the prefill worker's own loop, without
the server around it).

    python -m benchmarks.gpu.checkpoint /tmp/llama8b
    python -m benchmarks.handoff.chunked --model /tmp/llama8b --tokens 4096,16384 \\
        --chunks 512 --block-sizes 64 --paths device
"""

from __future__ import annotations

import functools
from typing import Any

from benchmarks.gpu.checkpoint import prompt_ids
from workers.engine.batch import ScheduledBatch, ScheduledChunk


@functools.cache
def _loaded(path: str) -> Any:
    """The checkpoint's weights on GPU 0, loaded once for every case of a run."""
    from workers.engine.loader import load_model

    return load_model(path, dtype="bfloat16", framework="torch", device="cuda:0")


def model_prefill(cp: Any, path: str, num_blocks: int, block_size: int) -> ModelPrefill:
    """P's side of one case: the model of `path` with a cache of num_blocks x block_size."""
    from workers.engine.torch_runner import TorchModelRunner

    runner = TorchModelRunner(_loaded(path), num_blocks, block_size, device="gpu")
    return ModelPrefill(cp, runner, block_size)


class ModelPrefill:
    """What chunked.Prefill offers run_case (kv_caches, pool, begin, chunk, layer_bits), with
    chunk() the model's forward over the chunk's blocks of the prompt."""

    def __init__(self, cp: Any, runner: Any, block_size: int) -> None:
        self.cp, self.runner, self.block_size = cp, runner, block_size
        self.kv_caches = runner.kv_caches
        self.pool: Any = None
        self.gemm_ms = 1.0  # no stand-in: run_case's GEMM count is unused
        self.prompt: tuple[int, ...] = ()
        self.num_prompts = 0

    def attach(self, pool: Any) -> ModelPrefill:
        self.pool = pool
        return self

    def begin(self, tokens: int) -> None:
        """A fresh prompt of `tokens` ids (no two prompts of a run share a token run)."""
        self.num_prompts += 1
        self.prompt = tuple(prompt_ids(tokens, self.num_prompts))

    def layer_bits(self, i: int, block_ids: list[int]) -> Any:
        import torch

        index = torch.tensor(block_ids, device=self.kv_caches[i].device)
        return self.cp.asarray(self.kv_caches[i].index_select(0, index).view(torch.int16)).view(
            self.cp.uint16
        )

    def chunk(self, num_gemms: int, block_ids: list[int]) -> None:
        """The forward over the tokens of block_ids (consecutive, from the prompt's start on
        over the calls), logits only after the last; returns with their KV written."""
        if not block_ids:
            return
        start = block_ids[0] * self.block_size
        end = min((block_ids[-1] + 1) * self.block_size, len(self.prompt))
        chunk = ScheduledChunk(
            "prefill",
            self.prompt[start:end],
            start,
            tuple(range(block_ids[-1] + 1)),
            need_logits=end == len(self.prompt),
        )
        self.runner.run(ScheduledBatch((chunk,)))
