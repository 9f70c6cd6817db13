"""Intake: an EngineRequest as the scheduler's RequestState, with the seeds its sequences
sample with.

A request of several sequences (EngineRequest.sequence_seeds: n > 1 of them) is one state,
sequence 0, that carries the states of sequences 1..n-1 unscheduled (fork_children) until its
prompt is computed; workers/engine/sequence_group.py forks them there.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Collection

from workers.engine.api import EngineRequest
from workers.engine.request_state import RequestState
from workers.engine.request_validation import RequestLimits
from workers.engine.stop_checker import Detokenizer, StopChecker


def random_seed() -> int:
    """A seed for a request that brought none: fixed at intake, so a resume stays consistent."""
    return secrets.randbits(63)


@dataclasses.dataclass(frozen=True)
class Intake:
    """What a new state needs of the engine: its stop tokens, limits and seed source."""

    eos_token_ids: tuple[int, ...]
    max_model_len: int
    new_detokenizer: Callable[[], Detokenizer]
    new_seed: Callable[[], int] = random_seed

    def state(self, request: EngineRequest) -> RequestState:
        """The request's state (sequence 0), with its group's other sequences unscheduled."""
        seeds = request.sequence_seeds or (request.params.seed,)
        parent = self._sequence(request, request.request_id, 0, seeds[0], request.output_token_ids)
        outputs = request.later_sequence_outputs
        parent.fork_children = [
            self._sequence(request, sequence_key(request.request_id, j), j, seed, outputs[j - 1])
            for j, seed in enumerate(seeds[1:], start=1)
        ]
        return parent

    def _sequence(
        self,
        request: EngineRequest,
        key: str,
        index: int,
        seed: int | None,
        output_token_ids: tuple[int, ...],
    ) -> RequestState:
        params = request.params
        if index > 0:  # the prompt's logprobs are sequence 0's to compute and report
            params = dataclasses.replace(params, prompt_logprobs=None)
        eos = () if params.ignore_eos else self.eos_token_ids
        checker = StopChecker(
            self.new_detokenizer(),
            stop=params.stop,
            stop_token_ids=(*params.stop_token_ids, *eos),
            max_tokens=params.max_tokens,
            max_model_len=self.max_model_len,
            min_tokens=params.min_tokens,
        )
        checker.prime(output_token_ids)
        return RequestState(
            request_id=key,
            prompt_token_ids=tuple(request.prompt_token_ids),
            params=params,
            seed=seed if seed is not None else self.new_seed(),
            stop_checker=checker,
            prefill_only=request.prefill_only,
            output_token_ids=list(output_token_ids),
            block_ids=list(request.preallocated_block_ids) if index == 0 else [],
            num_computed_tokens=request.num_computed_tokens if index == 0 else 0,
            report_progress=request.report_progress and request.prefill_only,
            cache_scope=request.cache_scope,
            group_id=request.request_id,
            sequence_index=index,
        )


def sequence_key(request_id: str, index: int) -> str:
    """The scheduler's key of a request's sequence index (0: the request's own id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def check_group(
    request: EngineRequest, max_num_seqs: int, live: Collection[str], limits: RequestLimits
) -> None:
    """Raise ValueError if a request of several sequences cannot run here."""
    rid = request.request_id
    num_sequences = len(request.sequence_seeds)
    if num_sequences == 1 or num_sequences > max_num_seqs:
        raise ValueError(
            f"request {rid!r}: {num_sequences} sequence seeds; a group has 2 to "
            f"max_num_seqs={max_num_seqs} sequences (none: one sequence)"
        )
    num_prompt_blocks = -(-len(request.prompt_token_ids) // limits.block_size)
    if num_prompt_blocks + num_sequences - 1 > limits.num_kv_blocks:
        raise ValueError(
            f"request {rid!r}: its prompt's {num_prompt_blocks} KV blocks and a last block for "
            f"each of {num_sequences} sequences exceed the engine's {limits.num_kv_blocks}"
        )
    for index in range(1, num_sequences):
        if sequence_key(rid, index) in live:
            raise ValueError(f"request {rid!r}: sequence key {sequence_key(rid, index)!r} is live")
    _check_outputs(request, limits)


def _check_outputs(request: EngineRequest, limits: RequestLimits) -> None:
    """Each sequence's given tokens: one list per sequence after the first, all empty or
    none (a group forks at its prompt's end), each within max_tokens and the model."""
    rid = request.request_id
    given = request.sequence_output_token_ids
    if not given:
        if request.output_token_ids:
            raise ValueError(f"request {rid!r}: sequence 0 has tokens, the others none")
        return
    if len(given) != request.num_later_sequences:
        raise ValueError(
            f"request {rid!r}: {len(given)} output token lists for "
            f"{request.num_later_sequences} sequences after the first"
        )
    for outputs in (request.output_token_ids, *given):
        if not outputs or len(outputs) >= request.params.max_tokens:
            raise ValueError(
                f"request {rid!r}: each sequence needs 1 to max_tokens - 1 given tokens"
            )
        if len(request.prompt_token_ids) + len(outputs) >= limits.max_model_len:
            raise ValueError(f"request {rid!r}: a sequence leaves no room within max_model_len")
        if limits.vocab_size is not None and not all(0 <= t < limits.vocab_size for t in outputs):
            raise ValueError(f"request {rid!r}: a given token id is outside the vocabulary")
