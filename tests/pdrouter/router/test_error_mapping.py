"""The router answers every error on every route with the one OpenAI error body
(pdrouter.common.error_mapping, shared with the workers): FastAPI's parameter validation, a
stray ValueError and any other exception included, on the FastAPI routes and on the plain-ASGI
OpenAI routes alike."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from pdrouter.router.app import create_app
from pdrouter.router.config import RouterConfig
from pdrouter.router.instances.registry import Registry
from tests.pdrouter.router.test_metrics_flow import BODY, _metric, cluster

P, D = "http://127.0.0.1:9", "http://127.0.0.1:10"
SERVER_ERROR = {
    "message": "internal router error; the router log has the details",
    "type": "server_error",
    "param": None,
    "code": None,
}


def _router_app() -> Any:
    app = create_app(RouterConfig(prefill_urls=(P,), decode_urls=(D,)), Registry([P], [D]))

    @app.get("/test/raises/{kind}")
    async def raises(kind: str) -> None:
        raise ValueError("a bug") if kind == "value" else RuntimeError("another bug")

    return app


async def _call(app: Any, method: str, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.request(method, path, headers={"X-Request-Id": "req-7"})


async def test_a_bad_query_parameter_is_a_400_in_the_openai_shape_not_fastapis_422() -> None:
    resp = await _call(_router_app(), "DELETE", "/instances/p0?if_drained=maybe")
    assert resp.status_code == 400, resp.text
    assert resp.json() == {
        "error": {
            "message": "if_drained: Input should be a valid boolean, unable to interpret input",
            "type": "invalid_request_error",
            "param": "if_drained",
            "code": None,
        }
    }
    assert resp.headers["X-Request-Id"] == "req-7"


@pytest.mark.parametrize("kind", ["value", "runtime"])
async def test_a_stray_exception_on_a_fastapi_route_is_a_500_with_the_body(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A ValueError that reaches the handler escaped from the router's own code: a 500 (not
    the client's 400), without internals, its traceback in the router's log."""
    with caplog.at_level(logging.ERROR):
        resp = await _call(_router_app(), "GET", f"/test/raises/{kind}")
    assert resp.status_code == 500
    assert resp.json() == {"error": SERVER_ERROR}
    assert resp.headers["X-Request-Id"] == "req-7"
    logged = [r for r in caplog.records if r.exc_info is not None]
    assert [r.getMessage() for r in logged] == [f"GET /test/raises/{kind}: unhandled error"]


async def test_a_stray_value_error_on_an_openai_route_is_a_500_counted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with cluster() as c:
        answers = c.service.answers
        assert answers is not None

        async def broken(ctx: Any, result: Any) -> Any:
            raise ValueError("a bug in the answer")

        answers.complete = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR):
            resp = await c.client.post("/v1/chat/completions", json=BODY,
                                       headers={"X-Request-Id": "bug-2"})  # fmt: skip
        assert resp.status_code == 500
        assert resp.json() == {"error": SERVER_ERROR}
        assert resp.headers["X-Request-Id"] == "bug-2"
        logged = [r for r in caplog.records if r.exc_info is not None]
        assert [r.getMessage() for r in logged] == ["request bug-2: unhandled error"]
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_requests_total", 'endpoint="chat",status="500"') == 1
        timeline = c.service.timelines.get("bug-2")
        assert timeline is not None and timeline.status == 500
