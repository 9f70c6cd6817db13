"""Conditional disaggregation, P's side: whether a prompt is better prefilled by D itself.

The handoff through the pool has a cost of its own (P's write, D's read, one more hop before
the second token) that a short computation does not pay back: the router sets a threshold
(PrefillRequest.local_prefill_below_tokens, from docs/benchmarks/pd.md's crossover) and P,
the tokenizer of record, counts the prompt tokens its caches do not hold:

    device match   engine.acquire_prefix(tokens, 0): the device-cached run (released at once)
    pool lookup    one exists() batch on the full-block keys after it, only when the answer
                   depends on it; a hit under --pool-prefix-min-tokens counts as a miss (P
                   would not load it either)
    uncached       prompt tokens - hit (the last token is always computed)

    uncached < threshold  -> LocalPrefill: P answers at once, computing nothing; D prefills
                             the prompt over its own device cache and the pool's prefix
    otherwise             -> the usual prefill (the lease stage looks the prefix up again)

The lookup is skipped when even a full hit, or no pool hit, would decide the same way, so a
long cold prompt or a short one costs P no pool call. A pool that fails or is slow counts as
a miss: the decision errs towards PD, which is always correct.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from pdrouter.wire.pd import LocalPrefill
from workers.handoff.pool_prefix import hit_run
from workers.handoff.priority_threads import handoff_threads
from workers.pool.errors import PoolError
from workers.prefill.stages import PrefillPlan
from workers.server.pd_worker import PDSeam

log = logging.getLogger(__name__)


def num_uncached(num_prompt_tokens: int, num_hit_blocks: int, block_size: int) -> int:
    """Prompt tokens a prefill computes over a hit of num_hit_blocks full blocks: at least the
    last one, whose logits give the first token."""
    return num_prompt_tokens - min(num_hit_blocks * block_size, num_prompt_tokens - 1)


async def _pool_run(seam: PDSeam, keys: Sequence[str], priority: int) -> int:
    """Blocks of keys the pool holds from the first on; 0 on an error or past the bound. The
    lookup waits on the handoff threads by the request's priority."""
    pool = seam.pool
    if not keys or not seam.settings.pool_prefix or not pool.is_open:
        return 0
    try:
        async with asyncio.timeout(seam.settings.pool_load_timeout_s):
            present = await handoff_threads().run(priority, pool.exists, list(keys))
    except (PoolError, TimeoutError) as exc:
        log.warning("pool lookup for the local prefill decision failed (%r): prefill on P", exc)
        return 0
    run = hit_run([present])
    if run * seam.identity.block_size < seam.settings.pool_prefix_min_tokens:
        return 0
    return run


async def decide(seam: PDSeam, plan: PrefillPlan, threshold_tokens: int) -> LocalPrefill | None:
    """LocalPrefill when fewer than threshold_tokens of the prompt are missing from P's
    device cache and the pool, else None (prefill here). threshold_tokens 0: never local."""
    if threshold_tokens <= 0:
        return None
    tokens = plan.prepared.prompt_token_ids
    num_prompt = len(tokens)
    bs = seam.identity.block_size
    max_blocks = (num_prompt - 1) // bs  # full blocks a hit may cover
    if num_uncached(num_prompt, max_blocks, bs) >= threshold_tokens:
        return None  # even a full hit leaves too much to compute
    uncached = num_prompt
    if num_prompt >= threshold_tokens:  # short prompts are local without a look
        scope = plan.engine_req.cache_scope
        device = await seam.engine.acquire_prefix(tokens, 0, scope)
        assert device is not None, "a lease without extra blocks always fits"
        num_device = device.num_cached_blocks
        seam.engine.release_lease(device)
        uncached = num_uncached(num_prompt, num_device, bs)
        if uncached >= threshold_tokens:
            priority = plan.engine_req.params.priority
            run = await _pool_run(seam, plan.keys[num_device:max_blocks], priority)
            uncached = num_uncached(num_prompt, num_device + run, bs)
    if uncached >= threshold_tokens:
        return None
    log.info(
        "prefill %s: %d of %d prompt tokens uncached, below %d: prefill on decode",
        plan.engine_req.request_id,
        uncached,
        num_prompt,
        threshold_tokens,
    )
    return LocalPrefill(
        request_id=plan.engine_req.request_id,
        prompt_token_ids=list(tokens),
        num_uncached_tokens=uncached,
        threshold_tokens=threshold_tokens,
    )
