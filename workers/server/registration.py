"""A prefill or decode worker registering itself with a router, heartbeating, deregistering.

    start   wait until the engine and the pool client are ready (describe() is not None)
            POST {router}/instances  {role, url, fingerprint, block_size, model, capacity,
                                      num_kv_blocks, max_model_len}
    loop    PUT  {router}/instances/{id}/heartbeat  every interval
            404 (the router restarted, or expired us) -> register again
            unreachable / 5xx -> log, keep trying at the same interval (bounded calls)
            401 / 409 (wrong admin key, fingerprint mismatch) -> log the router's reason, stop
    stop    DELETE {router}/instances/{id}  (bounded), so no new request is routed here

Every call has a timeout, so a hung router delays nothing but this task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import httpx
from fastapi import FastAPI

from workers.server.app import Lifespan
from workers.server.config import RegistrationConfig

log = logging.getLogger(__name__)

RegistrationState = Literal["waiting", "registered", "refused", "stopped"]


class Registrar:
    """Keeps this worker registered with one router while the worker runs.

    describe() returns the registration body without `url` (role, fingerprint, block_size,
    model, capacity, num_kv_blocks) once the worker can serve, None while it loads.
    """

    def __init__(
        self,
        cfg: RegistrationConfig,
        describe: Callable[[], dict[str, Any] | None],
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.cfg = cfg
        self._describe = describe
        headers = {"Authorization": f"Bearer {cfg.admin_key}"} if cfg.admin_key else {}
        self._client = client or httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(cfg.call_timeout_s)
        )
        self.instance_id: str | None = None
        self.state: RegistrationState = "waiting"
        self.last_error = ""
        self._interval_s = cfg.heartbeat_interval_s

    @property
    def _instances_url(self) -> str:
        return f"{self.cfg.router_url.rstrip('/')}/instances"

    async def run(self) -> None:
        """Register, then heartbeat until cancelled or refused."""
        while self.state != "refused":
            if self.instance_id is None:
                if self._describe() is None:  # still loading: look again soon
                    await asyncio.sleep(self.cfg.ready_poll_s)
                    continue
                await self._register()
            else:
                await self._heartbeat()
            await asyncio.sleep(self._interval_s)

    async def _register(self) -> None:
        described = self._describe()
        if described is None:
            return
        body = {**described, "url": self.cfg.advertise_url}
        resp = await self._call("POST", self._instances_url, json=body)
        if resp is None:
            return
        if resp.status_code in (200, 201):
            answer = resp.json()
            self.instance_id = str(answer["id"])
            # Three heartbeats per lease: one lost call does not get this worker expired.
            self._interval_s = min(
                self.cfg.heartbeat_interval_s, float(answer["heartbeat_ttl_s"]) / 3
            )
            self.state = "registered"
            self.last_error = ""
            log.info("registered with %s as %s", self.cfg.router_url, self.instance_id)
        elif resp.status_code in (400, 401, 403, 409):
            self._refused(resp)
        else:
            self.last_error = f"register: HTTP {resp.status_code}: {resp.text[:300]}"
            log.warning("router %s: %s", self.cfg.router_url, self.last_error)

    async def _heartbeat(self) -> None:
        url = f"{self._instances_url}/{self.instance_id}/heartbeat"
        resp = await self._call("PUT", url)
        if resp is None:
            return
        if resp.status_code == 404:
            log.warning("router %s forgot %s: registering again", self.cfg.router_url, url)
            self.instance_id = None
            self.state = "waiting"
        elif resp.status_code in (401, 403):
            self._refused(resp)
        elif resp.status_code != 200:
            self.last_error = f"heartbeat: HTTP {resp.status_code}"
            log.warning("router %s: %s", self.cfg.router_url, self.last_error)

    def _refused(self, resp: httpx.Response) -> None:
        self.state = "refused"
        self.last_error = f"HTTP {resp.status_code}: {resp.text[:500]}"
        log.error(
            "router %s refused this worker (%s); not retrying: fix the flags and restart",
            self.cfg.router_url,
            self.last_error,
        )

    async def _call(self, method: str, url: str, **kwargs: Any) -> httpx.Response | None:
        try:
            return await self._client.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            self.last_error = f"{method} {url}: {type(exc).__name__}: {exc}"
            log.warning("router unreachable: %s", self.last_error)
            return None

    async def deregister(self) -> None:
        """DELETE this worker's entry (bounded); the router stops routing here at once."""
        instance_id, self.instance_id = self.instance_id, None
        self.state = "stopped"
        if instance_id is not None:
            resp = await self._call("DELETE", f"{self._instances_url}/{instance_id}")
            if resp is not None and resp.status_code not in (200, 404):
                log.warning("deregister %s: HTTP %d", instance_id, resp.status_code)
        await self._client.aclose()


def registration_body(ctx: Any) -> dict[str, Any] | None:
    """What this worker registers with (no url), or None until engine and pool are ready."""
    health = ctx.worker.health
    if ctx.worker.service is None or ctx.pool is None or not health:
        return None
    return {
        "role": health["role"],
        "fingerprint": str(health["fingerprint"]),
        "block_size": int(health["block_size"]),
        "model": health["model"],
        "capacity": ctx.worker.config.max_pending_requests,
        "num_kv_blocks": int(health["num_kv_blocks"]),
        "max_num_seqs": int(health["max_num_seqs"]),  # the router's default in-flight bound
        "max_model_len": int(health["max_model_len"]),  # the router's body bound follows it
    }


def registration_lifespan(
    cfg: RegistrationConfig, describe: Callable[[], dict[str, Any] | None]
) -> Lifespan:
    """A Registrar living as long as the app: registers once describe() has a body (engine
    and pool ready), heartbeats, deregisters on the way out. A worker with several routers
    has one such lifespan per router (app.state.registrars lists them)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registrar = Registrar(cfg, describe)
        if not hasattr(app.state, "registrars"):
            app.state.registrars = []
        app.state.registrars.append(registrar)
        task = asyncio.ensure_future(registrar.run())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await registrar.deregister()

    return lifespan
