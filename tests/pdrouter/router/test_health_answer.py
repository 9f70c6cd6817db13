"""The router reads a worker's /health as a WorkerHealth (pdrouter.wire.worker): a body that is
not one fails the check naming what is wrong, a field it does not know is ignored, and a
degraded worker passes with its reasons shown in /instances. The worker is a stand-in app
whose answer each test sets (health.check through a real httpx client)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from pdrouter.router.app import create_app
from pdrouter.router.config import RouterConfig
from pdrouter.router.instances import health
from pdrouter.router.instances.instance import HealthThresholds
from pdrouter.router.instances.registry import Registry
from tests.pdrouter.router.worker_health import answering_client, worker_health

FP = "fp-aaaa"
ADMIN = "admin-secret-1"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
NOT_HEALTH = "/health answered a body that is not a WorkerHealth"
REASON = "pool: reconnecting to the master (ConnectError: refused)"


def _registry() -> Registry:
    thresholds = HealthThresholds(unhealthy_after=2, healthy_after=1)
    registry = Registry(["http://p:1"], ["http://d:2"], thresholds)
    registry.fingerprint = FP
    return registry


@pytest.mark.parametrize(
    ("body", "problems"),
    [
        ({k: v for k, v in worker_health(FP).model_dump().items() if k != "fingerprint"},
         "fingerprint: Field required"),
        ({**worker_health(FP).model_dump(), "block_size": "sixteen", "status": "fine"},
         "status: Input should be 'ok' or 'degraded'; block_size: Input should be a valid "
         "integer, unable to parse string as an integer"),
        ({**worker_health(FP).model_dump(), "max_num_seqs": 0},
         "max_num_seqs: Input should be greater than or equal to 1"),
        ([1, 2], "body: Input should be an object"),
    ],
)  # fmt: skip
async def test_a_200_that_is_not_a_worker_health_fails_the_check_naming_why(
    body: Any, problems: str
) -> None:
    registry = _registry()
    p = registry.prefill[0]
    async with answering_client({"status": 200, "body": body}) as client:
        assert await health.check(registry, client, p, 1.0) is False
    assert (p.healthy, p.consecutive_failures) == (False, 1)
    assert p.last_error == f"{NOT_HEALTH} ({problems})"
    assert (p.fingerprint, p.block_size, p.max_num_seqs) == (None, None, None)  # nothing kept


async def test_a_healthy_worker_answering_garbage_goes_down_after_the_threshold() -> None:
    registry = _registry()
    p = registry.prefill[0]
    answer: dict[str, Any] = {"status": 200, "body": worker_health(FP).model_dump()}
    async with answering_client(answer) as client:
        assert await health.check(registry, client, p, 1.0) is True and p.healthy
        # Not JSON at all, and a huge field: the reason stays short and quotes no value.
        answer["body"] = b"<html>fine</html>"
        assert await health.check(registry, client, p, 1.0) is False
        invalid = "body: Invalid JSON: expected value at line 1 column 1"
        assert (p.healthy, p.last_error) == (True, f"{NOT_HEALTH} ({invalid})")
        answer["body"] = {**worker_health(FP).model_dump(), "fingerprint": "f" * 1_000_000}
        assert await health.check(registry, client, p, 1.0) is False
    assert (p.healthy, p.consecutive_failures) == (False, 2)
    assert p.last_error == f"{NOT_HEALTH} (fingerprint: String should have at most 256 characters)"


async def test_a_reason_with_many_problems_is_clipped() -> None:
    registry = _registry()
    p = registry.prefill[0]
    body = {"served_model_names": [1, 2, 3]}  # everything else missing
    async with answering_client({"status": 200, "body": body}) as client:
        assert await health.check(registry, client, p, 1.0) is False
    problems = "; ".join(
        [f"{name}: Field required" for name in ("role", "model")]
        + [f"served_model_names.{i}: Input should be a valid string" for i in range(3)]
        + [f"{name}: Field required" for name in ("fingerprint", "block_size", "num_kv_blocks",
                                                  "max_model_len", "max_num_seqs")]
    )  # fmt: skip
    assert len(problems) == 354  # over health.PROBLEMS_CLIP_CHARS
    assert p.last_error == f"{NOT_HEALTH} ({problems[:240]}... (354 characters))"


async def test_a_field_the_router_does_not_know_is_ignored() -> None:
    registry = _registry()
    p = registry.prefill[0]
    newer = {**worker_health(FP, max_num_seqs=8).model_dump(), "kv_transfer": {"rdma": True}}
    async with answering_client({"status": 200, "body": newer}) as client:
        assert await health.check(registry, client, p, 1.0) is True
    assert (p.healthy, p.last_error, p.max_num_seqs, p.degraded) == (True, "", 8, [])


@pytest.fixture
async def router() -> AsyncIterator[tuple[Registry, httpx.AsyncClient]]:
    registry = _registry()
    cfg = RouterConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:2",), admin_key=ADMIN)
    app = create_app(cfg, registry)
    await app.state.service.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            yield registry, client
    finally:
        await app.state.service.stop()


async def test_a_degraded_worker_passes_and_instances_shows_why(
    router: tuple[Registry, httpx.AsyncClient],
) -> None:
    registry, client = router
    d = registry.decode[0]
    answer = {"status": 200, "body": worker_health(FP, degraded=[REASON]).model_dump()}
    async with answering_client(answer) as worker:
        assert await health.check(registry, worker, d, 1.0) is True
        assert (d.healthy, d.last_error, d.degraded) == (True, "", [REASON])
        listed = (await client.get("/instances", headers=AUTH)).json()["instances"]
        assert [(i["id"], i["healthy"], i["degraded"]) for i in listed] == [
            ("p0", False, []), ("d1", True, [REASON])]  # fmt: skip
        # Degraded with no reason named still says so; "ok" again clears it.
        answer["body"] = {**worker_health(FP).model_dump(), "status": "degraded"}
        assert await health.check(registry, worker, d, 1.0) is True
        assert d.degraded == ["degraded (the worker named no reason)"]
        answer["body"] = worker_health(FP).model_dump()
        assert await health.check(registry, worker, d, 1.0) is True
    described = (await client.get("/instances/d1", headers=AUTH)).json()
    assert (described["healthy"], described["degraded"]) == (True, [])
