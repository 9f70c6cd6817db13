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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "prefill_done"]


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
    # of tokens [0, num_computed_tokens). Ownership passes to the engine on add.
    preallocated_block_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0


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


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_preemptions_total: int = 0
    extra: dict[str, float] = field(default_factory=dict)
