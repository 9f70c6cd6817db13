"""The router's view of its prefill and decode instances: health, fingerprints, load.

Every instance answers GET /health with JSON holding at least `fingerprint` and `block_size`
(and `model`, `role`). The registry refuses a cluster whose instances disagree on the
fingerprint (their KV blocks would not be interchangeable), marks instances down on a failed
call or health check, and brings them back when /health answers again with the cluster's
fingerprint. Plain Python state; the router's event loop is the only writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]


class FingerprintMismatch(RuntimeError):
    """Two instances whose KV blocks are not interchangeable (message names both)."""


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
    """Prefill and decode instances with their health; one per router app."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str]) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the router needs at least one prefill and one decode URL")
        self.prefill = [Instance(url.rstrip("/"), "prefill") for url in prefill_urls]
        self.decode = [Instance(url.rstrip("/"), "decode") for url in decode_urls]
        self.fingerprint: str | None = None

    def all(self) -> list[Instance]:
        return self.prefill + self.decode

    def of_role(self, role: Role) -> list[Instance]:
        return self.prefill if role == "prefill" else self.decode

    def healthy(self, role: Role) -> list[Instance]:
        return [inst for inst in self.of_role(role) if inst.healthy]

    def models(self) -> list[str]:
        return sorted({inst.model for inst in self.all() if inst.model})

    def mark_down(self, inst: Instance, reason: str) -> None:
        if inst.healthy:
            logger.warning("%s marked down: %s", inst.describe(), reason)
            inst.last_change_s = time.monotonic()
        inst.healthy = False
        inst.last_error = reason
        inst.down_since_s = time.monotonic()

    def _apply_health(self, inst: Instance, info: dict[str, Any]) -> None:
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
        if not inst.healthy:
            logger.info("%s healthy (fingerprint %s)", inst.describe(), inst.fingerprint)
            inst.last_change_s = time.monotonic()
        inst.healthy = True
        inst.last_error = ""
        inst.down_since_s = None

    async def check(self, client: httpx.AsyncClient, inst: Instance, timeout_s: float) -> bool:
        """GET /health once; updates inst and returns whether it is healthy."""
        try:
            resp = await client.get(f"{inst.url}/health", timeout=timeout_s)
        except httpx.HTTPError as exc:
            self.mark_down(inst, f"/health failed: {type(exc).__name__}: {exc}")
            return False
        if resp.status_code != 200:
            self.mark_down(inst, f"/health answered HTTP {resp.status_code}")
            return False
        try:
            info = resp.json()
        except ValueError:
            self.mark_down(inst, "/health answered a body that is not JSON")
            return False
        self._apply_health(inst, info)
        return inst.healthy

    async def check_all(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        await asyncio.gather(*(self.check(client, inst, timeout_s) for inst in self.all()))

    async def startup(
        self, client: httpx.AsyncClient, wait_s: float, poll_interval_s: float = 0.5
    ) -> str:
        """Wait (bounded) until every instance answers, then fix the cluster fingerprint.

        Raises FingerprintMismatch when instances disagree, or RuntimeError when no prefill or
        no decode instance answered within wait_s; instances still silent then start as down.
        """
        deadline = time.monotonic() + wait_s
        while True:
            await self.check_all(client, timeout_s=min(2.0, max(wait_s, 0.1)))
            if all(inst.healthy for inst in self.all()) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(poll_interval_s)
        for role in ("prefill", "decode"):
            if not self.healthy(role):  # type: ignore[arg-type]
                errors = "; ".join(
                    f"{inst.url}: {inst.last_error}"
                    for inst in self.of_role(role)  # type: ignore[arg-type]
                )
                raise RuntimeError(f"no {role} instance is healthy after {wait_s:.0f}s ({errors})")
        self.fingerprint = check_fingerprints(self.all())
        for inst in self.all():
            if not inst.healthy:
                logger.warning("%s not healthy at start: %s", inst.describe(), inst.last_error)
        return self.fingerprint

    def snapshot(self) -> list[dict[str, Any]]:
        """JSON-able state of every instance (for the router's /health)."""
        return [
            {
                "url": inst.url,
                "role": inst.role,
                "healthy": inst.healthy,
                "fingerprint": inst.fingerprint,
                "in_flight": inst.in_flight,
                "last_error": inst.last_error or None,
            }
            for inst in self.all()
        ]
