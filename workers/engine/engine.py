"""LLMEngine: the synchronous engine; one step() is schedule -> run -> sample -> update.

Not thread-safe: AsyncEngine drives it from one thread. Any object with
`.run(ScheduledBatch) -> RunnerOutput` and `.kv_caches` is a runner (runner_api.Runner), so the
control plane is tested without Paddle; from_config() builds the real one, Paddle or PyTorch
(runner_factory.build_runner), and nothing here depends on which.

The device prefix cache (config.enable_prefix_cache) names blocks by the model fingerprint of
ModelConfig.fingerprint(block_size), the one the pool keys use. With config.swap_space_gib > 0
a host tier (workers/engine/host_tier.py) backs it; its pending copies are made at the end
of each step, after the step's blocks were registered.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from workers.engine.api import EngineRequest, EngineStats, PrefixLease, RequestOutput
from workers.engine.block_pool import BlockPool
from workers.engine.engine_config import EngineConfig
from workers.engine.grammar import Grammars, advance, mask_logits
from workers.engine.grammar_compiler import GrammarBudget
from workers.engine.host_policy import HostTierConfig
from workers.engine.host_storage import HostStorage, open_host_storage
from workers.engine.host_tier import HostTier, OnChange, no_change
from workers.engine.intake import check_group
from workers.engine.logprobs import sampled_logprobs
from workers.engine.prompt_logprobs import record_prompt_logprobs
from workers.engine.request_validation import RequestLimits, validate_request
from workers.engine.runner_api import Runner
from workers.engine.sampler import sample
from workers.engine.scheduler import Scheduler
from workers.engine.stop_checker import Detokenizer
from workers.pool.keys import model_fingerprint

log = logging.getLogger(__name__)


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
        fingerprint: str | None = None,
        on_host_change: OnChange = no_change,
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
        if fingerprint is None:
            fingerprint = _fingerprint(config, model_config)
        self.fingerprint = fingerprint
        self.pool = BlockPool(config.num_kv_blocks, enable_caching=config.enable_prefix_cache)
        budget = GrammarBudget(config.grammar_max_schema_bytes, config.grammar_compile_timeout_s)
        self.grammars = Grammars(tokenizer, vocab_size, budget)
        if self.pool.events is not None:  # routers hear of the host tier's blocks too
            on_host_change = _both(on_host_change, self.pool.events.on_change("host"))
        self.host_storage, self.host_tier = _host_tier(config, runner.kv_caches, on_host_change)
        self.scheduler = Scheduler(
            self.pool,
            self.limits,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            eos_token_ids=tokenizer.eos_token_ids,
            new_detokenizer=tokenizer.new_detokenizer,
            fingerprint=fingerprint,
            host_tier=self.host_tier,
        )
        self.num_steps_total = 0
        self.last_step_num_tokens = 0
        self.last_step_num_chunks = 0  # == last_step_num_tokens: a pure decode step

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load config.model (a tiny preset, a packaged model or an HF folder) and build the
        runner of config.engine_backend (workers/engine/runner_factory.py)."""
        from workers.engine.runner_factory import build_runner

        runner, loaded = build_runner(config)
        max_model_len = config.resolved_max_model_len(loaded.config.max_position_embeddings)
        config = dataclasses.replace(config, max_model_len=max_model_len)
        return cls(runner, loaded.tokenizer, config, loaded.config.vocab_size, loaded.config)

    @property
    def kv_caches(self) -> Any:
        return self.runner.kv_caches

    def validate(self, request: EngineRequest) -> None:
        """Raise ValueError with a client-facing message if request cannot run here."""
        validate_request(request, self.limits)
        if request.sequence_seeds:
            check_group(request, self.config.max_num_seqs, (), self.limits)

    def add_request(self, request: EngineRequest) -> None:
        """Queue request (validated; ValueError if invalid or its id is live). A constrained
        request brings its grammar state (request.matcher, from self.grammars.ready() off
        this thread: building one here would stall every running request's step)."""
        if request.params.grammar is not None and (
            request.matcher is None or len(request.sequence_matchers) != request.num_later_sequences
        ):
            raise ValueError("a request with a grammar needs its matchers (Grammars.ready)")
        self.scheduler.add(request)
        state = self.scheduler.requests[request.request_id]
        state.grammar = request.matcher
        for child, matcher in zip(state.fork_children, request.sequence_matchers, strict=False):
            child.grammar = matcher

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a live request, freeing its blocks; its final "abort" output, or None."""
        return self.scheduler.abort(request_id)

    def release(self, request_id: str) -> bool:
        """Free a finished prefill_only request's blocks; False if none is held."""
        return self.scheduler.release(request_id)

    def allocate_blocks(self, num_blocks: int, priority: int | None = None) -> list[int] | None:
        """Blocks for a decode-role request to fill before add; None when no room. With the
        request's priority, less urgent running requests are preempted to make the room."""
        if priority is not None and num_blocks > self.pool.num_free:
            self.scheduler.priority_room.free_for(num_blocks, priority)
        return self.pool.allocate(num_blocks)

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Give back blocks from allocate_blocks() that were never handed to a request."""
        self.pool.free(block_ids)

    def acquire_prefix(
        self, token_ids: Sequence[int], max_extra_blocks: int, cache_scope: str | None = None
    ) -> PrefixLease | None:
        """The device-cached prefix of token_ids (under cache_scope) with references, plus up
        to max_extra_blocks fresh blocks for the positions after it (never the last token's);
        None (nothing taken) when the extra blocks do not fit. See PrefixLease."""
        return self.scheduler.prefix_cache.acquire(token_ids, max_extra_blocks, cache_scope)

    def trim_lease(self, lease: PrefixLease, num_filled_blocks: int) -> PrefixLease:
        """Give back the lease's extra blocks after the first num_filled_blocks."""
        return self.scheduler.prefix_cache.trim(lease, num_filled_blocks)

    def release_lease(self, lease: PrefixLease) -> None:
        """Give back every block of a lease that was not handed to a request."""
        self.scheduler.prefix_cache.free_sequence(lease.block_ids)

    def reclaim_blocks(self, block_ids: Iterable[int]) -> bool:
        """Free the preallocated blocks of a request that was refused, if they are safely its
        own: each distinct and holding a reference beyond the live requests' block tables
        (a lease's device hit is also in other tables). False if left alone."""
        block_ids = list(block_ids)
        if not block_ids or len(set(block_ids)) != len(block_ids):
            return False
        table_refs = self.scheduler.table_refs(block_ids)
        if any(self.pool.ref_count(b) <= table_refs.get(b, 0) for b in block_ids):
            return False
        self.scheduler.prefix_cache.free_sequence(block_ids)
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
        sampling = self.scheduler.sampling_states(batch)  # once a step: specs, rows, update
        specs = self.scheduler.sample_specs(batch, sampling)
        rows = [row for row, _, _ in sampling]
        # A group samples each sequence's first token from its prompt's one row.
        logits = result.logits if rows == list(range(len(result.logits))) else result.logits[rows]
        matchers = [state.grammar for _, state, _ in sampling]
        sampled = sample(mask_logits(logits, matchers), specs)
        advance(matchers, sampled)
        logprobs = [
            None
            if spec.num_logprobs is None
            else sampled_logprobs(logits[i], token_id, spec.num_logprobs)
            for i, (spec, token_id) in enumerate(zip(specs, sampled, strict=True))
        ]
        record_prompt_logprobs(self.scheduler.requests, batch, result.prompt_logits)
        outputs = self.scheduler.update(batch, sampled, logprobs, sampling)
        self.scheduler.prefix_cache.flush_host()
        self.num_steps_total += 1
        return outputs

    def stats(self) -> EngineStats:
        s = self.scheduler
        sources = s.prompt_token_sources
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_kv_blocks_used=self.pool.num_used,
            num_kv_blocks_total=self.pool.num_blocks,
            num_prompt_tokens_total=s.num_prompt_tokens_total,
            num_generation_tokens_total=s.num_generation_tokens_total,
            num_preemptions_total=s.num_preemptions_total,
            num_kv_blocks_cached=self.pool.num_cached,
            num_prompt_tokens_device_hit_total=sources.device_hit,
            num_prompt_tokens_host_hit_total=sources.host_hit,
            num_prompt_tokens_given_cached_total=sources.given_cached,
            num_prompt_tokens_loaded_total=sources.loaded,
            num_prompt_tokens_computed_total=sources.computed,
            host_tier=None if self.host_tier is None else self.host_tier.stats(),
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


def _host_tier(
    config: EngineConfig, kv_caches: Any, on_change: OnChange
) -> tuple[HostStorage | None, HostTier | None]:
    """The host tier config.swap_space_gib asks for (None, None when off)."""
    if config.swap_space_gib <= 0:
        return None, None
    storage = open_host_storage(kv_caches, config.swap_space_gib)
    if storage is None:
        log.warning(
            "--swap-space %s GiB holds no whole KV block: no host tier", config.swap_space_gib
        )
        return None, None
    tier_config = HostTierConfig(
        storage.num_slots,
        config.write_policy,
        config.write_through_threshold,  # type: ignore[arg-type]
    )
    num_bytes = storage.num_slots * storage.copier.slot_bytes
    log.info(
        "host tier: %d blocks, %d bytes, %s", storage.num_slots, num_bytes, config.write_policy
    )
    return storage, HostTier(tier_config, storage.copier, on_change=on_change)


def _both(first: OnChange, second: OnChange) -> OnChange:
    """One host-tier hook that calls two."""

    def changed(added: Iterable[str], removed: Iterable[str]) -> None:
        added, removed = tuple(added), tuple(removed)
        first(added, removed)
        second(added, removed)

    return changed


def _fingerprint(config: EngineConfig, model_config: Any) -> str:
    """The model's fingerprint; a runner without a ModelConfig (the tests' numpy stand-in) is
    named by config.model alone."""
    if model_config is not None:
        return model_config.fingerprint(config.block_size)
    return model_fingerprint(config.model, config.dtype, 0, 0, 0, config.block_size)
