"""Sequence groups: one request of n sequences (n > 1, best_of) whose prompt is computed once.

    add        sequence 0 is the request's state; sequences 1..n-1 wait in its fork_children
    prefill    sequence 0's chunks compute the prompt, as any request's; the chunk that ends
               the prompt also reserves one block per child when the prompt ends inside a
               block (fork_block_ids)
    sample     every sequence samples its first token from that chunk's one logits row, each
               with its own seed (SampleSpec.seed) and its own logits adjustments and grammar
    fork       each child still running takes the prompt's full blocks (one more reference
               each) and a block of its own for the partial last block:

        sequence 0   [b0 b1 | b2 ]        b0, b1 full (ref count n), b2 partial (its own)
        sequence 1   [b0 b1 | b7 ]        b7 = copy of b2, made by sequence 1's first chunk
        sequence 2   [b0 b1 | b8 ]        (ScheduledChunk.block_copy), before it writes

    decode     the sequences are running requests of their own (keys <id>#<j>); their events
               carry the request's id and their sequence index, and the request's last event
               is its last sequence's final one (RequestOutput.ends_stream)

The partial block is copied at the fork rather than on a first write because every sequence
writes into it at its very next step (its first token's KV), so a deferred copy would be made
at once anyway and would add a shared-and-writable state to the pool's rules. The copy runs in
the runner ahead of the chunk's forward (a step boundary, never across one), reading block
copy_from, on which the sequence holds a reference until its chunk ran: neither a preemption
of sequence 0 nor its end can hand that block to someone else before the copy is made.

On a prefill worker (prefill_only) nothing forks: every sequence's first token is an event of
its own, and only sequence 0 holds the prompt's blocks for the handoff.

Preemption treats a forked sequence as any request: it drops its blocks (its references on the
shared ones) and resumes by recompute of prompt + its outputs, taking the prompt's full blocks
back from the device prefix cache when they are still there. Recompute rather than a swap:
the shared blocks stay referenced by the other sequences, so dropping a victim frees only its
private blocks, and a resumed sequence samples the same tokens (randomness is a pure function
of seed and position). Sequence 0 preempted before the fork drops its reserved blocks too and
forks once its prompt is computed again.
"""

from __future__ import annotations

from collections.abc import Iterable

from workers.engine.batch import ScheduledChunk
from workers.engine.block_pool import BlockPool
from workers.engine.request_state import RequestState


def forks_at(state: RequestState, end_pos: int) -> bool:
    """A chunk of state ending at end_pos completes the prompt of an unforked group."""
    return bool(state.fork_children) and end_pos == state.num_prompt_tokens


def num_to_compute(state: RequestState) -> int:
    """Tokens state's next chunk may compute: an unforked group's stop at its prompt's end
    (a decode worker's group brings each sequence's first tokens: they fork before them)."""
    if state.fork_children and state.num_computed_tokens < state.num_prompt_tokens:
        return state.num_prompt_tokens - state.num_computed_tokens
    return state.num_uncomputed_tokens


def stop_before_fork(state: RequestState) -> None:
    """A group added with its whole prompt's KV (a decode worker's full handoff) computes its
    last prompt token again, so that it forks where every group does: at the prompt's end."""
    if state.fork_children and state.num_computed_tokens >= state.num_prompt_tokens:
        state.num_computed_tokens = state.num_prompt_tokens - 1


def num_seats(state: RequestState) -> int:
    """The batch seats state takes: one, plus one per child it forks (a prefill-only group's
    children never run: P samples their first tokens and the group ends there)."""
    return 1 if state.prefill_only else 1 + len(state.fork_children)


def free_seats(running: Iterable[RequestState], max_num_seqs: int) -> int:
    """Batch seats the running requests leave free (num_seats each)."""
    return max_num_seqs - sum(map(num_seats, running))


def num_fork_blocks(state: RequestState, end_pos: int, block_size: int) -> int:
    """Blocks still to reserve for the children's copies of the prompt's partial last block
    when a chunk of state ends at end_pos (0 unless that chunk forks)."""
    if state.prefill_only or not forks_at(state, end_pos):
        return 0
    if state.num_prompt_tokens % block_size == 0:
        return 0  # the prompt ends on a block boundary: every prompt block is shared
    return len(state.fork_children) - len(state.fork_block_ids)


def sampling_states(state: RequestState, chunk: ScheduledChunk) -> list[RequestState]:
    """The states that sample a token from the chunk's logits row (a chunk with logits)."""
    if forks_at(state, chunk.end_pos) and chunk.need_logits:
        return [state, *state.fork_children]
    return [state]


def fork(
    parent: RequestState, children: list[RequestState], pool: BlockPool, block_size: int
) -> None:
    """Give each running child the prompt's blocks: the full ones shared (a reference each),
    the partial one as its own reserved block, copied at its first chunk (copy_from). The
    parent's reserved blocks that no child took are freed."""
    num_full = parent.num_prompt_tokens // block_size
    shared = parent.block_ids[:num_full]
    reserved = parent.fork_block_ids
    parent.fork_block_ids = []
    parent.fork_children = []
    partial = parent.num_prompt_tokens % block_size != 0
    for child in children:
        pool.incref(shared)
        child.block_ids = list(shared)
        if partial:
            child.block_ids.append(reserved.pop())
            child.copy_from = parent.block_ids[num_full]
            pool.incref([child.copy_from])
        child.num_computed_tokens = parent.num_computed_tokens
        child.scheduled_s = parent.scheduled_s  # its queue ended with its group's
        # A forked sequence computed none of its prompt: its whole prompt is "cached" (its
        # usage counts the prompt once, on sequence 0; its metrics count no computed token).
        child.num_cached_tokens = parent.num_prompt_tokens
        child.block_hashes = list(parent.block_hashes[:num_full])
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
    if reserved:
        pool.free(reserved)


def block_copy(state: RequestState, block_size: int) -> tuple[int, int] | None:
    """The copy a forked sequence's next chunk makes first: (its source, its own block)."""
    if state.copy_from is None:
        return None
    return state.copy_from, state.block_ids[state.num_prompt_tokens // block_size]


def held_blocks(state: RequestState) -> list[int]:
    """Every block state holds a reference on, once per reference: its table, its reserved
    copies, a copy source not yet copied (what dropping its blocks releases)."""
    source = [] if state.copy_from is None else [state.copy_from]
    return [*state.block_ids, *state.fork_block_ids, *source]


def drop_fork_blocks(state: RequestState, pool: BlockPool) -> None:
    """Free what a state holds for a fork: reserved copies, a copy source not yet copied."""
    if state.fork_block_ids:
        pool.free(state.fork_block_ids)
        state.fork_block_ids = []
    if state.copy_from is not None:
        pool.free([state.copy_from])
        state.copy_from = None
