"""The router's reading of each prefill worker's cache events into a CacheIndex.

    follow       GET /internal/cache/events?since=SEQ and apply them; when the index has no
                 view of the worker yet, or the answer has another epoch (the worker
                 restarted) or a gap (the router fell behind), GET /internal/cache/snapshot
                 and load it instead (the events after it come on the next round)
    events_loop  with cache_aware prefill, every --cache-events-interval-s: follow every
                 healthy prefill instance at once, forget the views of instances that left;
                 /instances shows each view (epoch, next seq, blocks per tier)

Wire shapes: pdrouter.wire.cache_events. A worker with its prefix cache off answers 404: its
view is dropped and it is scored by load alone. A failed read changes nothing (the next round
tries again); meanwhile the index may be stale, which only steers worse.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from pydantic import ValidationError

from pdrouter.router.instances.cache_index import CacheIndex
from pdrouter.router.instances.instance import Instance
from pdrouter.router.instances.registry import Registry
from pdrouter.wire.cache_events import (
    CACHE_EVENTS_PATH,
    CACHE_SNAPSHOT_PATH,
    CacheEvents,
    CacheSnapshot,
)

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 2.0


async def follow(index: CacheIndex, client: httpx.AsyncClient, inst: Instance) -> None:
    """One round for one worker: its new events, or its snapshot (see the module doc)."""
    position = index.position(inst.url)
    try:
        if position is not None:
            resp = await client.get(
                f"{inst.url}{CACHE_EVENTS_PATH}",
                params={"since": position[1]},
                timeout=READ_TIMEOUT_S,
            )
            if _cache_off(index, inst, resp):
                return
            resp.raise_for_status()
            if index.apply(inst.url, CacheEvents.model_validate_json(resp.content)):
                return
        resp = await client.get(f"{inst.url}{CACHE_SNAPSHOT_PATH}", timeout=READ_TIMEOUT_S)
        if _cache_off(index, inst, resp):
            return
        resp.raise_for_status()
        index.load(inst.url, CacheSnapshot.model_validate_json(resp.content))
    except (httpx.HTTPError, ValidationError) as exc:
        logger.debug("cache events of %s: %s: %s", inst.describe(), type(exc).__name__, exc)


def _cache_off(index: CacheIndex, inst: Instance, resp: httpx.Response) -> bool:
    if resp.status_code != 404:
        return False
    index.forget(inst.url)
    return True


async def follow_all(index: CacheIndex, client: httpx.AsyncClient, registry: Registry) -> None:
    """One round: forget departed instances, follow every healthy prefill instance."""
    current = {inst.url for inst in registry.prefill}
    for url in [url for url in index.views if url not in current]:
        index.forget(url)
    await asyncio.gather(
        *(follow(index, client, inst) for inst in registry.prefill if inst.healthy)
    )


async def events_loop(
    registry: Registry, policy: object, client: httpx.AsyncClient, interval_s: float
) -> None:
    """follow_all into the prefill policy's index every interval_s, until cancelled; nothing
    for a policy without one."""
    index = getattr(policy, "index", None)
    if not isinstance(index, CacheIndex):
        return
    registry.add_describer(lambda inst: index.describe(inst.url))  # /instances shows the view
    while True:
        await asyncio.sleep(interval_s)
        await follow_all(index, client, registry)
