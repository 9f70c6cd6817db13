"""The runner seam: what the engine, the handoff and the host tier need of a model runner.

    engine  ->  runner.run(ScheduledBatch) -> RunnerOutput          one step (batch.py)
    pool, host tier, kernel  ->  runner.kv_caches  [K0, V0, K1, V1, ...]
                                 each [num_blocks, num_kv_heads, block_size, head_dim]

Two backends implement it, chosen once by workers/engine/runner_factory.py: the Paddle
ModelRunner (workers/engine/runner.py) and the PyTorch TorchModelRunner
(workers/engine/torch_runner.py). Nothing above the seam looks at which one it holds: the
scheduler, block pool, prefix cache, sampler, grammar, penalties and logprobs work on ints and
numpy, and the swap kernel reads raw pointers (kernels/tensor_refs.py), so both backends'
caches move through the pool in the same bytes and layout.
"""

from __future__ import annotations

from typing import Any, Protocol

from workers.engine.batch import RunnerOutput, ScheduledBatch
from workers.engine.config import ModelConfig
from workers.engine.step_input import StepInput, build_step_input


class Runner(Protocol):
    """The least the engine needs (a test's numpy runner implements only this)."""

    @property
    def kv_caches(self) -> Any:
        """[K0, V0, K1, V1, ...]: the cache tensors the forward writes in place."""
        ...

    # Returns once the batch's K/V writes have completed: a progress event is emitted right
    # after it and the caller copies those blocks out from another stream.
    def run(self, batch: ScheduledBatch) -> RunnerOutput: ...


class KVCacheAPI(Protocol):
    """A backend's paged KV cache (workers/engine/kv_cache.py, torch_kv_cache.py)."""

    num_blocks: int
    block_size: int
    num_layers: int
    # [K0, V0, K1, V1, ...], each [num_blocks, num_kv_heads, block_size, head_dim], updated
    # in place for the life of the runner (the kernel and the pool hold their addresses).
    tensors: list[Any]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src into dst in every layer's K and V, in order, for each (src, dst)."""
        ...

    @property
    def total_bytes(self) -> int: ...


class ModelRunnerAPI(Runner, Protocol):
    """A model runner of either backend: weights and paged cache on `device`, one forward."""

    config: ModelConfig
    block_size: int
    num_blocks: int
    # The --device string the runner was built for: "cpu", "gpu" or "gpu:N" (both backends).
    device: str
    kv_cache: KVCacheAPI
    # "paddle" or "torch": for logs and /health only, never for branching above the seam.
    backend: str

    @property
    def vocab_size(self) -> int: ...


class PagedRunner:
    """What both backends' runners (runner.ModelRunner, torch_runner.TorchModelRunner) derive
    from their own config and kv_cache alike."""

    config: ModelConfig
    kv_cache: KVCacheAPI

    @property
    def kv_caches(self) -> list[Any]:
        """[K0, V0, K1, V1, ...]: the tensors the decoder reads and writes in place."""
        return self.kv_cache.tensors

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


def begin_step(runner: ModelRunnerAPI, batch: ScheduledBatch) -> StepInput | None:
    """What both backends' run() does before the forward: the forks' block copies (before the
    forward writes into the copies: workers/engine/sequence_group.py), then the batch
    flattened; None for an empty batch. Raises ValueError naming the request of a malformed
    chunk."""
    if batch.is_empty:
        return None
    copies = [c.block_copy for c in batch.chunks if c.block_copy is not None]
    if copies:
        runner.kv_cache.copy_blocks(copies)
    return build_step_input(
        batch, runner.block_size, runner.num_blocks, runner.config.sliding_window
    )
