"""TPRunner: rank 0's runner; every step goes to every rank, and each computes its shard.

    engine thread (rank 0)   run(batch): send batch to ranks 1..N-1, run it on rank 0's shard
    rank r (peer.py)         recv batch, run it on rank r's shard
    inside the step          the all-reduce after o_proj and down_proj meets every rank

Every rank builds the same StepInput from the same ScheduledBatch, so the collectives pair up
in order; only rank 0's logits are used (after the last all-reduce every rank holds the same
hidden states). Each rank's KV cache holds its own heads: [num_blocks, H / N, bs, head_dim].
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.engine.batch import RunnerOutput, ScheduledBatch
from workers.engine.config import ModelConfig
from workers.engine.engine_config import EngineConfig
from workers.engine.kv_cache import KVCache
from workers.engine.loader import LoadedModel, load_model, model_folder
from workers.engine.runner import ModelRunner
from workers.engine.tp.group import TPGroup, all_reduce, rank_device
from workers.engine.tp.sharding import shard_config, shard_selector


def load_rank(config: EngineConfig, rank: int) -> tuple[LoadedModel, LoadedModel]:
    """(the whole model's LoadedModel without weights, rank's shard): only the rank's slices
    of the sharded tensors are read from the checkpoint."""
    tp = config.tensor_parallel_size
    loaded = load_model(
        config.model,
        dtype=config.dtype,
        seed=config.seed,
        cache_dir=config.cache_dir,
        select_for=lambda full: shard_selector(full, rank, tp),
    )
    shard = dataclasses.replace(loaded, config=shard_config(loaded.config, tp))
    return dataclasses.replace(loaded, weights={}), shard


def rank_runner(config: EngineConfig, rank: int) -> tuple[LoadedModel, ModelRunner]:
    whole, shard = load_rank(config, rank)
    device = rank_device(config.device, rank)
    runner = ModelRunner(
        shard, config.num_kv_blocks, config.block_size, device, all_reduce=all_reduce
    )
    return whole, runner


class TPRunner:
    """The engine's runner on rank 0 of a tensor-parallel worker (runner_api.ModelRunnerAPI,
    the rest of it rank 0's ModelRunner's)."""

    def __init__(self, local: ModelRunner, group: TPGroup, tp_size: int) -> None:
        self.local, self.group, self.tp_size = local, group, tp_size

    @classmethod
    def start(cls, config: EngineConfig) -> tuple[TPRunner, LoadedModel]:
        """Spawn and join the ranks, load rank 0's shard, wait for every rank's."""
        tp = config.tensor_parallel_size
        folder, model_id = model_folder(config.model, config.seed, config.cache_dir)
        # A size the model cannot split fails here, before any rank starts.
        shard_config(ModelConfig.from_dir(folder, model_id=model_id, dtype=config.dtype), tp)
        group, _ = TPGroup.start(tp, engine=dataclasses.asdict(config))
        try:
            whole, local = rank_runner(config, 0)
            group.wait_ready()
        except BaseException:
            group.stop()  # a model this size cannot split (tp_problem), a rank that failed
            raise
        return cls(local, group, tp), whole

    backend = "paddle"

    @property
    def kv_caches(self) -> list[Any]:
        """Rank 0's cache: its own heads of every block."""
        return self.local.kv_caches

    @property
    def kv_cache(self) -> KVCache:
        return self.local.kv_cache

    @property
    def config(self) -> ModelConfig:
        """Rank 0's shard's config (its KV heads: those of its cache)."""
        return self.local.config

    @property
    def block_size(self) -> int:
        return self.local.block_size

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def device(self) -> str:
        return self.local.device

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        if batch.is_empty:
            return self.local.run(batch)
        self.group.send_step(batch)
        return self.local.run(batch)
