"""Request validation: every reason the engine would refuse a request, checked at intake.

Raised as ValueError with a message a client can act on (the server maps it to HTTP 400).
Checked once, before the request touches any engine state, so the engine thread never meets
a request it cannot finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.api import EngineRequest
from workers.engine.penalties import check_params


@dataclass(frozen=True)
class RequestLimits:
    """The engine's static limits a request is checked against."""

    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int | None = None  # None: token ids are not range-checked


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def validate_request(request: EngineRequest, limits: RequestLimits) -> None:
    """Raise ValueError naming the first problem with request; return None if it can run."""
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
    _validate_params(request)
    check_params(request.params, limits.vocab_size, rid)
    prompt = request.prompt_token_ids
    if not prompt:
        raise ValueError(f"request {rid!r}: the prompt is empty")
    if limits.vocab_size is not None:
        for token_id in (*prompt, *request.output_token_ids):
            if not 0 <= token_id < limits.vocab_size:
                raise ValueError(
                    f"request {rid!r}: token id {token_id} outside the vocabulary "
                    f"[0, {limits.vocab_size})"
                )
    num_outputs = len(request.output_token_ids)
    max_tokens = request.params.max_tokens
    if num_outputs >= max_tokens:
        raise ValueError(
            f"request {rid!r}: {num_outputs} output tokens given already reach "
            f"max_tokens={max_tokens}"
        )
    num_tokens = len(prompt) + num_outputs
    if num_tokens >= limits.max_model_len:
        raise ValueError(
            f"request {rid!r}: prompt of {len(prompt)} tokens"
            + (f" plus {num_outputs} given output tokens" if num_outputs else "")
            + f" leaves no room to generate within max_model_len={limits.max_model_len}"
        )
    # The last sampled token never needs KV, so a request of final length L needs blocks for
    # positions [0, L - 1).
    final_len = min(len(prompt) + max_tokens, limits.max_model_len)
    if request.prefill_only:
        final_len = num_tokens + 1
    num_blocks_worst = _ceil_div(final_len - 1, limits.block_size)
    if num_blocks_worst > limits.num_kv_blocks:
        raise ValueError(
            f"request {rid!r}: {len(prompt)} prompt tokens with max_tokens={max_tokens} need up "
            f"to {num_blocks_worst} KV blocks of {limits.block_size} tokens but the engine has "
            f"{limits.num_kv_blocks}; shorten the prompt or lower max_tokens"
        )
    _validate_preallocated(request, limits, num_tokens)


def _validate_params(request: EngineRequest) -> None:
    rid = request.request_id
    p = request.params
    if p.max_tokens < 1:
        raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {p.max_tokens}")
    if not p.temperature >= 0.0:
        raise ValueError(f"request {rid!r}: temperature must be >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"request {rid!r}: top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise ValueError(f"request {rid!r}: top_k must be >= 0 (0 = off), got {p.top_k}")
    if any(not s for s in p.stop):
        raise ValueError(f"request {rid!r}: stop strings must be non-empty")
    if p.seed is not None and p.seed < 0:
        raise ValueError(f"request {rid!r}: seed must be >= 0, got {p.seed}")


def _validate_preallocated(request: EngineRequest, limits: RequestLimits, num_tokens: int) -> None:
    rid = request.request_id
    block_ids = request.preallocated_block_ids
    num_computed = request.num_computed_tokens
    if not 0 <= num_computed < num_tokens:
        raise ValueError(
            f"request {rid!r}: num_computed_tokens={num_computed} must be in [0, {num_tokens}) "
            "(at least the last known token is computed here)"
        )
    num_cached = request.num_cached_tokens
    if not 0 <= num_cached <= min(num_computed, len(request.prompt_token_ids)):
        raise ValueError(
            f"request {rid!r}: num_cached_tokens={num_cached} must be in [0, "
            f"{min(num_computed, len(request.prompt_token_ids))}] (cached prompt tokens are "
            "computed tokens)"
        )
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"request {rid!r}: preallocated_block_ids repeat a block: {block_ids}")
    for block_id in block_ids:
        if not 0 <= block_id < limits.num_kv_blocks:
            raise ValueError(
                f"request {rid!r}: preallocated block {block_id} outside "
                f"[0, {limits.num_kv_blocks})"
            )
    min_blocks = _ceil_div(num_computed, limits.block_size)
    max_blocks = _ceil_div(num_tokens, limits.block_size)
    if not min_blocks <= len(block_ids) <= max_blocks:
        raise ValueError(
            f"request {rid!r}: {len(block_ids)} preallocated blocks for num_computed_tokens="
            f"{num_computed} and {num_tokens} tokens; expected between {min_blocks} and "
            f"{max_blocks}"
        )
