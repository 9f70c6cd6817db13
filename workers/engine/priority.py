"""Request priority in the scheduler: who waits in front, and who is preempted first.

vLLM's convention: a lower `priority` value is more urgent; equal values keep arrival order.

    waiting  [p=-1 a] [p=-1 b] [p=0 c] [p=0 d] [p=5 e]
                       new p=-1 goes here ^         (after its equals: first come first served)
                       a preempted p=0 goes here ^  (before its equals: it was running already)
    running  [p=0 x] [p=5 y] [p=0 z]   victim: y (the least urgent; among equals, the newest)

With every request at the default 0 both rules reduce to the plain FIFO scheduler's: append
at the back, requeue at the front, preempt the most recently admitted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from workers.engine.request_state import RequestState


def enqueue(waiting: deque[RequestState], state: RequestState, resumed: bool) -> None:
    """Put state in waiting by priority: behind its equals when new, in front of them when
    resumed (a preempted request keeps its place ahead of those that came after it)."""
    priority = state.params.priority
    if not waiting or (not resumed and waiting[-1].params.priority <= priority):
        waiting.append(state)  # the common case (all equal) stays O(1)
        return
    for i, other in enumerate(waiting):
        other_priority = other.params.priority
        if other_priority > priority or (resumed and other_priority == priority):
            waiting.insert(i, state)
            return
    waiting.append(state)


def victim(running: Sequence[RequestState]) -> RequestState:
    """The running request to preempt: the least urgent, the most recently admitted of those."""
    chosen = running[-1]
    for state in reversed(running):
        if state.params.priority > chosen.params.priority:
            chosen = state
    return chosen


def step_order(
    running: Sequence[RequestState],
) -> tuple[list[RequestState], list[RequestState]]:
    """The running requests as a step serves them: those decoding (one uncomputed token) in
    admission order, then those prefilling most urgent first, in admission order among equals
    (a less urgent long prompt does not take the budget from a more urgent one)."""
    decoding = [r for r in running if r.num_uncomputed_tokens == 1]
    prefilling = [r for r in running if r.num_uncomputed_tokens > 1]
    prefilling.sort(key=lambda r: r.params.priority)  # stable
    return decoding, prefilling
