"""Scheduler: continuous batching over a paged KV cache, with chunked prefill and preemption.

One step (schedule() -> runner -> update()):

    budget = max_num_batched_tokens
    1. running requests with one uncomputed token (decode), in admission order: 1 token each
    2. running requests still prefilling (a long prompt, a resume), most urgent first:
       a chunk of min(uncomputed, budget left) tokens
    3. waiting requests, front first, while a sequence slot, budget and blocks remain; then
       less urgent running requests give way to a more urgent front (priority_room.py)

A running request that needs a block when none is free preempts the most recently admitted
running request of the least urgent priority (possibly itself): its blocks are freed,
num_computed_tokens goes back to 0, and it goes to the front of its priority's part of the
waiting queue (workers/engine/priority.py), resuming later by recompute. Nothing is dropped.

Admission asks for enough free blocks to hold the request's whole known sequence (so a resumed
request does not thrash), allocates only what its first chunk needs, and is first come first
served, except that a waiting request already holding blocks (a decode-role request with
preallocated blocks) may pass a head that does not fit: running it frees memory. If nothing
at all can run, waiting requests holding blocks give them up, last first, until the head fits.
An empty batch therefore means only an outside event (add, abort, release, free_blocks) can
unblock the engine.

With prefix caching on (a BlockPool with caching and the model fingerprint), a request admitted
without blocks first takes the cached run of its sequence's full blocks (PrefixCache.match)
and computes only the rest; admission counts the hit blocks that were evictable against the
free blocks, and shared ones not at all; the host tier's blocks that continue the run are
swapped in beside the steps (workers/engine/swap_ins.py) and counted as host hits. Computed full
blocks are registered in update(); a request's blocks are freed tail first. See
workers/engine/prefix_cache.py for the rules.

Progress (EngineRequest.report_progress, prefill_only): after a non-final chunk, update() emits
an event naming the full prompt blocks it completed, and pins them (one more reference, kept
in `pins`) so that a preemption or an abort cannot hand them to another request while the
caller copies them out; release(request_id) drops the pins, also after an abort.

A request of several sequences (EngineRequest.sequence_seeds) is scheduled as one request
until its prompt is computed, and admitted only with a sequence slot for each of them; the
chunk that ends its prompt also takes the blocks its fork needs, and update() forks it into
running requests of their own (workers/engine/sequence_group.py). abort(id) ends them all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from workers.engine import priority, priority_room, sequence_group
from workers.engine.api import EngineRequest, RequestOutput
from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.block_pool import BlockPool
from workers.engine.host_tier import HostTier
from workers.engine.intake import Intake, check_group, random_seed
from workers.engine.prefix_cache import PrefixCache, PromptTokenSources
from workers.engine.request_state import RequestState, RequestStatus
from workers.engine.request_validation import RequestLimits, validate_request
from workers.engine.step_outputs import StepOutputs
from workers.engine.stop_checker import Detokenizer
from workers.engine.swap_ins import SwapIns


class Scheduler(StepOutputs):
    """Owns every live request's state and the block pool's use; update() and the sampling
    order are StepOutputs' (workers/engine/step_outputs.py)."""

    def __init__(
        self,
        pool: BlockPool,
        limits: RequestLimits,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: Sequence[int],
        new_detokenizer: Callable[[], Detokenizer],
        new_seed: Callable[[], int] = random_seed,
        fingerprint: str = "",
        host_tier: HostTier | None = None,
    ) -> None:
        if limits.num_kv_blocks != pool.num_blocks:
            raise ValueError(
                f"limits.num_kv_blocks={limits.num_kv_blocks} != pool.num_blocks={pool.num_blocks}"
            )
        self.pool = pool
        self.prefix_cache = PrefixCache(pool, limits.block_size, fingerprint, host_tier)
        self.swap_ins = SwapIns(self.prefix_cache)  # host tier -> device copies under way
        self.limits = limits
        self.block_size = limits.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._eos_token_ids = tuple(eos_token_ids)
        self._intake = Intake(self._eos_token_ids, limits.max_model_len, new_detokenizer, new_seed)
        self.requests: dict[str, RequestState] = {}  # every live request: waiting/running/held
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # admission order, most recent last
        self.held: dict[str, RequestState] = {}  # finished prefill_only requests keeping blocks
        self.pins: dict[str, list[int]] = {}  # blocks named in progress events, until release
        self.group_keys: dict[str, set[str]] = {}  # a forked group's live sequences, by its id
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_preemptions_total = 0
        self.prompt_token_sources = PromptTokenSources()
        self.priority_room = priority_room.PriorityRoom(self, self._preempt)

    # ---- intake and removal -------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Queue a request; raises ValueError if it is invalid or its id is live."""
        validate_request(request, self.limits)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.sequence_seeds:
            check_group(request, self.max_num_seqs, self.requests.keys(), self.limits)
        state = self._intake.state(request)
        sequence_group.stop_before_fork(state)
        if state.block_ids:
            self.prefix_cache.check_preallocated(state, self.table_refs(state.block_ids))
            num_hit_blocks, num_host_blocks = self.prefix_cache.adopt(state)
            state.num_cached_tokens = request.num_cached_tokens  # the caller's word
            host_tokens = min(num_host_blocks * self.block_size, request.num_cached_tokens)
            state.num_host_cached_tokens = host_tokens
            num_device = num_hit_blocks * self.block_size - host_tokens
            self.prompt_token_sources.count(state, num_device, state.num_cached_tokens, host_tokens)
        self.requests[state.request_id] = state
        priority.enqueue(self.waiting, state, resumed=False)
        self.num_prompt_tokens_total += state.num_prompt_tokens

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a live request (every sequence of a group) and free its blocks; None if the id
        is not live."""
        keys = self.group_keys.get(request_id) or {request_id}
        states = [self.requests[key] for key in sorted(keys) if key in self.requests]
        if not states:
            return None
        for state in states:
            self._remove(state)
        return states[0].output((), "", "abort")

    def release(self, request_id: str) -> bool:
        """Free the blocks of a finished prefill_only request and drop the pins of its progress
        events (also after an abort); False if it held neither."""
        pins = self.pins.pop(request_id, None)
        if pins:
            self.prefix_cache.free_sequence(pins)
        state = self.held.get(request_id)
        if state is None:
            return pins is not None
        self._remove(state)
        return True

    def table_refs(self, block_ids: Sequence[int]) -> dict[int, int]:
        """For those of block_ids in live requests' block tables, in how many tables."""
        refs: dict[int, int] = {}
        if not block_ids:
            return refs
        wanted = set(block_ids)
        for state in self.requests.values():
            for block_id in state.block_ids:
                if block_id in wanted:
                    refs[block_id] = refs.get(block_id, 0) + 1
        return refs

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Pick this step's chunks and make sure their blocks are allocated."""
        chunks: dict[str, ScheduledChunk] = {}
        budget = [self.max_num_batched_tokens]
        self.swap_ins.land(wait=False)
        decoding, prefilling = priority.step_order(self.running)
        preempted = False
        for state in decoding + prefilling:
            if budget[0] == 0:
                break
            if state.status is not RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            num_new = min(sequence_group.num_to_compute(state), budget[0])
            if not self._grow_or_preempt(
                state, state.num_computed_tokens + num_new, chunks, budget
            ):
                preempted = True
                continue
            chunks[state.request_id] = self._chunk(state, num_new)
            budget[0] -= num_new
        if not preempted or not chunks:
            self._admit(chunks, budget)
            self.priority_room.make_room(chunks, budget, self._admit)
            if not chunks and self.swap_ins:  # nothing else would run: wait for the copies
                self.swap_ins.land(wait=True)
                self._admit(chunks, budget)
            if not chunks and not self.running and self.waiting:
                while not chunks and self._strip_waiting_holder():
                    self._admit(chunks, budget)
        return ScheduledBatch(tuple(chunks.values()))

    # ---- helpers ------------------------------------------------------------------------

    def _blocks_needed(self, state: RequestState, end_pos: int) -> int:
        """Blocks to add so that the request's table covers positions [0, end_pos), plus the
        blocks a group's fork reserves when its prompt ends there."""
        num_table = max(-(-end_pos // self.block_size) - len(state.block_ids), 0)
        return num_table + sequence_group.num_fork_blocks(state, end_pos, self.block_size)

    def _grow(self, state: RequestState, end_pos: int, num_blocks: int) -> None:
        """Allocate num_blocks, what _blocks_needed(state, end_pos) counts (there is room):
        the table's new blocks, then the fork's reserved ones."""
        num_fork = sequence_group.num_fork_blocks(state, end_pos, self.block_size)
        new_block_ids = self.pool.allocate(num_blocks)
        assert new_block_ids is not None, state.request_id
        state.fork_block_ids.extend(new_block_ids[len(new_block_ids) - num_fork :])
        state.block_ids.extend(new_block_ids[: len(new_block_ids) - num_fork])

    def _chunk(self, state: RequestState, num_new: int) -> ScheduledChunk:
        start = state.num_computed_tokens
        end = start + num_new
        return ScheduledChunk(
            request_id=state.request_id,
            token_ids=state.token_ids(start, end),
            start_pos=start,
            block_ids=tuple(state.block_ids),
            need_logits=end == state.num_tokens,
            prompt_logprobs=state.scores_prompt_from(start),
            block_copy=sequence_group.block_copy(state, self.block_size),
        )

    def _grow_or_preempt(
        self,
        state: RequestState,
        end_pos: int,
        chunks: dict[str, ScheduledChunk],
        budget: list[int],
    ) -> bool:
        """Allocate blocks up to end_pos, preempting from the back; False if state was."""
        num_needed = self._blocks_needed(state, end_pos)
        while num_needed > self.pool.num_free:
            victim = priority.victim(self.running)
            dropped = chunks.pop(victim.request_id, None)
            if dropped is not None:
                budget[0] += len(dropped.token_ids)
            self._preempt(victim)
            if victim is state:
                return False
        self._grow(state, end_pos, num_needed)
        return True

    def _admit(self, chunks: dict[str, ScheduledChunk], budget: list[int]) -> None:
        head_blocked = False
        free_seats = sequence_group.free_seats(self.running, self.max_num_seqs)
        for state in list(self.waiting):
            if budget[0] == 0 or free_seats <= 0:
                return
            if sequence_group.num_seats(state) > free_seats:
                continue  # a group is admitted with room for every sequence it forks
            if (head_blocked and not state.block_ids) or state.request_id in self.swap_ins:
                continue  # first come first served, except for requests holding blocks
            cache = self.prefix_cache
            hit_ids = cache.match(state) if state.may_take_cached_prefix else []
            num_host = cache.match_host(state, len(hit_ids)) if state.may_take_cached_prefix else 0
            # Hits already referenced cost no free block; evictable ones leave the free lists.
            # Host hits need fresh blocks, as computed ones do.
            num_taken = self._blocks_needed(state, state.num_tokens) - len(hit_ids)
            if num_taken + cache.num_evictable(hit_ids) > self.pool.num_free:
                head_blocked = True
                continue
            num_from_host = cache.take(state, hit_ids) if hit_ids else 0
            if num_host and self.swap_ins.start(state, num_host):
                continue  # admitted once its copy landed (SwapIns)
            if state.num_cached_tokens is None:  # first scheduled: its hit is its cached prefix
                state.num_cached_tokens = min(state.num_computed_tokens, state.num_prompt_tokens)
                num_host_tokens = state.num_host_cached_tokens + num_from_host * self.block_size
                host_tokens = min(num_host_tokens, state.num_cached_tokens)
                state.num_host_cached_tokens = host_tokens
                self.prompt_token_sources.count(
                    state, state.num_computed_tokens - host_tokens, 0, host_tokens
                )
            num_new = min(sequence_group.num_to_compute(state), budget[0])
            end_pos = state.num_computed_tokens + num_new  # its first chunk's blocks only
            self._grow(state, end_pos, self._blocks_needed(state, end_pos))
            self.waiting.remove(state)
            self.running.append(state)
            state.start_running()
            chunks[state.request_id] = self._chunk(state, num_new)
            budget[0] -= num_new
            free_seats -= sequence_group.num_seats(state)

    def _strip_waiting_holder(self) -> bool:
        """Make the last waiting request holding blocks give them up; False if none holds any."""
        for state in reversed(self.waiting):
            if state.block_ids and state.request_id not in self.swap_ins:
                self._drop_blocks(state)
                self.num_preemptions_total += 1
                state.num_preemptions += 1
                return True
        return False

    def _preempt(self, state: RequestState) -> None:
        self.running.remove(state)
        self._drop_blocks(state)
        state.status = RequestStatus.WAITING
        state.num_preemptions += 1
        self.num_preemptions_total += 1
        priority.enqueue(self.waiting, state, resumed=True)

    def _drop_blocks(self, state: RequestState) -> None:
        sequence_group.drop_fork_blocks(state, self.pool)
        self.prefix_cache.free_sequence(state.block_ids)
        state.block_ids = []
        state.num_computed_tokens = 0
        state.num_registered_blocks = 0

    def _remove(self, state: RequestState) -> None:
        if state.status is RequestStatus.WAITING:
            self.waiting.remove(state)
        elif state.status is RequestStatus.RUNNING:
            self.running.remove(state)
        elif state.status is RequestStatus.HELD:
            del self.held[state.request_id]
        self.swap_ins.finish(state)  # a copy into its blocks completes before they go back
        sequence_group.drop_fork_blocks(state, self.pool)
        self.prefix_cache.free_sequence(state.block_ids)
        state.block_ids = []
        state.status = RequestStatus.FINISHED
        del self.requests[state.request_id]
        live = self.group_keys.get(state.group_id)
        if live is not None:
            live.discard(state.request_id)
            if not live:
                del self.group_keys[state.group_id]
