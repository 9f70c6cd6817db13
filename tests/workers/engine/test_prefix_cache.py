"""Device prefix cache in the scheduler: exact block ids, ref counts, hash map contents and
eviction order after hits, frees, preemption, abort, release and decode-role blocks."""

from __future__ import annotations

from tests.workers.engine.caching_scheduler import (
    A,
    X,
    full_hashes,
    make,
    refs,
    req,
    sources,
    step,
    tokens,
)
from workers.engine.request_state import RequestStatus


def test_full_blocks_are_registered_as_computed_and_stay_cached_after_finish() -> None:
    s = make()
    prompt = tokens(9)
    s.add(req("a", prompt, max_tokens=4))
    h = full_hashes((*prompt, X, X, X))
    assert step(s)[0] == [("a", 9, 0, (0, 1, 2))]
    assert s.pool.cached_blocks() == {h[0]: 0, h[1]: 1}  # block 2 holds 1 of 4 tokens
    step(s)
    step(s)
    assert s.pool.cached_blocks() == {h[0]: 0, h[1]: 1}
    _, outputs = step(s)  # computes position 11: block 2 full (prompt[8], x, x, x)
    assert outputs["a"].finish_reason == "length"
    assert outputs["a"].num_cached_tokens == 0
    assert s.pool.cached_blocks() == {h[0]: 0, h[1]: 1, h[2]: 2}
    # Freed tail first: the prefix is evicted last.
    assert s.pool.free_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert (s.pool.num_used, s.pool.num_cached) == (0, 3)
    assert sources(s) == (0, 0, 0, 9)


def test_a_new_request_takes_the_cached_prefix_and_computes_only_the_rest() -> None:
    s = make()
    prompt = tokens(9)
    s.add(req("a", prompt, max_tokens=1))
    step(s)
    assert s.pool.free_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    s.add(req("b", (*prompt[:8], ord("q"), ord("r")), max_tokens=3))
    batch, outputs = step(s)
    assert batch == [("b", 2, 8, (0, 1, 3))]  # cap (10 - 1) // 4 = 2 blocks, both hit
    assert outputs["b"].num_cached_tokens == 8
    assert refs(s, [0, 1, 2, 3]) == [1, 1, 0, 1]
    # The same prompt as "a", 9 tokens: one past a block boundary, so it computes 1 token,
    # sharing blocks 0 and 1 with the running "b".
    s.add(req("c", prompt, max_tokens=2))
    batch, outputs = step(s)
    assert batch == [("b", 1, 10, (0, 1, 3)), ("c", 1, 8, (0, 1, 4))]
    assert outputs["c"].num_cached_tokens == 8
    assert refs(s, [0, 1, 2, 3, 4]) == [2, 2, 0, 1, 1]
    assert s.pool.free_ids() == [5, 6, 7, 2]
    assert sources(s) == (16, 0, 0, 9 + 2 + 1)


def test_an_entirely_cached_prompt_on_a_block_boundary_recomputes_its_last_block() -> None:
    s = make()
    prompt = tokens(8)
    h = full_hashes(prompt)
    s.add(req("a", prompt, max_tokens=1))
    step(s)
    assert s.pool.cached_blocks() == {h[0]: 0, h[1]: 1}
    s.add(req("b", prompt, max_tokens=1))
    batch, outputs = step(s)
    # Both blocks are cached, but the last one holds the last prompt token, whose logits
    # give the first token: only block 0 is taken, tokens 4..7 are computed into block 2.
    assert batch == [("b", 4, 4, (0, 2))]
    assert outputs["b"].num_cached_tokens == 4
    # Block 2 now holds h[1]'s content too; the first registration (block 1) wins.
    assert s.pool.cached_blocks() == {h[0]: 0, h[1]: 1}
    assert s.pool.block_hash(2) is None
    assert s.pool.free_ids() == [3, 4, 5, 6, 7, 2, 1, 0]


def test_requests_racing_on_a_new_prefix_both_compute_it_and_the_first_registers() -> None:
    s = make()
    prompt = tokens(9)
    h = full_hashes(prompt)
    s.add(req("a", prompt, max_tokens=1))
    s.add(req("b", prompt, max_tokens=1))
    batch, outputs = step(s)
    # Admitted in the same step: nothing was registered yet, so nothing is shared.
    assert batch == [("a", 9, 0, (0, 1, 2)), ("b", 9, 0, (3, 4, 5))]
    assert [outputs[r].num_cached_tokens for r in "ab"] == [0, 0]
    assert s.pool.cached_blocks() == {h[0]: 0, h[1]: 1}
    # a's cached blocks are evictable; b's duplicates went back uncached, to the free list.
    assert s.pool.free_ids() == [6, 7, 2, 5, 4, 3, 1, 0]
    assert sources(s) == (0, 0, 0, 18)


def test_eviction_takes_never_cached_blocks_first_then_the_least_recently_released() -> None:
    s = make(num_blocks=6)
    first, second, third = tokens(8), tokens(8, 10), tokens(12, 20)
    ha, hb, hc = full_hashes(first), full_hashes(second), full_hashes(third)
    for rid, prompt in (("a", first), ("b", second)):
        s.add(req(rid, prompt, max_tokens=1))
        step(s)
    assert s.pool.free_ids() == [4, 5, 1, 0, 3, 2]
    s.add(req("c", third, max_tokens=1))
    assert step(s)[0] == [("c", 12, 0, (4, 5, 1))]  # free blocks, then a's tail (LRU)
    assert s.pool.cached_blocks() == {ha[0]: 0, hb[0]: 2, hb[1]: 3, hc[0]: 4, hc[1]: 5, hc[2]: 1}
    assert s.pool.free_ids() == [0, 3, 2, 1, 5, 4]
    # "a"'s prompt plus one token: its first block is still cached, its second was evicted.
    s.add(req("d", (*first, X), max_tokens=1))
    batch, outputs = step(s)
    assert batch == [("d", 5, 4, (0, 3, 2))]  # evicts b's tail, then b's head
    assert outputs["d"].num_cached_tokens == 4
    # d's block 3 holds a's second block again and is registered under its hash.
    assert s.pool.cached_blocks() == {ha[0]: 0, hc[0]: 4, hc[1]: 5, hc[2]: 1, ha[1]: 3}


