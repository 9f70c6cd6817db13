"""StepInput: one ScheduledBatch flattened into the index arrays the decoder consumes.

No Paddle here: plain numpy, built once per step, so the decoder runs the dense parts
(embeddings, projections, MLP, norms) over every token of every chunk at once and only
attention is split into groups:

    flat token order:  [ decode chunks (1 token each) | prefill chunks, by length ...        ]
                         one group: S = #decodes, L=1   one group per length: S = #chunks of
                                                        that length, L = the length

Within a group, tokens form an [S, L] grid. Each row attends over its own sequence's cache,
gathered block by block through its block table (padded to the group's longest table) and
masked to positions <= its own:

    mask_bias[s, i, j] = 0     if p - window < j <= p,   p = position of token (s, i)
                         -inf  otherwise (padding blocks, future positions, and with a
                               sliding window keys that fell out of it; window = inf if none)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from workers.engine.batch import ScheduledBatch, ScheduledChunk


@dataclass(frozen=True)
class AttentionGroup:
    token_start: int  # first row of the group in the flat token order
    num_seqs: int  # S
    query_len: int  # L
    block_table: np.ndarray  # int64 [S, max_blocks]
    query_pos: np.ndarray  # int64 [S, L]: the position of each query token
    block_size: int
    sliding_window: int | None

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.query_len

    @cached_property
    def allowed(self) -> np.ndarray:
        """bool [S, L, max_blocks * block_size]: where mask_bias is 0. Built on first use: a
        runner that needs no explicit mask (the torch decoder's causal paths) never pays for
        it, which matters for long prompts (S * L * ctx entries: 1 GiB of floats at 16K)."""
        key_pos = np.arange(self.block_table.shape[1] * self.block_size, dtype=np.int64)
        query_pos = self.query_pos[:, :, None]
        allowed = key_pos[None, None, :] <= query_pos  # [S, L, ctx]
        if self.sliding_window is not None:
            allowed &= key_pos[None, None, :] > query_pos - self.sliding_window
        return allowed

    @cached_property
    def mask_bias(self) -> np.ndarray:
        """float32 [S, L, max_blocks * block_size] (the module docstring's formula)."""
        return np.where(self.allowed, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)

    def head_rows(self, num_kv_heads: int) -> np.ndarray:
        """The rows of a layer's cache the group's attention gathers (head_rows below)."""
        return head_rows(self.block_table, num_kv_heads)


@dataclass(frozen=True)
class StepInput:
    token_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    write_block_ids: np.ndarray  # int64 [T]: where token t's K/V goes ...
    write_rows: np.ndarray  # int64 [T]: ... block write_block_ids[t], row write_rows[t]
    groups: tuple[AttentionGroup, ...]
    logits_rows: np.ndarray  # int64 [n]: flat rows whose logits are returned, in chunk order

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def build_step_input(
    batch: ScheduledBatch, block_size: int, num_blocks: int, sliding_window: int | None = None
) -> StepInput:
    """Flatten `batch`; raises ValueError naming the request whose chunk is malformed."""
    for chunk in batch.chunks:
        _check_chunk(chunk, block_size, num_blocks)
    # Equal-length chunks share a group (one set of attention ops for all): decodes always,
    # prefill chunks often (prompts cut at the same chunk size, same-length benchmark prompts).
    by_length: dict[int, list[ScheduledChunk]] = {}
    for chunk in sorted(batch.chunks, key=lambda c: len(c.token_ids)):
        by_length.setdefault(len(chunk.token_ids), []).append(chunk)
    ordered = [c for same_length in by_length.values() for c in same_length]
    token_ids = np.fromiter((t for c in ordered for t in c.token_ids), dtype=np.int64)
    positions = np.concatenate([np.arange(c.start_pos, c.end_pos, dtype=np.int64) for c in ordered])
    tables = [np.asarray(c.block_ids, dtype=np.int64) for c in ordered]
    write_block_ids = np.concatenate(
        [
            table[np.arange(c.start_pos, c.end_pos) // block_size]
            for c, table in zip(ordered, tables, strict=True)
        ]
    )
    write_rows = positions % block_size

    groups: list[AttentionGroup] = []
    start = 0
    for length, chunks in by_length.items():
        groups.append(_group(start, chunks, block_size, sliding_window))
        start += length * len(chunks)

    # Last token of each chunk that needs logits, reported in the batch's chunk order.
    last_row = {}
    row = 0
    for chunk in ordered:
        row += len(chunk.token_ids)
        last_row[id(chunk)] = row - 1
    rows = [last_row[id(c)] for c in batch.chunks if c.need_logits]
    # Then every row of each chunk asking for its prompt's logprobs (RunnerOutput.prompt_logits).
    for c in batch.chunks:
        if c.prompt_logprobs:
            rows.extend(range(last_row[id(c)] - len(c.token_ids) + 1, last_row[id(c)] + 1))
    logits_rows = np.array(rows, dtype=np.int64)
    return StepInput(token_ids, positions, write_block_ids, write_rows, tuple(groups), logits_rows)


def _group(
    token_start: int,
    chunks: list[ScheduledChunk],
    block_size: int,
    sliding_window: int | None,
) -> AttentionGroup:
    num_seqs, query_len = len(chunks), len(chunks[0].token_ids)
    max_blocks = max(-(-c.end_pos // block_size) for c in chunks)
    # Padding entries point at block 0: gathered, then masked out, never written.
    block_table = np.zeros((num_seqs, max_blocks), dtype=np.int64)
    query_pos = np.empty((num_seqs, query_len), dtype=np.int64)
    for s, c in enumerate(chunks):
        used = -(-c.end_pos // block_size)
        block_table[s, :used] = c.block_ids[:used]
        query_pos[s] = np.arange(c.start_pos, c.end_pos)
    return AttentionGroup(
        token_start, num_seqs, query_len, block_table, query_pos, block_size, sliding_window
    )


def _check_chunk(chunk: ScheduledChunk, block_size: int, num_blocks: int) -> None:
    if not chunk.token_ids:
        raise ValueError(f"request {chunk.request_id!r}: chunk has no tokens")
    if chunk.start_pos < 0:
        raise ValueError(f"request {chunk.request_id!r}: negative start_pos {chunk.start_pos}")
    needed = -(-chunk.end_pos // block_size)
    if len(chunk.block_ids) < needed:
        raise ValueError(
            f"request {chunk.request_id!r}: {len(chunk.block_ids)} blocks cannot hold positions "
            f"[0, {chunk.end_pos}) at block_size {block_size} (needs {needed})"
        )
    bad = [b for b in chunk.block_ids[:needed] if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"request {chunk.request_id!r}: block ids {bad} outside [0, {num_blocks})")


def head_rows(block_table: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """int64 [S * kv_heads * max_blocks]: the rows to gather from a layer's cache viewed as
    [num_blocks * kv_heads, block_size, head_dim], where (block b, head h) is row
    b * kv_heads + h, ordered (seq, head, block) so that the gather lands as
    [S, kv_heads, ctx, head_dim] directly (both decoders' paged attention, and the torch
    decoder's padded CUDA-graph inputs). block_table: int64 [S, max_blocks]."""
    heads = np.arange(num_kv_heads, dtype=np.int64)
    return (block_table[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
