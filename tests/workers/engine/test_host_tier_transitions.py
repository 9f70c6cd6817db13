"""Every transition a block makes through the device cache and the host tier, in the scheduler:
computed, cached on device, copied to host, evicted from device, swapped back in, evicted from
host, and a swap-in that fails mid-copy. Exact block ids, ref counts, host entries, bytes."""

from __future__ import annotations

import numpy as np

from tests.workers.engine.caching_scheduler import FP, X, full_hashes, refs, req, tokens
from tests.workers.engine.char_tokenizer import CharDetokenizer
from workers.engine.block_pool import BlockPool
from workers.engine.host_policy import HostTierConfig, WritePolicy
from workers.engine.host_storage import SwapCopier
from workers.engine.host_tier import HostTier
from workers.engine.request_validation import RequestLimits
from workers.engine.scheduler import Scheduler

SLOT_BYTES = 2 * 4 * 4


def make(policy: WritePolicy = "write_through", num_slots: int = 2, num_blocks: int = 4):
    kv = [np.zeros((num_blocks, 1, 4, 1), np.float32) for _ in range(2)]  # [K0, V0]
    copier = SwapCopier(kv, np.zeros(num_slots * SLOT_BYTES, np.uint8), SLOT_BYTES)
    tier = HostTier(HostTierConfig(num_slots, policy), copier)
    s = Scheduler(BlockPool(num_blocks, enable_caching=True),
                  RequestLimits(4, num_blocks, max_model_len=16, vocab_size=128),
                  max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=(0,),
                  new_detokenizer=CharDetokenizer, new_seed=lambda: 7, fingerprint=FP,
                  host_tier=tier)  # fmt: skip
    return s, tier, kv


