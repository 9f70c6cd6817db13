"""A deterministic numpy stand-in for the model, for tests of the engine loop.

Its "KV cache" stores each position's token id in [num_blocks, block_size]: a chunk writes
its tokens through the block table, then reads the whole sequence [0, end_pos) back through
it, and the logits depend on that read-back sequence. A scheduler that hands out a wrong
block table, forgets to recompute a preempted request or lets two requests share a block
produces different tokens than reference_greedy(), or trips the never-written check.
"""

from __future__ import annotations

import numpy as np

from workers.engine.batch import RunnerOutput, ScheduledBatch

EMPTY = -1


def next_token(sequence: np.ndarray | list[int], vocab_size: int) -> int:
    """The fake model's greedy next token: a position-weighted checksum, never 0 (eos)."""
    seq = np.asarray(sequence, dtype=np.int64)
    checksum = int(np.sum(seq * (np.arange(len(seq)) + 1)))
    return 32 + checksum % (vocab_size - 32)


def reference_greedy(prompt: list[int], num_tokens: int, vocab_size: int = 128) -> list[int]:
    sequence = list(prompt)
    for _ in range(num_tokens):
        sequence.append(next_token(sequence, vocab_size))
    return sequence[len(prompt) :]


class NumpyRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 128) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.cache = np.full((num_blocks, block_size), EMPTY, dtype=np.int64)  # [blocks, bs]
        self.kv_caches = [self.cache]
        self.num_runs = 0

    def write(self, block_ids: list[int], token_ids: list[int], start_pos: int = 0) -> None:
        """Fill blocks with the KV of positions [start_pos, len(token_ids)) of a sequence
        (a pool read; a lease's device hits before start_pos are left alone)."""
        positions = np.arange(start_pos, len(token_ids))
        table = np.asarray(block_ids, dtype=np.int64)
        self.cache[table[positions // self.block_size], positions % self.block_size] = token_ids[
            start_pos:
        ]

    def read(self, block_ids: tuple[int, ...] | list[int], num_tokens: int) -> list[int]:
        positions = np.arange(num_tokens)
        table = np.asarray(block_ids, dtype=np.int64)
        return self.cache[table[positions // self.block_size], positions % self.block_size].tolist()

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        self.num_runs += 1
        rows = []
        prompt_logits = []
        for chunk in batch.chunks:
            if chunk.block_copy is not None:  # a forked sequence's copy of a partial block
                src, dst = chunk.block_copy
                self.cache[dst] = self.cache[src]
        for chunk in batch.chunks:
            table = np.asarray(chunk.block_ids, dtype=np.int64)
            positions = np.arange(chunk.start_pos, chunk.end_pos)
            self.cache[table[positions // self.block_size], positions % self.block_size] = (
                chunk.token_ids
            )
            sequence = self.read(chunk.block_ids, chunk.end_pos)
            assert EMPTY not in sequence, f"{chunk.request_id}: attends to never-written KV"
            if chunk.need_logits:
                target = next_token(sequence, self.vocab_size)
                # A peaked but smooth distribution, so that sampling has something to do.
                rows.append(-0.5 * np.abs(np.arange(self.vocab_size) - target))
            if chunk.prompt_logprobs:
                per_token = [
                    -0.5
                    * np.abs(
                        np.arange(self.vocab_size) - next_token(sequence[: p + 1], self.vocab_size)
                    )
                    for p in range(chunk.start_pos, chunk.end_pos)
                ]
                prompt_logits.append(np.asarray(per_token, dtype=np.float32))
        logits = np.asarray(rows, dtype=np.float32).reshape(len(rows), self.vocab_size)
        return RunnerOutput(logits=logits, prompt_logits=tuple(prompt_logits))
