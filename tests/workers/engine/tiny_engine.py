"""LLMEngines over the tiny Paddle model for tests (see the `loaded` fixture in conftest.py),
and readers of engine outputs."""

from __future__ import annotations

from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig


def tokens_of(outputs: list) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def real_engine(
    loaded,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    prefix_cache: bool = True,
) -> LLMEngine:
    from workers.engine.runner import ModelRunner

    config = EngineConfig(
        model="tiny",
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_model_len=num_blocks * block_size,
        enable_prefix_cache=prefix_cache,
    )
    runner = ModelRunner(loaded, num_blocks, block_size)
    return LLMEngine(runner, loaded.tokenizer, config, loaded.config.vocab_size, loaded.config)


def encoded(loaded, text: str) -> tuple[int, ...]:
    return tuple(loaded.tokenizer.encode(text))
