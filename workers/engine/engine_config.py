"""EngineConfig: every setting of one engine, built once at the edge (CLI) and passed down."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. max_model_len None means: the model's max_position_embeddings,
    capped so that one sequence always fits the KV pool (num_kv_blocks * block_size)."""

    model: str = "tiny"
    dtype: str = "float32"
    seed: int = 0  # seeds the tiny checkpoint's weights, not sampling
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    device: str = "cpu"
    cache_dir: str | None = None  # where tiny checkpoints are materialized
    # Keep full blocks' KV after their requests end and reuse it for the same prefix
    # (workers/engine/prefix_cache.py); off, the block pool is a plain FIFO allocator.
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(
                f"EngineConfig.dtype must be float32, float16 or bfloat16, got {self.dtype!r}"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        """The max_model_len to run with for a model of max_position_embeddings positions."""
        cap = min(max_position_embeddings, self.kv_capacity_tokens)
        if self.max_model_len is None:
            return cap
        if self.max_model_len > cap:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds what this engine can hold: the "
                f"model has {max_position_embeddings} positions and the KV pool "
                f"{self.num_kv_blocks} blocks x {self.block_size} = {self.kv_capacity_tokens} "
                "tokens"
            )
        return self.max_model_len
