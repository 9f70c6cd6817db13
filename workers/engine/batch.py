"""The contract between the scheduler and the model runner: one step's work and its result.

    scheduler.schedule() -> ScheduledBatch -> runner.run(batch) -> RunnerOutput
                                           -> scheduler.update(batch, sampled tokens)

A chunk computes the KV of token_ids at positions [start_pos, start_pos + len(token_ids)) and
attends causally over positions [0, start_pos + len(token_ids)) of its own sequence:

    position p lives in block block_ids[p // block_size] at row p % block_size

A prefill chunk has many tokens; a decode chunk has one. No Paddle here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    # The request's whole block table; covers positions [0, start_pos + len(token_ids)).
    block_ids: tuple[int, ...]
    # True when the distribution after the chunk's last token is needed (it ends the known
    # sequence); False for a non-final chunk of a chunked prefill.
    need_logits: bool
    # True when the distribution after every token of the chunk is needed too (the
    # request's prompt logprobs): RunnerOutput.prompt_logits holds them.
    prompt_logprobs: bool = False
    # A forked sequence's first chunk: copy block [0] into block [1] (its own copy of the
    # prompt's partial last block) before the chunk writes (workers/engine/sequence_group.py).
    block_copy: tuple[int, int] | None = None

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class ScheduledBatch:
    chunks: tuple[ScheduledChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class RunnerOutput:
    # float32 [num chunks with need_logits, vocab_size], rows in chunk order
    logits: np.ndarray
    # float32 [len(token_ids), vocab_size] per chunk with prompt_logprobs, in chunk order
    prompt_logits: tuple[np.ndarray, ...] = ()

    @classmethod
    def from_rows(cls, batch: ScheduledBatch, rows: np.ndarray) -> RunnerOutput:
        """Split a forward's logits rows (step_input.StepInput.logits_rows order: one row per
        chunk with need_logits, then every row of each prompt_logprobs chunk) by chunk."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        num_sampled = sum(1 for c in batch.chunks if c.need_logits)
        prompt_logits, start = [], num_sampled
        for chunk in batch.chunks:
            if chunk.prompt_logprobs:
                prompt_logits.append(rows[start : start + len(chunk.token_ids)])
                start += len(chunk.token_ids)
        return cls(logits=rows[:num_sampled], prompt_logits=tuple(prompt_logits))