def run(s: Scheduler, kv: list[np.ndarray], token: int = X):
    """One step whose "model" writes each computed block's id + 1 into K (its KV), then the
    end-of-step flush, as LLMEngine.step does."""
    batch = s.schedule()
    for chunk in batch.chunks:
        for p in range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids)):
            kv[0][chunk.block_ids[p // 4], 0, p % 4] = 100 + chunk.token_ids[p - chunk.start_pos]
    outputs = s.update(batch, [token] * sum(c.need_logits for c in batch.chunks))
    s.prefix_cache.flush_host()
    s.pool.check_integrity()
    s.prefix_cache.host.check_integrity()
    return [(c.request_id, len(c.token_ids), c.start_pos, c.block_ids) for c in batch.chunks], {
        o.request_id: o for o in outputs
    }


def test_a_block_computed_cached_copied_evicted_from_device_and_from_host() -> None:
    s, tier, kv = make("write_through", num_slots=2)
    prompt = tokens(9)
    h = full_hashes(prompt)
    # computed -> cached on device -> copied to host (at the end of its step)
    s.add(req("a", prompt, max_tokens=1))
    assert run(s, kv)[0] == [("a", 9, 0, (0, 1, 2))]
    assert s.pool.cached_blocks() == {h[0]: 0, h[1]: 1}
    assert tier.entries() == {h[0]: 0, h[1]: 1}
    # evicted from device: another prompt takes every block (a's freed tail first)
    assert s.pool.free_ids() == [3, 2, 1, 0]
    other = tokens(13, offset=5)
    s.add(req("b", other, max_tokens=1))
    assert run(s, kv)[0] == [("b", 13, 0, (3, 2, 1, 0))]
    assert s.pool.lookup(h[0]) is None and s.pool.lookup(h[1]) is None
    # evicted from host: b's full blocks took both slots (LRU: h0, then h1); its third
    # found every entry of the tier written in this same flush and was skipped
    hb = full_hashes(other)
    assert tier.entries() == {hb[0]: 0, hb[1]: 1}
    stats = tier.stats()
    assert (stats.evictions, stats.writes_skipped, stats.blocks_written) == (2, 1, 4)


def _evict_a_from_device(policy: WritePolicy = "write_through"):
    """a's 2 full blocks computed (blocks 0, 1) then evicted by b, which takes every block."""
    s, tier, kv = make(policy, num_slots=6)
    prompt = tokens(9)
    s.add(req("a", prompt, max_tokens=1))
    run(s, kv)
    original = kv[0][[0, 1]].copy()
    s.add(req("b", tokens(13, offset=5), max_tokens=1))
    run(s, kv)
    assert not np.array_equal(kv[0][[0, 1]], original)  # b overwrote them
    assert s.pool.free_ids() == [0, 1, 2, 3]  # 0 uncached, then b's cached blocks
    return s, tier, kv, prompt, full_hashes(prompt), original


def test_a_host_hit_is_swapped_back_in_with_its_bytes_and_counted_as_host() -> None:
    s, tier, kv, prompt, h, original = _evict_a_from_device()
    assert s.pool.lookup(h[0]) is None and h[0] in tier and h[1] in tier
    s.add(req("c", prompt, max_tokens=4))
    batch, outputs = run(s, kv)
    assert batch == [("c", 1, 8, (0, 1, 2))]  # the swap-in took 0 and 1, the chunk 2
    assert np.array_equal(kv[0][[0, 1]], original)  # swapped back in, byte for byte
    assert s.pool.lookup(h[0]) == 0 and s.pool.lookup(h[1]) == 1
    assert (outputs["c"].num_cached_tokens, outputs["c"].num_host_cached_tokens) == (8, 8)
    t = s.prompt_token_sources
    assert (t.device_hit, t.host_hit, t.computed) == (0, 8, 9 + 13 + 1)
    assert tier.stats().blocks_read == 2
    # The next request hits them on the device: a device hit, not a host one.
    s.add(req("d", prompt, max_tokens=1))
    _, outputs = run(s, kv)
    assert (outputs["d"].num_cached_tokens, outputs["d"].num_host_cached_tokens) == (8, 0)
    assert refs(s, [0, 1]) == [1, 1]  # d finished in its step; c still holds them
    assert (s.prompt_token_sources.device_hit, s.prompt_token_sources.host_hit) == (8, 8)


def test_abort_after_a_swap_in_keeps_the_blocks_cached_on_the_device() -> None:
    s, _tier, kv, prompt, h, _ = _evict_a_from_device()
    s.add(req("c", prompt, max_tokens=4))
    run(s, kv)
    assert refs(s, [0, 1, 2]) == [1, 1, 1]
    s.abort("c")
    assert refs(s, [0, 1, 2]) == [0, 0, 0]
    assert s.pool.lookup(h[0]) == 0 and s.pool.lookup(h[1]) == 1
    # c's uncached tail block 2 to the free list; its prefix to the evictable list's back
    # (after b's block 3), so it is evicted last
    assert s.pool.free_ids() == [2, 3, 1, 0]


def test_a_lease_takes_host_blocks_and_adopt_counts_them_as_host() -> None:
    s, tier, kv, prompt, h, original = _evict_a_from_device("write_back")
    assert list(tier.entries()) == [h[1], h[0]]  # written back in eviction (LRU) order
    lease = s.prefix_cache.acquire(prompt, 1)  # both lease blocks come from the host tier
    assert lease is not None and (lease.block_ids, lease.num_cached_blocks) == ((0, 1), 2)
    assert np.array_equal(kv[0][[0, 1]], original)
    s.add(req("c", prompt, max_tokens=1, preallocated_block_ids=lease.block_ids,
              num_computed_tokens=8, num_cached_tokens=8))  # fmt: skip
    _, outputs = run(s, kv)
    assert (outputs["c"].num_cached_tokens, outputs["c"].num_host_cached_tokens) == (8, 8)
    t = s.prompt_token_sources
    assert (t.device_hit, t.host_hit, t.given_cached) == (0, 8, 0)
