"""LLMEngine: the synchronous engine; one step() is schedule -> run -> sample -> update.

Not thread-safe: AsyncEngine drives it from one thread. Any object with
`.run(ScheduledBatch) -> RunnerOutput` and `.kv_caches` is a runner, so the control plane is
tested without Paddle; from_config() builds the real Paddle ModelRunner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from workers.engine.api import EngineRequest, EngineStats, RequestOutput
from workers.engine.batch import RunnerOutput, ScheduledBatch
from workers.engine.block_pool import BlockPool
from workers.engine.engine_config import EngineConfig
from workers.engine.request_validation import RequestLimits, validate_request
from workers.engine.sampler import sample
from workers.engine.scheduler import Scheduler
from workers.engine.stop_checker import Detokenizer


class Runner(Protocol):
    kv_caches: Any

    def run(self, batch: ScheduledBatch) -> RunnerOutput: ...


class TokenizerLike(Protocol):
    eos_token_ids: tuple[int, ...]

    def new_detokenizer(self) -> Detokenizer: ...


class LLMEngine:
    """Continuous-batching engine over a runner; see workers/engine/api.py for the contract."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: TokenizerLike,
        config: EngineConfig,
        vocab_size: int,
        model_config: Any = None,
    ) -> None:
        if config.max_model_len is None:
            raise ValueError("LLMEngine needs a resolved config.max_model_len (see from_config)")
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.model_config = model_config
        self.limits = RequestLimits(
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            max_model_len=config.max_model_len,
            vocab_size=vocab_size,
        )
        self.pool = BlockPool(config.num_kv_blocks)
        self.scheduler = Scheduler(
            self.pool,
            self.limits,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            eos_token_ids=tokenizer.eos_token_ids,
            new_detokenizer=tokenizer.new_detokenizer,
        )
        self.num_steps_total = 0
        self.last_step_num_tokens = 0
        self.last_step_num_chunks = 0  # == last_step_num_tokens: a pure decode step

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load config.model (a tiny preset or an HF folder) and build the Paddle runner."""
        try:
            from workers.engine.loader import load_model
            from workers.engine.runner import ModelRunner
        except ImportError as exc:
            raise ImportError(
                f"the engine needs Paddle ({exc}); install it with: pip install -e '.[cpu]' "
                "(or '.[gpu]' on a CUDA host)"
            ) from exc
        loaded = load_model(
            config.model, dtype=config.dtype, seed=config.seed, cache_dir=config.cache_dir
        )
        max_model_len = config.resolved_max_model_len(loaded.config.max_position_embeddings)
        config = dataclasses.replace(config, max_model_len=max_model_len)
        runner = ModelRunner(loaded, config.num_kv_blocks, config.block_size, config.device)
        return cls(runner, loaded.tokenizer, config, loaded.config.vocab_size, loaded.config)

    @property
    def kv_caches(self) -> Any:
        return self.runner.kv_caches

    def validate(self, request: EngineRequest) -> None:
        """Raise ValueError with a client-facing message if request cannot run here."""
        validate_request(request, self.limits)

    def add_request(self, request: EngineRequest) -> None:
        """Queue request (validated; ValueError if invalid or its id is live)."""
        self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a live request, freeing its blocks; its final "abort" output, or None."""
        return self.scheduler.abort(request_id)

    def release(self, request_id: str) -> bool:
        """Free a finished prefill_only request's blocks; False if none is held."""
        return self.scheduler.release(request_id)

    def allocate_blocks(self, num_blocks: int) -> list[int] | None:
        """Blocks for a decode-role request to fill before add; None when no room."""
        return self.pool.allocate(num_blocks)

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Give back blocks from allocate_blocks() that were never handed to a request."""
        self.pool.free(block_ids)

    def reclaim_blocks(self, block_ids: Iterable[int]) -> bool:
        """Free the preallocated blocks of a request that was refused, if they are safely its
        own: every one allocated and none in a live request's table. False if left alone."""
        block_ids = list(block_ids)
        if not block_ids or self.scheduler.blocks_in_use(block_ids):
            return False
        if any(self.pool.ref_count(b) == 0 for b in block_ids):
            return False
        self.pool.free(block_ids)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step; an empty list with last_step_num_tokens == 0 means blocked/idle."""
        batch = self.scheduler.schedule()
        self.last_step_num_tokens = batch.num_tokens
        self.last_step_num_chunks = len(batch.chunks)
        if batch.is_empty:
            return []
        result = self.runner.run(batch)
        sampled = sample(result.logits, self.scheduler.sample_specs(batch))
        outputs = self.scheduler.update(batch, sampled)
        self.num_steps_total += 1
        return outputs

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_kv_blocks_used=self.pool.num_used,
            num_kv_blocks_total=self.pool.num_blocks,
            num_prompt_tokens_total=s.num_prompt_tokens_total,
            num_generation_tokens_total=s.num_generation_tokens_total,
            num_preemptions_total=s.num_preemptions_total,
            extra={"num_held": float(len(s.held)), "num_steps_total": float(self.num_steps_total)},
        )

    def generate(self, requests: Sequence[EngineRequest]) -> dict[str, list[RequestOutput]]:
        """Add requests and step until nothing is unfinished (benchmarks, tests).

        Returns the outputs of every request that produced any, by id, in order."""
        for request in requests:
            self.add_request(request)
        outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        while self.has_unfinished():
            for out in self.step():
                outputs.setdefault(out.request_id, []).append(out)
            if self.last_step_num_tokens == 0:
                raise RuntimeError(
                    "engine is blocked: waiting requests need KV blocks that are held "
                    "(release prefill_only requests or free allocated blocks)"
                )
        return outputs
