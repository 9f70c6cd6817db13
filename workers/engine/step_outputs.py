"""A step's results into the scheduler's requests: update() and what it builds on.

    runner output -> sampled tokens, in sampling_states() order (one per chunk with logits; a
    group's prompt-ending chunk, one per sequence) -> update(): computed counts advance, each
    token is appended and stop-checked, a finished request is held (prefill_only) or removed,
    a group forks (workers/engine/sequence_group.py), a progress event pins the prompt blocks
    a prefill chunk completed -> one RequestOutput per token or progress event

Scheduler (workers/engine/scheduler.py) inherits this: the state it reads and the removal it
calls are the scheduler's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from workers.engine import sequence_group
from workers.engine.api import RequestOutput, SampledLogprobs
from workers.engine.batch import ScheduledBatch
from workers.engine.block_pool import BlockPool
from workers.engine.prefix_cache import PrefixCache
from workers.engine.request_state import RequestState, RequestStatus
from workers.engine.sampler import SampleSpec, sample_spec

# (logits row, state, position) per token a batch samples: StepOutputs.sampling_states.
Sampling = list[tuple[int, RequestState, int]]


class StepOutputs:
    """The update half of the scheduler (its attributes are set by Scheduler.__init__)."""

    pool: BlockPool
    prefix_cache: PrefixCache
    block_size: int
    requests: dict[str, RequestState]
    running: list[RequestState]
    held: dict[str, RequestState]
    pins: dict[str, list[int]]
    group_keys: dict[str, set[str]]
    num_generation_tokens_total: int
    _eos_token_ids: tuple[int, ...]

    def _remove(self, state: RequestState) -> None:
        raise AssertionError("Scheduler defines _remove")

    def sampling_states(self, batch: ScheduledBatch) -> Sampling:
        """(logits row, state, position) per token this batch samples, in update()'s order:
        the rows are in chunk order (the runner's), and a group's prompt-ending row is sampled
        once per sequence (workers/engine/sequence_group.py)."""
        sampled = []
        row = 0
        for chunk in batch.chunks:
            if chunk.need_logits:
                state = self.requests[chunk.request_id]
                for member in sequence_group.sampling_states(state, chunk):
                    sampled.append((row, member, chunk.end_pos))
                row += 1
        return sampled

    def sample_specs(
        self, batch: ScheduledBatch, sampling: Sampling | None = None
    ) -> list[SampleSpec]:
        """One spec per token sampled (sampling: the batch's sampling_states, when the caller
        has them already)."""
        if sampling is None:
            sampling = self.sampling_states(batch)
        return [
            sample_spec(state, position, self._eos_token_ids) for _, state, position in sampling
        ]

    def update(
        self,
        batch: ScheduledBatch,
        sampled_token_ids: Sequence[int],
        logprobs: Sequence[SampledLogprobs | None] = (),
        sampling: Sampling | None = None,
    ) -> list[RequestOutput]:
        """Advance computed counts, append sampled tokens (one per sampling_states entry),
        finish requests; one output per token (with its logprobs[i] when given and not None).
        sampling: the batch's sampling_states, when the caller has them already."""
        num_sampled = len(self.sampling_states(batch) if sampling is None else sampling)
        if len(sampled_token_ids) != num_sampled:
            raise ValueError(f"update() got {len(sampled_token_ids)} tokens for {num_sampled}")
        outputs: list[RequestOutput] = []
        tokens = iter(zip(sampled_token_ids, logprobs or [None] * num_sampled, strict=True))
        for chunk in batch.chunks:
            state = self.requests[chunk.request_id]
            assert state.status is RequestStatus.RUNNING, f"{state.request_id} is {state.status}"
            assert chunk.start_pos == state.num_computed_tokens, state.request_id
            state.num_computed_tokens = chunk.end_pos
            if chunk.block_copy is not None:  # the runner made it: the source may go
                sequence_group.drop_fork_blocks(state, self.pool)
            self.prefix_cache.register_computed(state)
            if not chunk.need_logits:
                if sequence_group.forks_at(state, chunk.end_pos):  # outputs given: fork now
                    self._fork(state, state.fork_children)
                if state.report_progress:
                    progress = self._progress(state)
                    if progress is not None:
                        outputs.append(progress)
                continue
            assert chunk.end_pos == state.num_tokens, state.request_id
            members = sequence_group.sampling_states(state, chunk)
            ends = [self._append(member, *next(tokens)) for member in members]
            if len(members) > 1:
                live = [m for m, end in zip(members[1:], ends[1:], strict=True) if not end[2]]
                self._fork(state, live)
            # A group's children first: sequence 0's final event (a prefill's, with the
            # prompt's blocks) ends the step's events of its group.
            order = [*zip(members[1:], ends[1:], strict=True), (state, ends[0])]
            for i, (member, end) in enumerate(order):
                outputs.append(self._settle(member, *end, more_after=i < len(order) - 1))
        return outputs

    # ---- helpers ------------------------------------------------------------------------

    def _append(
        self, state: RequestState, token_id: int, token_logprobs: SampledLogprobs | None
    ) -> tuple[int, str, str | None, tuple[SampledLogprobs, ...]]:
        """Append one sampled token: (token id, new text, finish reason, its logprobs)."""
        token_id = int(token_id)
        new_logprobs = () if token_logprobs is None else (token_logprobs,)
        state.output_token_ids.append(token_id)
        self.num_generation_tokens_total += 1
        result = state.stop_checker.append(token_id, state.num_tokens, state.num_output_tokens)
        text, finish_reason = result.text, result.finish_reason
        if finish_reason == "stop" and state.grammar is not None and state.grammar.error:
            # The grammar dead-ended (its mask then allows only an end): not a valid answer.
            finish_reason = "grammar_error"
        if state.prefill_only and finish_reason is None:
            text += state.stop_checker.release_held()
            finish_reason = "prefill_done"
        return token_id, text, finish_reason, new_logprobs

    def _settle(
        self,
        state: RequestState,
        token_id: int,
        text: str,
        finish_reason: str | None,
        new_logprobs: tuple[SampledLogprobs, ...],
        more_after: bool = False,
    ) -> RequestOutput:
        """The token's event; a finished sequence is held (prefill_only) or removed first.
        more_after: events of its group follow in this step (its more_sequences)."""
        if finish_reason is None:
            return state.output((token_id,), text, None, new_logprobs)
        state.finish_reason = finish_reason  # type: ignore[assignment]
        if state.status is not RequestStatus.RUNNING:
            pass  # a child that finished on its first token: it never ran on its own
        elif state.prefill_only:
            self.running.remove(state)
            state.status = RequestStatus.HELD
            self.held[state.request_id] = state
        else:
            self._remove(state)
        out = state.output((token_id,), text, finish_reason, new_logprobs)  # type: ignore[arg-type]
        if more_after or state.group_id in self.group_keys:
            out = dataclasses.replace(out, more_sequences=True)
        return out

    def _fork(self, parent: RequestState, children: list[RequestState]) -> None:
        """Start a group's children that did not finish on their first token."""
        if parent.prefill_only:
            parent.fork_children = []
            return
        sequence_group.fork(parent, children, self.pool, self.block_size)
        self.group_keys[parent.group_id] = {parent.request_id, *(c.request_id for c in children)}
        for child in children:
            child.start_running()  # keeps the group's stamp (fork copied it)
            self.requests[child.request_id] = child
            self.running.append(child)

    def _progress(self, state: RequestState) -> RequestOutput | None:
        """The progress event for the full prompt blocks completed since the last one, pinned;
        None if no block was completed."""
        num_full = min(state.num_computed_tokens, state.num_prompt_tokens) // self.block_size
        first = state.num_reported_blocks
        if num_full <= first:
            return None
        ready = state.block_ids[first:num_full]
        self.pool.incref(ready)
        self.pins.setdefault(state.request_id, []).extend(ready)
        state.num_reported_blocks = num_full
        return state.output((), "", None, ready_block_ids=tuple(ready), ready_from_block=first)
