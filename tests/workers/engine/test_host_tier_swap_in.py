"""A swap-in under way (host tier -> device) in the scheduler: its request stays out of the
batch while others run, lands with its bytes, is waited for when nothing else would run, and
an abort or a failure mid-copy frees its blocks only after the copy ended. The copies are
gated so that the test decides when bytes land (and checks nothing was freed before)."""

from __future__ import annotations

import numpy as np

from tests.workers.engine.caching_scheduler import full_hashes, refs, req, tokens
from tests.workers.engine.test_host_tier_transitions import make, run
from workers.engine.host_storage import SwapCopier
from workers.engine.scheduler import Scheduler


class _Gate:
    """A copy handle whose copy runs when landed (or waited for); it then raises if told."""

    def __init__(self, run_copy) -> None:
        self._run_copy, self.landed, self.fail = run_copy, False, False

    def done(self) -> bool:
        return self.landed

    def wait(self) -> None:
        self.land()
        if self.fail:
            raise RuntimeError("injected: the swap-in copy failed midway")

    def land(self) -> None:
        if not self.landed:
            self.landed = True
            self._run_copy()


class _GatedCopier:
    def __init__(self, inner: SwapCopier, s: Scheduler) -> None:
        self.inner, self.slot_bytes, self.s = inner, inner.slot_bytes, s
        self.gates: list[_Gate] = []

    def copy(self, block_ids: list[int], slots: list[int], mode: int) -> None:
        self.inner.copy(block_ids, slots, mode)

    def start(self, block_ids: list[int], slots: list[int], mode: int) -> _Gate:
        def run_copy() -> None:
            assert all(self.s.pool.ref_count(b) == 1 for b in block_ids), "freed mid-copy"
            self.inner.copy(block_ids, slots, mode)

        self.gates.append(_Gate(run_copy))
        return self.gates[-1]


def _swap_in_flight():
    """a's blocks evicted to the host tier; r decoding; c (a's prompt) added, its swap-in to
    start at the next step."""
    s, tier, kv = make("write_through", num_slots=6, num_blocks=6)
    prompt = tokens(9)
    s.add(req("a", prompt, max_tokens=1))
    run(s, kv)
    original = kv[0][[0, 1]].copy()
    s.pool.free(sorted(s.pool.allocate(6)))  # every block taken: a's evicted (to the host)
    kv[0][:] = 0
    assert s.pool.free_ids() == [0, 1, 2, 3, 4, 5] and s.pool.num_cached == 0
    s.add(req("r", tokens(5, offset=9), max_tokens=4))
    run(s, kv)
    gated = _GatedCopier(tier._copier, s)
    tier._copier = gated
    s.add(req("c", prompt, max_tokens=2))
    return s, tier, kv, gated, full_hashes(prompt), original


def test_a_swap_in_in_flight_keeps_its_request_out_of_the_batch_until_it_lands() -> None:
    s, tier, kv, gated, h, original = _swap_in_flight()
    batch, _ = run(s, kv)
    assert batch == [("r", 1, 5, (0, 1))]  # r decodes beside the copy; c is not scheduled
    c = s.requests["c"]
    assert (c.block_ids, c.num_computed_tokens, refs(s, [2, 3])) == ([2, 3], 0, [1, 1])
    assert s.pool.block_hash(2) is None and s.pool.block_hash(3) is None  # not yet cached
    assert tier._pins == {h[0]: 1, h[1]: 1}
    assert run(s, kv)[0] == [("r", 1, 6, (0, 1))]  # still copying: still not scheduled
    gated.gates[0].land()
    batch, outputs = run(s, kv)
    assert batch == [("r", 1, 7, (0, 1)), ("c", 1, 8, (2, 3, 4))]
    assert np.array_equal(kv[0][[2, 3]], original)
    assert (outputs["c"].num_cached_tokens, outputs["c"].num_host_cached_tokens) == (8, 8)
    assert s.pool.lookup(h[0]) == 2 and tier._pins == {}
    assert s.prompt_token_sources.host_hit == 8


def test_nothing_else_to_run_waits_for_the_swap_in_instead_of_an_empty_batch() -> None:
    s, _, kv, gated, _, original = _swap_in_flight()
    s.abort("r")
    batch, _ = run(s, kv)
    assert gated.gates[0].landed and batch == [("c", 1, 8, (2, 3, 4))]
    assert np.array_equal(kv[0][[2, 3]], original)


def test_abort_mid_copy_waits_for_the_copy_then_frees_the_blocks() -> None:
    s, tier, kv, gated, h, _ = _swap_in_flight()
    run(s, kv)
    assert not gated.gates[0].landed
    s.abort("c")  # the gate's copy asserts the blocks were still referenced when it ran
    assert gated.gates[0].landed and tier._pins == {}
    assert refs(s, [2, 3]) == [0, 0]
    # landed, so cached (they hold a's KV), and freed tail first
    assert s.pool.lookup(h[0]) == 2 and s.pool.free_ids()[-2:] == [3, 2]
    s.pool.check_integrity()
    tier.check_integrity()


def test_a_swap_in_that_fails_mid_copy_frees_its_blocks_and_the_request_computes() -> None:
    s, tier, kv, gated, h, _ = _swap_in_flight()
    run(s, kv)
    gated.gates[0].fail = True
    gated.gates[0].land()
    batch, outputs = run(s, kv)
    # The swap-in's blocks 2, 3 went back uncached (to the free list's back); c computes
    # its whole prompt, and is never swapped in again.
    assert batch == [("r", 1, 6, (0, 1)), ("c", 9, 0, (4, 5, 2))]
    assert outputs["c"].num_cached_tokens == 0 and len(gated.gates) == 1
    assert h[0] in tier and h[1] in tier and tier._pins == {}
    assert tier.stats().blocks_read == 0 and s.prompt_token_sources.host_hit == 0
