"""POST /v1/responses on the router in-process, no worker listening: the door comes first, a
bad body is a 400 naming the Responses field, a good one reaches the chat path (whose 503 for
no reachable D comes back as it is). The answers themselves: tests/e2e/pd/test_pd_responses.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from pdrouter.common.proc import find_free_port
from pdrouter.router.config import RouterConfig
from pdrouter.router.orchestrator import HopTimeouts, OrchestratorConfig
from tests.pdrouter.router.in_process_router import in_process_router

API_KEY = "sk-test-responses"
RESPONSES = "/v1/responses"


def _config(api_key: str | None = None) -> RouterConfig:
    return RouterConfig(
        prefill_urls=(f"http://127.0.0.1:{find_free_port()}",),
        decode_urls=(f"http://127.0.0.1:{find_free_port()}",),
        orchestrator=OrchestratorConfig(timeouts=HopTimeouts(connect_s=0.5)),
        api_key=api_key,
    )


@pytest.fixture
async def router() -> AsyncIterator[httpx.AsyncClient]:
    async for client in in_process_router(_config(), timeout_s=5.0):
        yield client


async def test_only_post_is_served(router: httpx.AsyncClient) -> None:
    resp = await router.get(RESPONSES)
    assert (resp.status_code, resp.headers["Allow"]) == (405, "POST")
    assert resp.json()["error"]["message"] == "method GET not allowed on /v1/responses"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny"}, "input"),
        ({"model": "tiny", "input": "x", "temperature": 3}, "temperature"),
        ({"model": "tiny", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"model": "tiny", "input": [{"type": "reasoning"}]}, "input[0].type"),
    ],
)
async def test_a_bad_body_is_a_400_naming_the_responses_field(
    router: httpx.AsyncClient, body: dict, param: str
) -> None:
    resp = await router.post(RESPONSES, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


async def test_a_good_body_reaches_the_chat_path(router: httpx.AsyncClient) -> None:
    resp = await router.post(RESPONSES, json={"model": "tiny", "input": "hi"})
    assert resp.status_code == 503  # the chat path's: no decode instance reachable
    assert "no decode instance reachable" in resp.json()["error"]["message"]
    assert resp.headers["x-request-id"]


async def test_the_api_key_is_checked_before_the_body() -> None:
    async for router in in_process_router(_config(API_KEY), timeout_s=5.0):
        resp = await router.post(RESPONSES, content=b"{not json")
        assert resp.status_code == 401
        auth = {"Authorization": f"Bearer {API_KEY}"}
        resp = await router.post(RESPONSES, content=b"{not json", headers=auth)
        assert resp.status_code == 400
