"""The engine's public contract: what a server hands in and what it gets back.

Plain dataclasses, no Paddle. Three kinds of request share one mechanism:

    mixed    prompt_token_ids, output_token_ids=()           -> prefill, sample, decode ...
    prefill  prefill_only=True                               -> prefill, sample first token, finish
                                                                with finish_reason "prefill_done",
                                                                blocks KEPT until engine.release()
    decode   output_token_ids=(first_token,), preallocated   -> blocks already hold the KV of the
             block ids + num_computed_tokens=k                  first k tokens (read from the pool);
                                                                the engine computes tokens k..end
                                                                (recompute of whatever was missing)
                                                                and continues decoding

The engine always keeps the invariant: a sequence is prompt + outputs; KV exists for
tokens [0, num_computed_tokens); the next step computes the rest and samples the token at
position len(sequence). Sampling randomness is a pure function of (seed, position), so the
same seeded request gives the same tokens in any of the three shapes and after a resume.

Any shape may start from cached KV: a request without preallocated blocks takes its device
prefix cache hit when first scheduled; a prefill worker with a pool takes a PrefixLease
(device hits + blocks it fills from the pool) and adds prefill_only=True with the lease's
blocks as preallocated_block_ids, num_computed_tokens = num_cached_tokens =
lease.num_computed_tokens. RequestOutput.num_cached_tokens reports what was not computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from workers.engine.host_tier import HostTierStats

# grammar_error: the request's grammar reached a dead end (no token can continue a valid
# answer; workers.engine.step_outputs): what was generated is not valid for its schema.
FinishReason = Literal["stop", "length", "abort", "prefill_done", "grammar_error"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy; top_k == 0 means off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Report each sampled token's log probability and the num_logprobs most likely tokens'
    # (workers.engine.logprobs); None: none computed.
    num_logprobs: int | None = None
    # Logits adjustments before sampling (workers.engine.penalties): OpenAI's penalties over
    # the output tokens, vLLM's repetition_penalty over prompt and output (1: off), a bias per
    # token id, and the stop tokens masked until min_tokens outputs exist. min_p (0: off)
    # keeps the tokens at least min_p times as likely as the most likely one.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    # vLLM's priority: lower is served first and preempted last (workers.engine.priority).
    priority: int = 0
    # An llguidance grammar the output must follow (workers.engine.grammar); None: free.
    grammar: str | None = None
    # Report every prompt token's log probability given the tokens before it, and the
    # prompt_logprobs most likely tokens' (workers.engine.prompt_logprobs); None: none
    # computed. Such a request computes its whole prompt (no prefix cache hit).
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class SampledLogprobs:
    """One sampled token's log probability under the model's distribution (log-softmax of the
    raw logits) and the top most likely (token id, log probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # Tokens already generated (decode role: the first token sampled by P; a resume: every
    # token the client already has). They count towards max_tokens and are never re-emitted.
    output_token_ids: tuple[int, ...] = ()
    # Prefill role: stop after sampling the first token and keep the blocks until release().
    prefill_only: bool = False
    # Decode role: blocks obtained from engine.allocate_blocks() and already filled with the KV
    # of tokens [0, num_computed_tokens). Ownership passes to the engine on add. Also the
    # blocks of a PrefixLease (device hits, then blocks filled from the pool).
    preallocated_block_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0
    # Of num_computed_tokens, the prompt tokens whose KV came from a cache (device or pool
    # hit): reported as RequestOutput.num_cached_tokens. D's load of P's handoff is not a
    # cache hit: the decode worker passes 0.
    num_cached_tokens: int = 0
    # Prefill role, chunked prefill: after each chunk that completes prompt blocks, emit an
    # event naming them (RequestOutput.ready_block_ids) so the caller can write them out while
    # the next chunk computes. Those blocks stay referenced until release(request_id).
    report_progress: bool = False
    # The prefix cache scope (pdrouter.wire.pd.cache_scope; None: the shared cache): the
    # device prefix cache hashes, matches and registers this request's blocks under it.
    cache_scope: str | None = None
    # The grammar state of a request with params.grammar (workers.engine.grammar: a matcher
    # that has consumed output_token_ids), built off the engine thread by Grammars.ready();
    # the engine refuses a constrained request without one. Owned by the engine from add on.
    matcher: Any = field(default=None, compare=False, repr=False)
    # A sequence group (n > 1, best_of): one seed per sequence (None: a random one), sequence
    # 0's first. The prompt is computed once; every sequence samples its first token from the
    # prompt's last logits, then sequences fork (workers/engine/sequence_group.py) and decode
    # in one batch. Empty: one sequence, with params.seed.
    sequence_seeds: tuple[int | None, ...] = ()
    # A decode worker's group: the tokens sequences 1..n-1 already have (P's first token of
    # each; more on a resume), as output_token_ids are sequence 0's. Empty: none yet (the
    # group samples every first token from its prompt's logits).
    sequence_output_token_ids: tuple[tuple[int, ...], ...] = ()
    # A constrained group's matchers of sequences 1..n-1 (each has consumed its
    # sequence_output_token_ids), built with `matcher` by Grammars.ready() off the engine thread.
    sequence_matchers: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    @property
    def num_later_sequences(self) -> int:
        """The group's sequences after the first (0: one sequence)."""
        return max(len(self.sequence_seeds) - 1, 0)

    @property
    def later_sequence_outputs(self) -> tuple[tuple[int, ...], ...]:
        """The tokens each sequence after the first already has: sequence_output_token_ids,
        or none for each when none were given."""
        return self.sequence_output_token_ids or ((),) * self.num_later_sequences


@dataclass(frozen=True)
class RequestOutput:
    """One event for one request: the tokens produced since the previous event."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str  # detokenized increment, stop strings already cut
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # total so far, including output_token_ids given at add time
    # Set on the final event of a prefill_only request: the blocks holding the prompt's KV,
    # in sequence order (block i holds tokens [i*block_size, (i+1)*block_size)).
    block_ids: tuple[int, ...] = ()
    # Prompt tokens whose KV this request did not compute: the device prefix cache's hit when
    # it was first scheduled, or the caller's EngineRequest.num_cached_tokens when it came
    # with preallocated blocks. Fixed from the first event on (a resume after a preemption
    # finds its own blocks again; that is not a hit).
    num_cached_tokens: int = 0
    # Of num_cached_tokens, those whose blocks were swapped in from the host tier for it.
    num_host_cached_tokens: int = 0
    # time.monotonic() when the engine first scheduled the request (0.0: not yet): what it
    # waited in the queue, for the caller's timings.
    scheduled_s: float = 0.0
    # One per new token when the request asked for logprobs (SamplingParams.num_logprobs).
    new_logprobs: tuple[SampledLogprobs, ...] = ()
    # A progress event (EngineRequest.report_progress; no token): the full prompt blocks
    # [ready_from_block, ready_from_block + len(ready_block_ids)), whose KV the step that
    # emitted this event wrote and completed. The engine holds a reference to each of them
    # (a pin) until release(request_id), through an abort or a preemption too, so they are
    # neither freed nor reused while the caller copies them out.
    ready_block_ids: tuple[int, ...] = ()
    ready_from_block: int = 0
    # SamplingParams.prompt_logprobs, on the request's first token's event: one entry per
    # prompt token after the first (token i's under the model given tokens [0, i)).
    prompt_logprobs: tuple[SampledLogprobs, ...] | None = None
    # The sequence of a group (EngineRequest.sequence_seeds) this event is about; request_id
    # is the group's. more_sequences: this sequence finished while others of its group run on.
    sequence_index: int = 0
    more_sequences: bool = False

    @property
    def ends_stream(self) -> bool:
        """The request's last event: a plain request's final one, a group's last sequence's."""
        return self.finished and not self.more_sequences


@dataclass(frozen=True)
class PrefixLease:
    """Blocks taken for a sequence before its request is added (see AsyncEngine.acquire_prefix).

    The lease covers positions [0, num_tokens - 1): the last known token is always computed
    by the engine, since its logits give the next token.

        block_ids:   | device hits (cached, shared) | extra blocks (fresh, exclusive) |
                     0                   num_cached_blocks                   len(block_ids)

    The caller fills extra blocks front first (from the pool), gives back the ones it could
    not fill with trim_lease(), and adds its request with preallocated_block_ids=block_ids
    and num_computed_tokens=lease.num_computed_tokens, or gives everything back with
    release_lease(). Until then the lease holds one reference on each block.
    """

    block_ids: tuple[int, ...]
    num_cached_blocks: int
    block_size: int
    num_tokens: int  # length of the sequence it was acquired for

    @property
    def extra_block_ids(self) -> tuple[int, ...]:
        return self.block_ids[self.num_cached_blocks :]

    @property
    def num_device_cached_tokens(self) -> int:
        return self.num_cached_blocks * self.block_size

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV the lease's blocks hold once every one of them is filled."""
        return min(len(self.block_ids) * self.block_size, self.num_tokens - 1)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_preemptions_total: int = 0
    num_kv_blocks_cached: int = 0  # blocks carrying a hash, referenced or evictable
    # Prompt tokens by where their KV came from, counted when a request is first scheduled
    # (or added, with preallocated blocks): found in the device prefix cache; given by the
    # caller as cached (a pool hit); given by the caller and not cached (D's load of P's
    # handoff); computed here.
    num_prompt_tokens_device_hit_total: int = 0
    num_prompt_tokens_host_hit_total: int = 0  # swapped in from the host tier
    num_prompt_tokens_given_cached_total: int = 0
    num_prompt_tokens_loaded_total: int = 0
    num_prompt_tokens_computed_total: int = 0
    host_tier: HostTierStats | None = None  # None: no host tier
    extra: dict[str, float] = field(default_factory=dict)