def test_preemption_drops_references_and_the_resumed_request_rematches() -> None:
    s = make(num_blocks=4, block_size=2)
    s.add(req("a", tokens(3), max_tokens=3))
    s.add(req("b", tokens(3, 3), max_tokens=6))
    assert step(s, A)[0] == [("a", 3, 0, (0, 1)), ("b", 3, 0, (2, 3))]
    assert step(s, A)[0] == [("a", 1, 3, (0, 1)), ("b", 1, 3, (2, 3))]
    hb = full_hashes((*tokens(3, 3), A), 2)
    assert s.pool.cached_blocks()[hb[1]] == 3
    # Both need a third block; "a" preempts "b", whose blocks stay cached (tail first), and
    # takes b's tail, the least recently released.
    batch, outputs = step(s, A)
    assert batch == [("a", 1, 4, (0, 1, 3))]
    b = s.requests["b"]
    assert (b.status, b.block_ids, b.num_computed_tokens) == (RequestStatus.WAITING, [], 0)
    assert hb[1] not in s.pool.cached_blocks() and s.pool.lookup(hb[0]) == 2
    assert outputs["a"].finish_reason == "length"
    assert s.pool.free_ids() == [3, 2, 1, 0]
    # "b" resumes: its first block is still cached; its second was evicted, and is computed
    # again with the rest, in blocks taken from the free list and then a's tail.
    batch, outputs = step(s, A)
    assert batch == [("b", 3, 2, (2, 3, 1))]
    assert outputs["b"].num_cached_tokens == 0  # fixed when it was first scheduled
    assert s.requests["b"].num_preemptions == 1
    assert sources(s) == (0, 0, 0, 6)


def test_abort_drops_references_and_keeps_the_blocks_cached() -> None:
    s = make()
    prompt = tokens(9)
    s.add(req("a", prompt))
    step(s)
    s.abort("a")
    assert s.pool.free_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert s.pool.cached_blocks() == dict(zip(full_hashes(prompt), [0, 1], strict=True))
    s.add(req("b", prompt))
    assert step(s)[0] == [("b", 1, 8, (0, 1, 3))]
    aborted = s.abort("b")
    assert (aborted.finish_reason, aborted.num_cached_tokens) == ("abort", 8)


def test_held_prefill_only_blocks_are_shared_then_cached_after_release() -> None:
    s = make()
    prompt = tokens(9)
    s.add(req("p", prompt, prefill_only=True))
    _, outputs = step(s)
    assert (outputs["p"].block_ids, outputs["p"].num_cached_tokens) == ((0, 1, 2), 0)
    assert s.pool.cached_blocks() == dict(zip(full_hashes(prompt), [0, 1], strict=True))
    s.add(req("m", prompt))
    assert step(s)[0] == [("m", 1, 8, (0, 1, 3))]
    assert refs(s, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert s.release("p")
    assert refs(s, [0, 1, 2, 3]) == [1, 1, 0, 1]
    assert s.pool.free_ids() == [4, 5, 6, 7, 2]
    s.abort("m")
    assert s.pool.free_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert s.pool.num_cached == 2


def test_decode_role_blocks_are_registered_when_the_request_is_added() -> None:
    s = make()
    prompt = tokens(9)
    h = full_hashes(prompt)
    assert s.pool.allocate(3) == [0, 1, 2]
    s.add(
        req(
            "d",
            prompt,
            output_token_ids=(X,),
            preallocated_block_ids=(0, 1, 2),
            num_computed_tokens=9,
        )
    )
    # P's KV for tokens 0..8 is in the blocks: the two full ones are cached at once.
    assert s.pool.cached_blocks() == {h[0]: 0, h[1]: 1}
    assert sources(s) == (0, 0, 9, 0)  # loaded from the handoff: not a cache hit
    batch, outputs = step(s)
    assert batch == [("d", 1, 9, (0, 1, 2))]
    assert outputs["d"].num_cached_tokens == 0
    s.add(req("m", prompt))
    batch, outputs = step(s)
    assert batch == [("d", 1, 10, (0, 1, 2)), ("m", 1, 8, (0, 1, 3))]
    assert outputs["m"].num_cached_tokens == 8
    assert sources(s) == (8, 0, 9, 1)


def test_caching_off_hashes_and_shares_nothing() -> None:
    s = make(caching=False)
    prompt = tokens(9)
    s.add(req("a", prompt, max_tokens=1))
    step(s)
    s.add(req("b", prompt, max_tokens=1))
    batch, outputs = step(s)
    assert batch == [("b", 9, 0, (3, 4, 5))]
    assert outputs["b"].num_cached_tokens == 0
    assert s.pool.num_cached == 0 and s.requests == {}
    assert s.pool.free_ids() == [6, 7, 0, 1, 2, 3, 4, 5]  # today's FIFO, in table order
    assert sources(s) == (0, 0, 0, 18)
