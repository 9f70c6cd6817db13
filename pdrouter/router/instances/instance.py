"""An instance as the router sees it, and the rules that decide which ones may work together.

Instance           one worker: role, health, fingerprint, load, registration, calls
HealthThresholds   how many failed or passed checks in a row change its health
check_fingerprints every instance of a cluster must hold interchangeable KV blocks
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdrouter.common.flags import flag
from pdrouter.router.instances.call_guard import CallSet

Role = Literal["prefill", "decode"]
Source = Literal["static", "registered"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


class FingerprintMismatch(RuntimeError):
    """Two instances whose KV blocks are not interchangeable (message names both)."""


class RegistrationConflict(ValueError):
    """A registration that contradicts the registry (same URL, other role)."""


@dataclass(frozen=True)
class HealthThresholds:
    """Consecutive failed checks before an instance is down, successes before it is back"""

    unhealthy_after: int = field(
        default=3,
        metadata=flag(
            "--unhealthy-after",
            "failed health checks in a row before an instance leaves the "
            "rotation (a failed connection takes it out at once)",
        ),
    )
    healthy_after: int = field(
        default=2,
        metadata=flag(
            "--healthy-after",
            "passed health checks in a row before a down instance is back in the rotation",
        ),
    )
    # pdrouter.router.instances.call_guard gives the call up.
    abandon_after_s: float = field(
        default=10.0,
        metadata=flag(
            "--abandon-after-s",
            "a call to an instance its health checks find down is given up "
            "(retried or resumed elsewhere) once neither it nor any other call on the instance "
            "has had anything from it for this long",
        ),
    )
    # Registry.busy_window_s: recent progress makes an instance busy, not down.
    busy_check_timeout_s: float = field(
        default=5.0,
        metadata=flag(
            "--busy-health-timeout-s",
            "an instance one of whose calls had something from it this recently is busy: its "
            "health check waits this long (at most --abandon-after-s), and one that times out "
            "counts as slow, not failed (a saturated worker answers late)",
        ),
    )

    def __post_init__(self) -> None:
        if self.unhealthy_after < 1 or self.healthy_after < 1:
            raise ValueError(f"health thresholds must be >= 1, got {self}")
        if self.abandon_after_s <= 0:
            raise ValueError(f"abandon_after_s must be > 0, got {self.abandon_after_s}")
        if self.busy_check_timeout_s <= 0:
            raise ValueError(f"busy_check_timeout_s must be > 0, got {self.busy_check_timeout_s}")


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
    # Requests the worker holds at once (its --max-pending-requests), as it registered: the
    # router sends it no more calls at once
    # (pdrouter.router.selection.admission.Admission.bound_of).
    capacity: int | None = None
    num_kv_blocks: int | None = None
    # The most sequences its engine runs in one batch (its --max-num-seqs), from /health or
    # registration: what the default in-flight bound is derived from (Admission.bound_of).
    max_num_seqs: int | None = None
    # The longest sequence (prompt + output tokens) it serves, from /health or registration.
    max_model_len: int | None = None
    # What its last passed check said is down behind it (WorkerHealth.degraded, e.g. its pool
    # client reconnecting); empty when it said "ok". A degraded instance still serves (its
    # handoffs recompute), so it stays in the rotation; /instances shows why it is slower.
    degraded: list[str] = field(default_factory=list)
    # Registered instances only: when the last heartbeat (or the registration) arrived.
    last_heartbeat_s: float | None = None
    # False until the first passed check: a worker still loading comes up on its first pass.
    ever_healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # Health checks that timed out while its calls made progress: slow, not counted as failed.
    num_slow_checks: int = 0
    # Calls in flight to it (pdrouter.router.instances.call_guard.CallGuard) and when one
    # last got something; health checks that find it down give up those it has left silent
    # too long, unless the instance makes progress on some call.
    calls: CallSet = field(default_factory=CallSet)

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
