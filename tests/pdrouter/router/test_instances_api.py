"""The /instances admin API in-process (no worker listening): registration, heartbeat, drain,
removal, with exact states and status codes, and a worker's Registrar against it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from pdrouter.common.cli_args import ConfigError
from pdrouter.router.app import create_app
from pdrouter.router.config import RouterConfig
from pdrouter.router.instances.registry import Registry
from pdrouter.router.selection.breaker import BreakerState
from pdrouter.wire.worker import InstanceRegistration
from tests.wait import async_wait_until
from workers.server.config import RegistrationConfig, advertise_url_of
from workers.server.registration import Registrar

FP = "fp-aaaa"
ADMIN = "admin-secret-1"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def _registration(role: str = "prefill", port: int = 9000, **over: Any) -> dict[str, Any]:
    body = {"role": role, "url": f"http://127.0.0.1:{port}", "fingerprint": FP, "block_size": 16,
            "model": "tiny", "capacity": 64, "num_kv_blocks": 96, "max_num_seqs": 4,
            "max_model_len": 512}  # fmt: skip
    return {**body, **over}


def _app(admin_key: str | None = ADMIN, clock: Callable[[], float] = lambda: 50.0) -> FastAPI:
    cfg = RouterConfig(prefill_urls=(), decode_urls=(), admin_key=admin_key, heartbeat_ttl_s=9.0)
    # A frozen clock by default: heartbeat ages in answers are exact.
    return create_app(cfg, Registry([], [], clock=clock))


@contextlib.asynccontextmanager
async def _serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    await app.state.service.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            yield client
    finally:
        await app.state.service.stop()


@pytest.fixture
async def router() -> AsyncIterator[httpx.AsyncClient]:
    async with _serving(_app()) as client:
        yield client


async def test_register_list_heartbeat_drain_remove() -> None:
    app = _app()
    async with _serving(app) as router:
        await _register_list_heartbeat_drain_remove(router, app.state.service.registry)
        # The removed instance's circuit breaker went with it: a worker registering again at
        # that URL starts closed, and the board does not grow with every instance ever seen.
        breakers = app.state.service.breakers
        url = "http://127.0.0.1:9001"
        for _ in range(100):
            breakers.get(url).record_failure()
        assert breakers.state(url) == BreakerState.OPEN
        assert (await router.delete("/instances/d1", headers=AUTH)).status_code == 200
        assert breakers.state(url) == BreakerState.CLOSED


async def _register_list_heartbeat_drain_remove(
    router: httpx.AsyncClient, registry: Registry
) -> None:
    resp = await router.post("/instances", json=_registration(), headers=AUTH)
    assert (resp.status_code, resp.json()) == (201, {"id": "p0", "heartbeat_ttl_s": 9.0,
                                                     "fingerprint": FP})  # fmt: skip
    resp = await router.post("/instances", json=_registration("decode", 9001), headers=AUTH)
    assert (resp.status_code, resp.json()["id"]) == (201, "d1")
    # The same worker again (a restart, a lost heartbeat): same id, 200.
    resp = await router.post("/instances", json=_registration(capacity=8), headers=AUTH)
    assert (resp.status_code, resp.json()["id"]) == (200, "p0")
    listed = (await router.get("/instances", headers=AUTH)).json()
    assert listed["fingerprint"] == FP
    p0 = listed["instances"][0]
    assert p0 == {
        "id": "p0", "url": "http://127.0.0.1:9000", "role": "prefill", "source": "registered",
        "healthy": False, "draining": False, "drained": False, "fingerprint": FP,
        "block_size": 16, "model": "tiny", "capacity": 8, "num_kv_blocks": 96, "in_flight": 0,
        "in_flight_tokens": 0, "last_error": "not checked yet", "heartbeat_age_s": 0.0,
        "max_model_len": 512, "breaker": "closed", "max_num_seqs": 4, "slow_checks": 0,
        "degraded": [],
    }  # fmt: skip
    assert [i["id"] for i in listed["instances"]] == ["p0", "d1"]

    resp = await router.put("/instances/d1/heartbeat", headers=AUTH)
    assert (resp.status_code, resp.json()["id"]) == (200, "d1")
    resp = await router.get("/instances/p0", headers=AUTH)
    assert (resp.status_code, resp.json()) == (200, p0)
    resp = await router.post("/instances/d1/drain", headers=AUTH)
    assert (resp.status_code, resp.json()["draining"], resp.json()["drained"]) == (200, True, True)
    resp = await router.post("/instances/d1/undrain", headers=AUTH)
    assert (resp.status_code, resp.json()["draining"]) == (200, False)
    # Removal on condition: only once drained (draining, nothing in flight).
    resp = await router.delete("/instances/p0?if_drained=true", headers=AUTH)
    assert (resp.status_code, resp.json()["error"]["code"]) == (409, "not_drained")
    assert resp.json()["error"]["message"].startswith(
        "instance p0 is not draining with 0 requests in flight; drain it"
    )
    assert (await router.post("/instances/p0/drain", headers=AUTH)).status_code == 200
    registry.get("p0").in_flight = 2  # type: ignore[union-attr]
    resp = await router.delete("/instances/p0?if_drained=true", headers=AUTH)
    assert resp.status_code == 409
    assert "is draining with 2 requests in flight" in resp.json()["error"]["message"]
    registry.get("p0").in_flight = 0  # type: ignore[union-attr]
    resp = await router.delete("/instances/p0?if_drained=true", headers=AUTH)
    assert (resp.status_code, resp.json()["id"], resp.json()["url"]) == (
        200, "p0", "http://127.0.0.1:9000")  # fmt: skip
    listed = (await router.get("/instances", headers=AUTH)).json()
    assert [i["id"] for i in listed["instances"]] == ["d1"]
    # The router's /health lists what registered (and is 503: no prefill left).
    health = await router.get("/health")
    assert health.status_code == 503
    assert [(i["id"], i["role"]) for i in health.json()["instances"]] == [("d1", "decode")]


@pytest.mark.parametrize(
    ("method", "path"),
    [("get", "/instances/p9"), ("put", "/instances/p9/heartbeat"), ("post", "/instances/p9/drain"),
     ("post", "/instances/p9/undrain"), ("delete", "/instances/p9")],
)  # fmt: skip
async def test_unknown_ids_are_404(router: httpx.AsyncClient, method: str, path: str) -> None:
    resp = await router.request(method.upper(), path, headers=AUTH)
    assert resp.status_code == 404
    assert resp.json()["error"] == {"message": "no instance with id 'p9'",
                                    "type": "invalid_request_error", "param": None,
                                    "code": "not_found"}  # fmt: skip


async def test_fingerprint_mismatch_is_409_naming_both(router: httpx.AsyncClient) -> None:
    assert (await router.post("/instances", json=_registration(), headers=AUTH)).status_code == 201
    other = _registration("decode", 9001, fingerprint="fp-bbbb", block_size=8, model="big")
    resp = await router.post("/instances", json=other, headers=AUTH)
    assert resp.status_code == 409
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("fingerprint_mismatch", "fingerprint")
    assert error["message"].startswith(
        "decode http://127.0.0.1:9001 has fingerprint fp-bbbb (block size 8, model big) but "
        "the cluster's is fp-aaaa"
    )
    # Same URL, other role: 409 too, and the registry is unchanged.
    resp = await router.post("/instances", json=_registration("decode"), headers=AUTH)
    assert (resp.status_code, resp.json()["error"]["code"]) == (409, "conflict")
    listed = (await router.get("/instances", headers=AUTH)).json()["instances"]
    assert [(i["id"], i["role"]) for i in listed] == [("p0", "prefill")]


@pytest.mark.parametrize(
    ("body", "param", "message_part"),
    [
        (b"{not json", None, "Invalid JSON"),
        (b"[]", None, "Input should be an object"),
        (_registration(role="mixed"), "role", "'prefill' or 'decode'"),
        (_registration(url="ftp://127.0.0.1:9000"), "url", "should match pattern"),
        (_registration(url="http://a b"), "url", "should match pattern"),
        (_registration(block_size=0), "block_size", "greater than or equal to 1"),
        (_registration(block_size="16x"), "block_size", "valid integer"),
        (_registration(capacity=0), "capacity", "greater than or equal to 1"),
        (_registration(fingerprint=""), "fingerprint", "at least 1 character"),
        (_registration(fingerprint="f" * 257), "fingerprint", "at most 256 characters"),
        (_registration(extra=1), "extra", "Extra inputs are not permitted"),
        ({"role": "prefill", "url": "http://127.0.0.1:1"}, "fingerprint", "Field required"),
    ],
)
async def test_bad_registrations_are_400(
    router: httpx.AsyncClient, body: Any, param: str | None, message_part: str
) -> None:
    content = body if isinstance(body, bytes) else None
    resp = await router.post(
        "/instances", content=content, json=None if content else body, headers=AUTH
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["message"].startswith("invalid registration: ")
    assert message_part in error["message"]
    listed = (await router.get("/instances", headers=AUTH)).json()["instances"]
    assert listed == []


# -- the worker side: Registrar against the router app ----------------------------------------


def _registrar(
    app: FastAPI, describe: Callable[[], dict[str, Any] | None], admin_key: str = ADMIN
) -> Registrar:
    cfg = RegistrationConfig(
        router_url="http://router",
        advertise_url="http://127.0.0.1:9005",
        admin_key=admin_key,
        heartbeat_interval_s=0.02,
        ready_poll_s=0.01,
    )
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        headers={"Authorization": f"Bearer {admin_key}"},
    )

    def body() -> InstanceRegistration | None:
        described = describe()
        return (
            None if described is None else InstanceRegistration(**described, url=cfg.advertise_url)
        )

    return Registrar(cfg, body, client)


async def _until(predicate: Any, timeout_s: float = 5.0) -> None:
    await async_wait_until(predicate, timeout_s, "the registrar's state")


async def test_registrar_registers_heartbeats_reregisters_and_deregisters() -> None:
    app = _app(clock=time.monotonic)
    async with _serving(app) as router:
        registry: Registry = app.state.service.registry
        body = {k: v for k, v in _registration("decode").items() if k != "url"}
        registrar = _registrar(app, lambda: body)
        task = asyncio.ensure_future(registrar.run())
        try:
            await _until(lambda: registrar.state == "registered")
            assert registrar.instance_id == "d0"
            inst = registry.get("d0")
            assert inst is not None and inst.url == "http://127.0.0.1:9005"
            # Heartbeats move last_heartbeat_s forward.
            first_s = inst.last_heartbeat_s
            await _until(lambda: inst.last_heartbeat_s != first_s)
            # The router forgets it (an admin DELETE, or a router restart): it registers again.
            assert (await router.delete("/instances/d0", headers=AUTH)).status_code == 200
            await _until(lambda: registrar.instance_id == "d1")
            assert [i.instance_id for i in registry.all()] == ["d1"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await registrar.deregister()
        assert registrar.state == "stopped" and registry.all() == []


async def test_registrar_waits_for_readiness_and_stops_when_refused() -> None:
    app = _app()
    async with _serving(app) as router:
        registry: Registry = app.state.service.registry
        registry.register("prefill", "http://127.0.0.1:9000", FP, 16)
        # A worker of another model: refused with 409, and it stops asking.
        body = {k: v for k, v in _registration("decode", fingerprint="fp-bbbb").items()
                if k != "url"}  # fmt: skip
        registrar = _registrar(app, lambda: body)
        await asyncio.wait_for(registrar.run(), timeout=5)
        assert registrar.state == "refused"
        assert registrar.last_error.startswith("HTTP 409: ")
        assert "fp-bbbb" in registrar.last_error and "fp-aaaa" in registrar.last_error
        await registrar.deregister()
        # A wrong admin key: refused with 401.
        wrong = _registrar(app, lambda: body, admin_key="nope")
        await asyncio.wait_for(wrong.run(), timeout=5)
        assert (wrong.state, wrong.last_error[:9]) == ("refused", "HTTP 401:")
        await wrong.deregister()
        # Not ready yet (None): nothing is sent until it is.
        state: dict[str, Any] = {"body": None}
        asked: list[None] = []

        def describe() -> dict[str, Any] | None:
            asked.append(None)
            return state["body"]

        late = _registrar(app, describe)
        task = asyncio.ensure_future(late.run())
        # It asks for its body twice and finds none: still waiting, and nothing registered.
        await _until(lambda: len(asked) >= 2)
        assert (late.state, [i.instance_id for i in registry.all()]) == ("waiting", ["p0"])
        state["body"] = {k: v for k, v in _registration("decode").items() if k != "url"}
        await _until(lambda: late.state == "registered")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await late.deregister()
        assert [i.instance_id for i in registry.all()] == ["p0"]
        assert (await router.get("/instances", headers=AUTH)).status_code == 200


def test_advertise_url() -> None:
    assert advertise_url_of("127.0.0.1", 8101, None) == "http://127.0.0.1:8101"
    assert advertise_url_of("0.0.0.0", 8101, "http://10.0.0.5:8101/") == "http://10.0.0.5:8101"
    with pytest.raises(ConfigError, match="give --advertise-url"):
        advertise_url_of("0.0.0.0", 8101, None)
