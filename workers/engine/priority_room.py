"""Room for the most urgent waiting request: less urgent running requests give way to it.

vLLM's priority scheduling: when the waiting request at the front (the most urgent, the
waiting queue being in priority order) is not admitted because the batch is full, the least
urgent running request that is strictly less urgent than it gives way, and admission runs
again, until the front request runs or no less urgent request is left:

    front blocked by            the less urgent request (least urgent, newest first)
    ------------------------    ----------------------------------------------------------
    max_num_seqs (no seat)      is preempted: blocks freed, back to waiting (Scheduler's
    free KV blocks              preemption: its full blocks stay cached, and in the host
                                tier when its policy copied them, so its resume recomputes
                                only what no tier holds)
    the step's token budget     only sits this step out: its chunk is dropped and the
                                tokens go to the front request; it keeps its blocks and
                                its seat, and runs again next step

A preempted request resumes like one preempted under KV pressure: its sampled tokens are
kept, its seed fixed at intake, so its stream continues token for token. Requests of equal
priority never preempt each other: with every request at the default 0 nothing here acts.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Protocol

from workers.engine import priority as priority_order
from workers.engine import sequence_group
from workers.engine.batch import ScheduledChunk
from workers.engine.block_pool import BlockPool
from workers.engine.request_state import RequestState
from workers.engine.swap_ins import SwapIns

Chunks = dict[str, ScheduledChunk]


class SchedulerView(Protocol):
    """What PriorityRoom reads of the scheduler (workers.engine.scheduler.Scheduler)."""

    waiting: deque[RequestState]
    running: list[RequestState]
    max_num_seqs: int
    pool: BlockPool
    swap_ins: SwapIns


class PriorityRoom:
    """The scheduler's priority preemptions beyond KV pressure (preempt is its own)."""

    def __init__(self, batch: SchedulerView, preempt: Callable[[RequestState], None]) -> None:
        self._batch = batch
        self._preempt = preempt

    def make_room(
        self, chunks: Chunks, budget: list[int], admit: Callable[[Chunks, list[int]], None]
    ) -> None:
        """After admission: let less urgent running requests give way to the front waiting
        request, admitting again (admit: the scheduler's) after each."""
        batch = self._batch
        # Each turn preempts a running request or drops a chunk, or returns: the bound is slack.
        for _ in range(2 * (len(batch.running) + len(batch.waiting)) + 1):
            front = _front(batch)
            if front is None:
                return
            seats = sequence_group.free_seats(batch.running, batch.max_num_seqs)
            if seats >= sequence_group.num_seats(front) and budget[0] == 0:  # tokens, not seats
                scheduled = [s for s in batch.running if s.request_id in chunks]
                yielding = _less_urgent(scheduled, front.params.priority)
                if yielding is None:
                    return
                budget[0] += len(chunks.pop(yielding.request_id).token_ids)
            else:
                yielding = _less_urgent(batch.running, front.params.priority)
                if yielding is None:
                    return
                dropped = chunks.pop(yielding.request_id, None)
                if dropped is not None:
                    budget[0] += len(dropped.token_ids)
                self._preempt(yielding)
            admit(chunks, budget)  # once front runs, the next waiting request has its turn

    def free_for(self, num_blocks: int, priority: int) -> bool:
        """Make num_blocks free for a request of priority that is not in the scheduler yet
        (a decode-role request's blocks for its KV, LLMEngine.allocate_blocks) by preempting
        less urgent running requests, the least urgent first; nothing is preempted unless
        their preemptions together would do. Between steps only. False if they would not."""
        yielding = _yielding_for(self._batch, num_blocks, priority)
        if yielding is None:
            return False
        for state in yielding:
            self._preempt(state)
        return True


def _yielding_for(
    batch: SchedulerView, num_blocks: int, priority: int
) -> list[RequestState] | None:
    """The less urgent running requests whose preemptions, in preemption order, leave
    num_blocks free; None if all of them would not. A preemption returns a block to the pool
    only when it drops the block's last reference: blocks shared with a request that keeps
    running (a prefix hit, a forked sequence's prompt) or pinned stay taken."""
    pool, candidates = batch.pool, list(batch.running)
    num_free, drops, yielding = pool.num_free, Counter[int](), []
    while num_free < num_blocks:
        state = _less_urgent(candidates, priority)
        if state is None:
            return None
        candidates.remove(state)
        yielding.append(state)
        for block_id in sequence_group.held_blocks(state):
            drops[block_id] += 1
            num_free += drops[block_id] == pool.ref_count(block_id)
    return yielding


def _front(batch: SchedulerView) -> RequestState | None:
    """The most urgent waiting request that admission may take now (not mid swap-in)."""
    for state in batch.waiting:
        if state.request_id not in batch.swap_ins:
            return state
    return None


def _less_urgent(candidates: list[RequestState], priority: int) -> RequestState | None:
    """The request of candidates to give way to one of priority: the least urgent, the newest
    of those, if strictly less urgent."""
    if not candidates:
        return None
    chosen = priority_order.victim(candidates)
    return chosen if chosen.params.priority > priority else None
