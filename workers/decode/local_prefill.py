"""A decode request without a KV handle: D prefills the prompt itself.

Two requests come to D this way: one P left to D (conditional disaggregation: its uncached
prompt suffix was shorter than the router's threshold, pdrouter.wire.pd.LocalPrefill), which
has no output token yet, and the resume of such a request on another D after a failure,
which carries the tokens the client already has. Either way there is nothing of P's to read:

    prefix   the prompt's device + pool prefix as a lease, exactly as P takes it
             (workers/handoff/pool_prefix.py): D's own cache first, then the pool's blocks
             written by any P or by a D's write-back
    admit    the engine request over the lease (num_cached_tokens = its tokens, a cache hit),
             or plain when there is none (the engine takes its own device hit)
    first    the engine samples the first token at the prompt's end from (seed, position),
             so it equals P's and the mixed worker's

What the client's usage reports as cached_tokens is the engine's count (RequestOutput.
num_cached_tokens), in the final DecodeEvent beside the pool's part of it.
"""

from __future__ import annotations

import dataclasses

from pdrouter.wire.pd import DecodeRequest
from workers.engine.api import EngineRequest, RequestOutput
from workers.handoff.pool_prefix import PoolPrefix, PoolPrefixReader, PrefixReadLimits
from workers.pool.keys import block_keys
from workers.server.pd_worker import PDSeam


def prefix_reader(seam: PDSeam) -> PoolPrefixReader:
    """D's pool prefix reader, with the bounds P's has (the same PDSettings flags; the
    decode room does not import the prefill room's workers.prefill.stages.prefix_reader)."""
    s = seam.settings
    limits = PrefixReadLimits(
        s.pool_prefix_min_tokens, s.pool_load_timeout_s, s.transfer_batch_blocks, s.wait_s
    )
    return PoolPrefixReader(
        seam.engine,
        seam.pool,
        seam.identity.block_size,
        limits,
        seam.cache_metrics,
        seam.background,
    )


async def prompt_prefix(seam: PDSeam, req: DecodeRequest) -> PoolPrefix:
    """The prompt's device + pool prefix as a lease the caller owns (the pool's part only
    when the worker reads the pool as a prefix cache); never raises for a pool failure."""
    if not seam.settings.pool_prefix:
        return PoolPrefix()
    identity = seam.identity
    keys = block_keys(
        identity.fingerprint, req.prompt_token_ids, identity.block_size, scope=req.cache_scope
    )
    return await prefix_reader(seam).acquire(req.prompt_token_ids, keys, req.cache_scope)


def over_prefix(engine_req: EngineRequest, prefix: PoolPrefix) -> EngineRequest:
    """engine_req (admitted with no blocks) added over the prefix's lease, if it has one."""
    lease = prefix.lease
    if lease is None:
        return engine_req
    assert not engine_req.preallocated_block_ids, "a request without a handle loads nothing"
    return dataclasses.replace(
        engine_req,
        preallocated_block_ids=lease.block_ids,
        num_computed_tokens=lease.num_computed_tokens,
        num_cached_tokens=lease.num_computed_tokens,
    )


def cached_split(num_prompt: int, first: RequestOutput, prefix: PoolPrefix) -> tuple[int, int]:
    """(prompt tokens taken from a cache, of them from the pool), once the engine has
    started (its own device hit is known then)."""
    num_cached = min(first.num_cached_tokens, num_prompt)
    return num_cached, min(prefix.num_pool_tokens, num_cached)


def observe_prefill(
    seam: PDSeam, req: DecodeRequest, first: RequestOutput, prefix: PoolPrefix
) -> None:
    """Count the prompt's tokens by source (D's load of a handoff counts as `handoff`
    elsewhere; here every token came from a cache or was computed)."""
    num_prompt = len(req.prompt_token_ids)
    num_cached, num_pool = cached_split(num_prompt, first, prefix)
    num_host = min(first.num_host_cached_tokens, num_cached - num_pool)
    seam.server_metrics.count_prompt_sources(
        device=num_cached - num_pool - num_host,
        host=num_host,
        pool=num_pool,
        computed=num_prompt - num_cached,
    )
