"""The device prefix cache under cache scopes (tenants, cache_salt): a scope's blocks are
registered under its own chain and never matched, leased or counted as cached by another
scope, while one scope keeps sharing exactly as before."""

from __future__ import annotations

from tests.workers.engine.caching_scheduler import FP, make, req, step, tokens
from workers.pool.keys import block_hashes

ALICE, BOB = "a" * 64, "b" * 64


def _run(s, rid: str, prompt: tuple[int, ...], scope: str | None) -> int:
    """Run one request to its end; its num_cached_tokens."""
    s.add(req(rid, prompt, max_tokens=1, cache_scope=scope))
    outputs: dict = {}
    while rid not in outputs or not outputs[rid].finished:
        outputs.update(step(s)[1])
    return outputs[rid].num_cached_tokens


def test_a_scope_never_hits_another_scopes_blocks() -> None:
    s = make()
    prompt = tokens(9)  # blocks 0 and 1 may hit (the last token is always computed)
    assert _run(s, "alice-1", prompt, ALICE) == 0
    assert _run(s, "bob", prompt, BOB) == 0  # the same tokens, another tenant
    assert _run(s, "shared", prompt, None) == 0  # nor the unscoped cache
    assert _run(s, "alice-2", prompt, ALICE) == 8  # its own blocks: 2 full blocks
    assert _run(s, "bob-2", prompt, BOB) == 8
    assert s.prompt_token_sources.device_hit == 16
    s.pool.check_integrity()


def test_blocks_are_registered_under_the_scoped_chain() -> None:
    s = make()
    prompt = tokens(9)
    _run(s, "alice", prompt, ALICE)
    scoped = block_hashes(FP, prompt[:8], 4, ALICE)
    assert [s.pool.lookup(h) is not None for h in scoped] == [True, True]
    assert [s.pool.lookup(h) for h in block_hashes(FP, prompt[:8], 4)] == [None, None]


def test_a_lease_takes_device_hits_of_its_own_scope_only() -> None:
    s = make()
    prompt = tokens(9)
    _run(s, "alice", prompt, ALICE)
    other = s.prefix_cache.acquire(prompt, 0, BOB)
    assert other is not None and other.num_cached_blocks == 0
    own = s.prefix_cache.acquire(prompt, 0, ALICE)
    assert own is not None and own.num_cached_blocks == 2
    for lease in (other, own):
        s.prefix_cache.free_sequence(lease.block_ids)
    s.pool.check_integrity()
