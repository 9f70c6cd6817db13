"""The router's instances of each role: membership, and health as checks and calls report it.

Instances come from the command line (static) or register themselves (`POST /instances`, see
instances_api) and then heartbeat. Every instance answers GET /health with a WorkerHealth
(pdrouter.wire.worker: fingerprint, block size, model, bounds, "ok" or "degraded" with the
reasons); a degraded one passes its check (it serves, its handoffs recompute). The registry
refuses instances whose fingerprint differs from the cluster's (their KV blocks would not be
interchangeable).

Health has hysteresis (HealthThresholds): an instance goes down after N failed health checks
in a row, or at once when a request to it fails at the transport level (mark_down), and comes
back after M successful checks in a row. Busy is not down: a check that times out while the
instance's calls make progress (one got something within busy_window_s) is counted slow and
changes nothing; a
refused or reset check, or one of an instance with no progress, counts as failed. An
instance never healthy yet (loading) comes up on its first success. A draining instance takes
no new request; the requests it holds finish. Plain Python state; the router's event loop is
the only writer. The checks themselves (GET /health, the start-up wait) are in health.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from pdrouter.router.instances.call_guard import abandon_stalled
from pdrouter.router.instances.instance import (
    FingerprintMismatch,
    HealthThresholds,
    Instance,
    RegistrationConflict,
    Role,
    Source,
)
from pdrouter.wire.worker import WorkerHealth

logger = logging.getLogger(__name__)


class Registry:
    """Prefill and decode instances with their health; one per router app.

    Static lists name both roles or neither (neither: every instance registers itself).
    clock is injectable so that heartbeat expiry is tested without sleeping.
    """

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        thresholds: HealthThresholds | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if bool(prefill_urls) != bool(decode_urls):
            raise ValueError(
                "the router needs at least one prefill and one decode URL (or neither, when "
                "every worker registers itself with --router)"
            )
        self.thresholds = thresholds if thresholds is not None else HealthThresholds()
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
        # Called with each instance that passed a health check (e.g. to half-open its breaker).
        self._check_passed_listeners: list[Callable[[Instance], None]] = []
        # Each adds fields to an instance's description (e.g. its breaker state).
        self._describers: list[Callable[[Instance], dict[str, Any]]] = []

    def on_removed(self, listener: Callable[[Instance], None]) -> None:
        """listener(instance) runs after an instance leaves the registry (DELETE, expiry)."""
        self._removal_listeners.append(listener)

    def on_check_passed(self, listener: Callable[[Instance], None]) -> None:
        """listener(instance) runs after each health check the instance passed."""
        self._check_passed_listeners.append(listener)

    def add_describer(self, describer: Callable[[Instance], dict[str, Any]]) -> None:
        """describer(instance) adds fields to what describe_instance returns."""
        self._describers.append(describer)

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

    def max_model_len(self) -> int | None:
        """The longest context any instance serves (None until one reports it)."""
        return max((i.max_model_len for i in self.all() if i.max_model_len), default=None)

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
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
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
        inst.max_model_len = max_model_len or inst.max_model_len
        inst.max_num_seqs = max_num_seqs or inst.max_num_seqs
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

    def busy_window_s(self) -> float:
        """How recent a call's progress makes its instance busy, and how long a busy
        instance's check waits: --busy-health-timeout-s, at most --abandon-after-s (a worker
        frozen right after a token then goes down within about this long plus its checks)."""
        return min(self.thresholds.busy_check_timeout_s, self.thresholds.abandon_after_s)

    def busy(self, inst: Instance) -> bool:
        """Whether some call on inst got something within busy_window_s."""
        return inst.calls.progressing(self.clock(), self.busy_window_s())

    def check_failed(self, inst: Instance, reason: str, slow: bool = False) -> None:
        """One failed check: down after thresholds.unhealthy_after in a row (at once if never
        healthy); calls it has left silent too long are then given up. slow: the check timed
        out (not refused, reset or answered with an error): while the instance is busy
        (its calls progress), that is load, and counts neither way."""
        if slow and inst.ever_healthy and self.busy(inst):
            inst.num_slow_checks += 1
            inst.last_error = f"slow, its calls progress: {reason}"
            return
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

    def check_passed(self, inst: Instance, health: WorkerHealth) -> None:
        """One successful /health answer (health: its parsed body): back after
        thresholds.healthy_after in a row (at once the first time), unless its fingerprint is
        not the cluster's. A degraded worker passes too: it serves (its handoffs recompute);
        its reasons are kept on the instance for /instances."""
        inst.fingerprint = health.fingerprint
        inst.block_size = health.block_size
        inst.model = health.model
        inst.max_model_len = health.max_model_len
        inst.max_num_seqs = health.max_num_seqs  # what the in-flight bound follows
        inst.num_kv_blocks = health.num_kv_blocks
        self._note_degraded(inst, health)
        if self.fingerprint is not None and inst.fingerprint != self.fingerprint:
            # An instance restarted with another model must not receive this cluster's blocks.
            self.mark_down(
                inst,
                f"fingerprint {inst.fingerprint} differs from the cluster's {self.fingerprint}",
            )
            return
        inst.consecutive_failures = 0
        inst.consecutive_successes += 1
        for listener in self._check_passed_listeners:
            listener(inst)
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

    def _note_degraded(self, inst: Instance, health: WorkerHealth) -> None:
        degraded = list(health.degraded) if health.status == "degraded" else []
        if health.status == "degraded" and not degraded:
            degraded = ["degraded (the worker named no reason)"]
        if degraded != inst.degraded:
            if degraded:
                logger.warning("%s degraded: %s", inst.describe(), "; ".join(degraded))
            else:
                logger.info("%s no longer degraded", inst.describe())
        inst.degraded = degraded

    def describe_instance(self, inst: Instance) -> dict[str, Any]:
        """JSON-able state of one instance (GET /instances, the router's /health)."""
        age_s = None if inst.last_heartbeat_s is None else self.clock() - inst.last_heartbeat_s
        described = {
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
            "max_num_seqs": inst.max_num_seqs,
            "max_model_len": inst.max_model_len,
            "in_flight": inst.in_flight,
            "in_flight_tokens": inst.in_flight_tokens,
            "last_error": inst.last_error or None,
            # From its last passed check: what it serves without (empty: it said "ok").
            "degraded": list(inst.degraded),
            "slow_checks": inst.num_slow_checks,
            "heartbeat_age_s": None if age_s is None else round(age_s, 3),
        }
        for describer in self._describers:
            described.update(describer(inst))
        return described

    def snapshot(self) -> list[dict[str, Any]]:
        """JSON-able state of every instance (for the router's /health)."""
        return [self.describe_instance(inst) for inst in self.all()]
