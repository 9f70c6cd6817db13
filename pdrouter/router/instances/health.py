"""Health checks: GET /health of every instance, at start and then periodically.

startup      wait (bounded) until the static instances answer, fix the cluster fingerprint
check        one GET /health parsed as a WorkerHealth (pdrouter.wire.worker), counted by the
             registry (hysteresis: registry.py); a timeout is "slow", which a busy instance
             (its calls progress) is excused; a 200 whose body is no WorkerHealth fails
health_loop  every --health-interval-s: expire silent registrations, check everyone whose
             last check has ended (a busy instance's may wait --busy-health-timeout-s)
any_passes   one check of each routable instance of a role, now (a request's precheck)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx
from pydantic import ValidationError

from pdrouter.router.instances.instance import ROLES, Instance, Role, check_fingerprints
from pdrouter.router.instances.registry import Registry
from pdrouter.wire.errors import clip
from pdrouter.wire.worker import WorkerHealth

logger = logging.getLogger(__name__)

# The most characters of a failed check's problems kept in last_error (and the log): enough
# for a few missing or mistyped fields, never a whole body.
PROBLEMS_CLIP_CHARS = 240


async def check(
    registry: Registry, client: httpx.AsyncClient, inst: Instance, timeout_s: float
) -> bool:
    """GET /health once and count it; returns whether this check passed (200, a WorkerHealth
    body, the cluster's fingerprint; "degraded" passes), which is not yet `healthy` while
    recovering. An instance whose calls progress waits Registry.busy_window_s if that is
    longer than timeout_s."""
    if registry.busy(inst):
        timeout_s = max(timeout_s, registry.busy_window_s())
    try:
        resp = await client.get(f"{inst.url}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        slow = isinstance(exc, httpx.TimeoutException)  # refused or reset: not slow, gone
        registry.check_failed(inst, f"/health failed: {type(exc).__name__}: {exc}", slow)
        return False
    if resp.status_code != 200:
        registry.check_failed(inst, f"/health answered HTTP {resp.status_code}")
        return False
    try:
        answer = WorkerHealth.model_validate_json(resp.content)
    except ValidationError as exc:
        registry.check_failed(inst, f"/health answered {not_worker_health(exc)}")
        return False
    registry.check_passed(inst, answer)
    return inst.consecutive_successes > 0


def not_worker_health(exc: ValidationError) -> str:
    """What is wrong with a /health body that is no WorkerHealth, clipped: each problem as
    `field: message` (the worker's values are not quoted; a broken one can be any size)."""
    problems = "; ".join(
        f"{'.'.join(str(part) for part in err['loc']) or 'body'}: {err['msg']}"
        for err in exc.errors(include_url=False, include_input=False)
    )
    return f"a body that is not a WorkerHealth ({clip(problems, PROBLEMS_CLIP_CHARS)})"


async def check_all(registry: Registry, client: httpx.AsyncClient, timeout_s: float) -> None:
    await asyncio.gather(*(check(registry, client, inst, timeout_s) for inst in registry.all()))


async def startup(
    registry: Registry, client: httpx.AsyncClient, wait_s: float, poll_interval_s: float = 0.5
) -> str | None:
    """Wait (bounded) until every static instance answers, then fix the cluster fingerprint.

    Raises FingerprintMismatch when instances disagree, or RuntimeError when no prefill or
    no decode instance answered within wait_s; instances still silent then start as down.
    With no static instance there is nothing to wait for: None, and the first worker to
    register fixes the fingerprint.
    """
    if not registry.all():
        return None
    deadline = time.monotonic() + wait_s
    while True:
        await check_all(registry, client, timeout_s=min(2.0, max(wait_s, 0.1)))
        if all(inst.healthy for inst in registry.all()) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(poll_interval_s)
    for role in ROLES:
        if not registry.healthy(role):
            errors = "; ".join(f"{inst.url}: {inst.last_error}" for inst in registry.of_role(role))
            raise RuntimeError(f"no {role} instance is healthy after {wait_s:.0f}s ({errors})")
    registry.fingerprint = check_fingerprints(registry.all())
    for inst in registry.all():
        if not inst.healthy:
            logger.warning("%s not healthy at start: %s", inst.describe(), inst.last_error)
    return registry.fingerprint


async def health_loop(
    registry: Registry, client: httpx.AsyncClient, interval_s: float, heartbeat_ttl_s: float
) -> None:
    """Re-check every instance; a restarted worker comes back within one interval. Each
    instance's check runs on its own, so that a busy instance's long check delays no other
    instance's; an instance whose last check still waits is not checked again meanwhile."""
    url_to_check: dict[str, asyncio.Task[bool]] = {}
    try:
        while True:
            await asyncio.sleep(interval_s)
            registry.expire_heartbeats(heartbeat_ttl_s)
            current = {inst.url: inst for inst in registry.all()}
            for url in [u for u, task in url_to_check.items() if task.done()]:
                with contextlib.suppress(httpx.HTTPError):
                    url_to_check.pop(url).result()
            for url, inst in current.items():
                if url not in url_to_check:
                    url_to_check[url] = asyncio.ensure_future(
                        check(registry, client, inst, min(2.0, interval_s))
                    )
    finally:
        for task in url_to_check.values():
            task.cancel()


async def any_passes(
    registry: Registry, client: httpx.AsyncClient, role: Role, timeout_s: float
) -> bool:
    """Whether one routable instance of role passes a check made now (one pass is enough to
    try it: the thresholds are for the rotation)."""
    insts = registry.routable(role)
    passed = await asyncio.gather(*(check(registry, client, inst, timeout_s) for inst in insts))
    return any(passed)
