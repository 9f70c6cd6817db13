"""The router's view of its prefill and decode instances: health, fingerprints, load.

Instances come from the command line (static) or register themselves (`POST /instances`, see
instances_api) and then heartbeat. Every instance answers GET /health with JSON holding at
least `fingerprint` and `block_size` (and `model`, `role`). The registry refuses instances
whose fingerprint differs from the cluster's (their KV blocks would not be interchangeable).

Health has hysteresis (HealthThresholds): an instance goes down after N failed health checks
in a row, or at once when a request to it fails at the transport level (mark_down), and comes
back after M successful checks in a row. An instance never healthy yet (loading) comes up on
its first success. A draining instance takes no new request; the requests it holds finish.
Plain Python state; the router's event loop is the only writer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from pdrouter.router.instances.call_guard import CallGuard, abandon_stalled

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
Source = Literal["static", "registered"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


class FingerprintMismatch(RuntimeError):
    """Two instances whose KV blocks are not interchangeable (message names both)."""


class RegistrationConflict(ValueError):
    """A registration that contradicts the registry (same URL, other role)."""


@dataclass(frozen=True)
class HealthThresholds:
    """Consecutive failed checks before an instance is down, successes before it is back.

    The defaults (1, 1) follow every check at once; `pdrouter serve` passes its flags.
    """

    unhealthy_after: int = 1
    healthy_after: int = 1
    # A call to an instance the checks find down is given up once it has had nothing from
    # the instance for this long (pdrouter.router.instances.call_guard).
    abandon_after_s: float = 10.0

    def __post_init__(self) -> None:
        if self.unhealthy_after < 1 or self.healthy_after < 1:
            raise ValueError(f"health thresholds must be >= 1, got {self}")
        if self.abandon_after_s <= 0:
            raise ValueError(f"abandon_after_s must be > 0, got {self.abandon_after_s}")


@dataclass
class Instance:
    """One worker as the router sees it. Mutable: health and load change at run time."""

    url: str
    role: Role
    healthy: bool = False
    fingerprint: str | None = None
    block_size: int | None = None
    model: str | None = None
    in_flight: int = 0
    # Tokens of the requests in flight (estimated prompt on P, prompt + max_tokens on D).
    in_flight_tokens: int = 0
    last_error: str = "not checked yet"
    last_change_s: float = 0.0
    # When a call or a health check last failed; None once healthy (or never checked).
    down_since_s: float | None = None
    instance_id: str = ""
    source: Source = "static"
    # Draining: no new request is sent here; the ones in flight finish.
    draining: bool = False
    # Requests the worker holds at once (its --max-pending-requests), as it registered.
    capacity: int | None = None
    num_kv_blocks: int | None = None
    # Registered instances only: when the last heartbeat (or the registration) arrived.
    last_heartbeat_s: float | None = None
    # False until the first passed check: a worker still loading comes up on its first pass.
    ever_healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # Calls in flight to it (pdrouter.router.instances.call_guard.CallGuard); health checks
    # that find it down give up those it has left silent too long.
    calls: set[CallGuard] = field(default_factory=set)

    def describe(self) -> str:
        return f"{self.role} {self.url}"


def check_fingerprints(instances: list[Instance]) -> str:
    """The one fingerprint every checked instance shares; raises FingerprintMismatch otherwise.

    Instances never checked (fingerprint None) are ignored; at least one must have answered.
    """
    known = [inst for inst in instances if inst.fingerprint is not None]
    if not known:
        raise FingerprintMismatch("no instance answered /health with a fingerprint")
    first = known[0]
    for inst in known[1:]:
        if inst.fingerprint != first.fingerprint:
            raise FingerprintMismatch(
                f"{first.describe()} has fingerprint {first.fingerprint} (block size "
                f"{first.block_size}, model {first.model}) but {inst.describe()} has "
                f"{inst.fingerprint} (block size {inst.block_size}, model {inst.model}): their "
                "KV blocks are not interchangeable; serve the same model, dtype and block size "
                "on every prefill and decode instance"
            )
    return first.fingerprint  # type: ignore[return-value]


class Registry:
    """Prefill and decode instances with their health; one per router app.

    Static lists name both roles or neither (neither: every instance registers itself).
    clock is injectable so that heartbeat expiry is tested without sleeping.
    """

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        thresholds: HealthThresholds = HealthThresholds(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if bool(prefill_urls) != bool(decode_urls):
            raise ValueError(
                "the router needs at least one prefill and one decode URL (or neither, when "
                "every worker registers itself with --router)"
            )
        self.thresholds = thresholds
        self.clock = clock
        self._ids = itertools.count()
        self.prefill: list[Instance] = []
        self.decode: list[Instance] = []
        for role, urls in (("prefill", prefill_urls), ("decode", decode_urls)):
            for url in urls:
                self.of_role(role).append(self._new(url.rstrip("/"), role, "static"))  # type: ignore[arg-type]
        self.fingerprint: str | None = None
        # Called with each removed instance (e.g. to drop its circuit breaker).
        self._removal_listeners: list[Callable[[Instance], None]] = []

    def on_removed(self, listener: Callable[[Instance], None]) -> None:
        """listener(instance) runs after an instance leaves the registry (DELETE, expiry)."""
        self._removal_listeners.append(listener)

    def _new(self, url: str, role: Role, source: Source) -> Instance:
        return Instance(url, role, instance_id=f"{role[0]}{next(self._ids)}", source=source)

    # -- lookup -----------------------------------------------------------------------------

    def all(self) -> list[Instance]:
        return self.prefill + self.decode

    def of_role(self, role: Role) -> list[Instance]:
        return self.prefill if role == "prefill" else self.decode

    def routable(self, role: Role) -> list[Instance]:
        """Instances of role that may take a new request (not draining), healthy or not."""
        return [inst for inst in self.of_role(role) if not inst.draining]

    def healthy(self, role: Role) -> list[Instance]:
        return [inst for inst in self.of_role(role) if inst.healthy and not inst.draining]

    def get(self, instance_id: str) -> Instance | None:
        return next((i for i in self.all() if i.instance_id == instance_id), None)

    def models(self) -> list[str]:
        return sorted({inst.model for inst in self.all() if inst.model})

    # -- membership -------------------------------------------------------------------------

    def register(
        self,
        role: Role,
        url: str,
        fingerprint: str,
        block_size: int,
        model: str | None = None,
        capacity: int | None = None,
        num_kv_blocks: int | None = None,
    ) -> tuple[Instance, bool]:
        """Add (or refresh) a self-registered instance; (instance, whether it is new).

        The first registration of an empty cluster fixes its fingerprint; one that differs
        raises FingerprintMismatch naming both. A URL registered again keeps its id (a worker
        that re-registers after a router restart or a lost heartbeat); under another role it
        raises RegistrationConflict. A new registration starts unchecked: the next health
        check brings it up, and until then it is tried after healthy instances.
        """
        url = url.rstrip("/")
        if self.fingerprint is None:
            known = [i for i in self.all() if i.fingerprint is not None]
            self.fingerprint = known[0].fingerprint if known else None
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                f"{role} {url} has fingerprint {fingerprint} (block size {block_size}, model "
                f"{model}) but the cluster's is {self.fingerprint}: their KV blocks are not "
                "interchangeable; serve the same model, dtype and block size everywhere"
            )
        inst = next((i for i in self.all() if i.url == url), None)
        if inst is not None and inst.role != role:
            raise RegistrationConflict(
                f"{url} is already registered as {inst.role} ({inst.instance_id}); deregister "
                f"it before registering it as {role}"
            )
        is_new = inst is None
        if inst is None:
            inst = self._new(url, role, "registered")
            self.of_role(role).append(inst)
            logger.info("%s registered as %s", inst.describe(), inst.instance_id)
        self.fingerprint = fingerprint
        inst.fingerprint = fingerprint
        inst.block_size = block_size
        inst.model = model or inst.model
        inst.capacity = capacity
        inst.num_kv_blocks = num_kv_blocks
        inst.last_heartbeat_s = self.clock()
        return inst, is_new

    def heartbeat(self, instance_id: str) -> Instance | None:
        """Refresh a registered instance's lease; None when the id is unknown (re-register)."""
        inst = self.get(instance_id)
        if inst is not None:
            inst.last_heartbeat_s = self.clock()
        return inst

    def remove(self, instance_id: str) -> Instance | None:
        """Take an instance out of the registry; its requests in flight go on to their end."""
        inst = self.get(instance_id)
        if inst is not None:
            self.of_role(inst.role).remove(inst)
            logger.info("%s (%s) removed", inst.describe(), instance_id)
            for listener in self._removal_listeners:
                listener(inst)
        return inst

    def set_draining(self, instance_id: str, draining: bool) -> Instance | None:
        inst = self.get(instance_id)
        if inst is not None and inst.draining != draining:
            inst.draining = draining
            logger.info("%s %s", inst.describe(), "draining" if draining else "back in rotation")
        return inst

    def expire_heartbeats(self, ttl_s: float) -> list[Instance]:
        """Remove registered instances whose last heartbeat is older than ttl_s; the removed."""
        now = self.clock()
        expired = [
            inst
            for inst in self.all()
            if inst.source == "registered"
            and inst.last_heartbeat_s is not None
            and now - inst.last_heartbeat_s > ttl_s
        ]
        for inst in expired:
            logger.warning("%s: no heartbeat for %.1fs, removed", inst.describe(), ttl_s)
            self.remove(inst.instance_id)
        return expired

    # -- health -----------------------------------------------------------------------------

    def mark_down(self, inst: Instance, reason: str) -> None:
        """Down at once (a request to it failed at the transport level)."""
        if inst.healthy:
            logger.warning("%s marked down: %s", inst.describe(), reason)
            inst.last_change_s = self.clock()
        inst.healthy = False
        inst.last_error = reason
        inst.down_since_s = self.clock()
        inst.consecutive_successes = 0

    def _check_failed(self, inst: Instance, reason: str) -> None:
        inst.consecutive_failures += 1
        inst.consecutive_successes = 0
        if inst.healthy and inst.consecutive_failures < self.thresholds.unhealthy_after:
            inst.last_error = reason  # tolerated: not yet N failures in a row
            return
        self.mark_down(inst, reason)
        if inst.calls:  # down by its checks: calls it has left silent too long are given up
            n = abandon_stalled(inst.calls, reason, self.thresholds.abandon_after_s)
            if n:
                logger.warning("%s: %d silent calls given up (%s)", inst.describe(), n, reason)

    def _apply_health(self, inst: Instance, info: dict[str, Any]) -> None:
        """One successful /health answer (info: its JSON)."""
        fingerprint = info.get("fingerprint")
        inst.fingerprint = str(fingerprint) if fingerprint is not None else None
        inst.block_size = info.get("block_size")
        inst.model = info.get("model") or info.get("served_model_name")
        if self.fingerprint is not None and inst.fingerprint != self.fingerprint:
            # An instance restarted with another model must not receive this cluster's blocks.
            self.mark_down(
                inst,
                f"fingerprint {inst.fingerprint} differs from the cluster's {self.fingerprint}",
            )
            return
        inst.consecutive_failures = 0
        inst.consecutive_successes += 1
        if inst.healthy:
            inst.last_error = ""
            return
        if inst.ever_healthy and inst.consecutive_successes < self.thresholds.healthy_after:
            inst.last_error = (
                f"recovering: {inst.consecutive_successes} of "
                f"{self.thresholds.healthy_after} health checks passed"
            )
            return
        logger.info("%s healthy (fingerprint %s)", inst.describe(), inst.fingerprint)
        inst.last_change_s = self.clock()
        inst.healthy = True
        inst.ever_healthy = True
        inst.last_error = ""
        inst.down_since_s = None

    async def check(self, client: httpx.AsyncClient, inst: Instance, timeout_s: float) -> bool:
        """GET /health once and count it; returns whether this check passed (200, JSON, the
        cluster's fingerprint), which is not yet `healthy` while recovering."""
        try:
            resp = await client.get(f"{inst.url}/health", timeout=timeout_s)
        except httpx.HTTPError as exc:
            self._check_failed(inst, f"/health failed: {type(exc).__name__}: {exc}")
            return False
        if resp.status_code != 200:
            self._check_failed(inst, f"/health answered HTTP {resp.status_code}")
            return False
        try:
            info = resp.json()
        except ValueError:
            info = None
        if not isinstance(info, dict):
            self._check_failed(inst, "/health answered a body that is not a JSON object")
            return False
        self._apply_health(inst, info)
        return inst.consecutive_successes > 0

    async def check_all(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        await asyncio.gather(*(self.check(client, inst, timeout_s) for inst in self.all()))

    async def startup(
        self, client: httpx.AsyncClient, wait_s: float, poll_interval_s: float = 0.5
    ) -> str | None:
        """Wait (bounded) until every static instance answers, then fix the cluster fingerprint.

        Raises FingerprintMismatch when instances disagree, or RuntimeError when no prefill or
        no decode instance answered within wait_s; instances still silent then start as down.
        With no static instance there is nothing to wait for: None, and the first worker to
        register fixes the fingerprint.
        """
        if not self.all():
            return None
        deadline = time.monotonic() + wait_s
        while True:
            await self.check_all(client, timeout_s=min(2.0, max(wait_s, 0.1)))
            if all(inst.healthy for inst in self.all()) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(poll_interval_s)
        for role in ROLES:
            if not self.healthy(role):
                errors = "; ".join(f"{inst.url}: {inst.last_error}" for inst in self.of_role(role))
                raise RuntimeError(f"no {role} instance is healthy after {wait_s:.0f}s ({errors})")
        self.fingerprint = check_fingerprints(self.all())
        for inst in self.all():
            if not inst.healthy:
                logger.warning("%s not healthy at start: %s", inst.describe(), inst.last_error)
        return self.fingerprint

    def describe_instance(self, inst: Instance) -> dict[str, Any]:
        """JSON-able state of one instance (GET /instances, the router's /health)."""
        age_s = None if inst.last_heartbeat_s is None else self.clock() - inst.last_heartbeat_s
        return {
            "id": inst.instance_id,
            "url": inst.url,
            "role": inst.role,
            "source": inst.source,
            "healthy": inst.healthy,
            "draining": inst.draining,
            # Drained: draining and nothing left in flight, so removing it cuts no stream.
            "drained": inst.draining and inst.in_flight == 0,
            "fingerprint": inst.fingerprint,
            "block_size": inst.block_size,
            "model": inst.model,
            "capacity": inst.capacity,
            "num_kv_blocks": inst.num_kv_blocks,
            "in_flight": inst.in_flight,
            "in_flight_tokens": inst.in_flight_tokens,
            "last_error": inst.last_error or None,
            "heartbeat_age_s": None if age_s is None else round(age_s, 3),
        }

    def snapshot(self) -> list[dict[str, Any]]:
        """JSON-able state of every instance (for the router's /health)."""
        return [self.describe_instance(inst) for inst in self.all()]
