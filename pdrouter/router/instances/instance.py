"""An instance as the router sees it, and the rules that decide which ones may work together.

Instance           one worker: role, health, fingerprint, load, registration, calls
HealthThresholds   how many failed or passed checks in a row change its health
check_fingerprints every instance of a cluster must hold interchangeable KV blocks
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdrouter.common.flags import flag
from pdrouter.router.instances.call_guard import CallGuard

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
            "(retried or resumed elsewhere) once it has had nothing from the instance for this "
            "long",
        ),
    )

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
    # Requests the worker holds at once (its --max-pending-requests), as it registered: the
    # router sends it no more calls at once
    # (pdrouter.router.selection.admission.Admission.bound_of).
    capacity: int | None = None
    num_kv_blocks: int | None = None
    # The longest sequence (prompt + output tokens) it serves, from /health or registration.
    max_model_len: int | None = None
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
