"""RequestState: the scheduler's mutable record of one request.

The sequence is prompt + outputs; KV exists for positions [0, num_computed_tokens):

    positions   0 ........................ len(prompt) ............... num_tokens
                | prompt_token_ids          | output_token_ids          |
                |<- KV computed ->|<- next chunk(s) compute these ->|
                0          num_computed_tokens                    num_tokens

The next token sampled sits at position num_tokens. A preempted request drops its blocks and
sets num_computed_tokens back to 0: it resumes by recomputing prompt + outputs so far (after
taking back whatever of it the device prefix cache still holds).

With prefix caching on, block_hashes[i] is the chained hash of block i's tokens (filled as
needed, kept across a preemption: it depends only on the tokens and cache_scope, which
enters the chain's root), and block_ids[:
num_registered_blocks] have been offered to the cache (registered, or found cached already).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from workers.engine.api import FinishReason, RequestOutput, SampledLogprobs, SamplingParams
from workers.engine.stop_checker import StopChecker


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # A prefill_only request that sampled its first token: done, but its blocks are kept
    # until release() or abort().
    HELD = "held"
    FINISHED = "finished"


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int  # params.seed, or a random one drawn at intake
    stop_checker: StopChecker
    prefill_only: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    block_hashes: list[str] = field(default_factory=list)
    num_registered_blocks: int = 0
    cache_scope: str | None = None  # EngineRequest.cache_scope
    # Prompt tokens not computed by this request (RequestOutput.num_cached_tokens); None until
    # it is first scheduled, or added with preallocated blocks.
    num_cached_tokens: int | None = None
    num_host_cached_tokens: int = 0  # of num_cached_tokens, swapped in from the host tier
    scheduled_s: float = 0.0  # time.monotonic() at its first scheduling (RequestOutput's)
    # report_progress (prefill_only): full prompt blocks [0, num_reported_blocks) were named in
    # progress events and pinned (Scheduler.pins); a resume after a preemption goes on from here.
    report_progress: bool = False
    num_reported_blocks: int = 0
    # repetition_penalty's view of the prompt (workers.engine.penalties.distinct_ids), made once.
    distinct_prompt_ids: Any = None
    # The grammar state of a constrained request (workers.engine.grammar.GrammarMatcher).
    grammar: Any = None
    # params.prompt_logprobs: entry i - 1 for prompt token i, filled as chunks compute them
    # (again after a preemption), given once on the first token's event.
    prompt_logprobs: list[SampledLogprobs | None] | None = None
    # A sequence group (workers/engine/sequence_group.py): the id its events carry, this
    # sequence's index; sequence 0 carries the others unscheduled until its prompt is computed
    # (fork_children) and the blocks their copies of its partial last block take
    # (fork_block_ids). A forked sequence's first chunk copies block copy_from (held with a
    # reference until then) into its own last block.
    group_id: str = ""
    sequence_index: int = 0
    fork_children: list[RequestState] = field(default_factory=list)
    fork_block_ids: list[int] = field(default_factory=list)
    copy_from: int | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * (len(self.prompt_token_ids) - 1)

    @property
    def may_take_cached_prefix(self) -> bool:
        """Admitted without blocks and not scoring its prompt (which computes every position)."""
        return not self.block_ids and self.prompt_logprobs is None

    def scores_prompt_from(self, start: int) -> bool:
        """A chunk from position start computes prompt logprobs this request still needs."""
        return self.prompt_logprobs is not None and start < len(self.prompt_token_ids) - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens of the sequence at positions [start, end)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        head = self.prompt_token_ids[start:num_prompt] if start < num_prompt else ()
        tail_start = max(start - num_prompt, 0)
        return head + tuple(self.output_token_ids[tail_start : end - num_prompt])

    def start_running(self) -> None:
        """Scheduled now: its queue ends here the first time (a resume's does not count)."""
        self.status = RequestStatus.RUNNING
        if not self.scheduled_s:
            self.scheduled_s = time.monotonic()

    def output(
        self,
        new_token_ids: tuple[int, ...],
        text: str,
        finish_reason: FinishReason | None,
        new_logprobs: tuple[SampledLogprobs, ...] = (),
        ready_block_ids: tuple[int, ...] = (),
        ready_from_block: int = 0,
    ) -> RequestOutput:
        """The event for this request now (block ids only on a held request's; ready blocks
        only on a progress event; prompt logprobs on the first token's)."""
        prompt_logprobs = None
        if self.prompt_logprobs is not None and new_token_ids:
            prompt_logprobs = tuple(e for e in self.prompt_logprobs if e is not None)
            self.prompt_logprobs = None
        return RequestOutput(
            request_id=self.group_id or self.request_id,
            new_token_ids=new_token_ids,
            new_text=text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            block_ids=tuple(self.block_ids) if self.status is RequestStatus.HELD else (),
            num_cached_tokens=self.num_cached_tokens or 0,
            num_host_cached_tokens=self.num_host_cached_tokens,
            scheduled_s=self.scheduled_s,
            new_logprobs=new_logprobs,
            ready_block_ids=ready_block_ids,
            ready_from_block=ready_from_block,
            prompt_logprobs=prompt_logprobs,
            sequence_index=self.sequence_index,
        )
