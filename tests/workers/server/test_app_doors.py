"""A worker started with an API key: /v1/* need it (or the internal secret), everything else
but /health the secret or the admin key, and /health tells a stranger only `status`."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import httpx
import pytest

from pdrouter.common.auth import INTERNAL_SECRET_HEADER
from pdrouter.common.cli_args import MirroredParser
from workers.server.app import create_app
from workers.server.config import AppConfig
from workers.server.main import add_arguments, config_from_args

API, ADMIN, SECRET = "sk-api-1", "admin-2", "secret-3"


def _never_loads() -> None:
    raise AssertionError("the door tests never start the engine")


async def _client(api_key: str | None) -> AsyncIterator[httpx.AsyncClient]:
    config = AppConfig(
        role="prefill", served_model_names=("tiny",), api_key=api_key, admin_key=ADMIN
    )
    # No lifespan runs under ASGITransport: the engine stays "loading", the doors are real.
    app = create_app(config, _never_loads, internal_secret=SECRET)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        yield client


@pytest.fixture
async def keyed() -> AsyncIterator[httpx.AsyncClient]:
    async for client in _client(API):
        yield client


async def test_client_routes_need_the_api_key_or_the_internal_secret(
    keyed: httpx.AsyncClient,
) -> None:
    for headers in ({}, {"Authorization": f"Bearer {ADMIN}"}):
        resp = await keyed.get("/v1/models", headers=headers)
        assert (resp.status_code, resp.json()["error"]["code"]) == (401, "invalid_api_key")
        resp = await keyed.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert resp.status_code == 401
    for headers in ({"Authorization": f"Bearer {API}"}, {INTERNAL_SECRET_HEADER: SECRET}):
        resp = await keyed.get("/v1/models", headers=headers)
        assert (resp.status_code, [m["id"] for m in resp.json()["data"]]) == (200, ["tiny"])


async def test_metrics_and_schema_need_the_secret_or_the_admin_key(
    keyed: httpx.AsyncClient,
) -> None:
    for path in ("/metrics", "/openapi.json", "/nowhere"):
        for headers in ({}, {"Authorization": f"Bearer {API}"}):
            assert (await keyed.get(path, headers=headers)).status_code == 401, path
    for headers in ({"Authorization": f"Bearer {ADMIN}"}, {INTERNAL_SECRET_HEADER: SECRET}):
        assert (await keyed.get("/metrics", headers=headers)).status_code == 200
    resp = await keyed.post("/internal/prefill", headers={"Authorization": f"Bearer {API}"})
    assert (resp.status_code, resp.json()["error"]["code"]) == (401, "invalid_secret")


async def test_health_is_a_liveness_probe_to_strangers(keyed: httpx.AsyncClient) -> None:
    resp = await keyed.get("/health", headers={"Authorization": f"Bearer {API}"})
    assert (resp.status_code, resp.json()) == (503, {"status": "loading"})
    resp = await keyed.get("/health", headers={INTERNAL_SECRET_HEADER: SECRET})
    assert (resp.status_code, resp.json()) == (503, {"status": "loading", "role": "prefill"})


async def test_without_an_api_key_only_internal_routes_are_guarded() -> None:
    async for client in _client(None):
        assert (await client.get("/v1/models")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.get("/health")).json() == {"status": "loading", "role": "prefill"}
        assert (await client.post("/internal/prefill")).status_code == 401


def test_keys_come_from_the_environment_not_the_command_line() -> None:
    parser = MirroredParser(prog="pdworker serve", env_prefix="PDWORKER_")
    add_arguments(parser)
    environ = {"PDWORKER_API_KEY": API, "PDWORKER_ADMIN_KEY": ADMIN}
    argv = ["--role", "mixed"]
    args: argparse.Namespace = parser.parse_args(parser.env_tokens(argv, environ) + argv)
    app = config_from_args(args).app
    assert (app.api_key, app.admin_key) == (API, ADMIN)
    assert API not in repr(app) and ADMIN not in repr(app)


async def test_a_wrong_method_is_401_without_the_key_and_405_with_allow_with_it(
    keyed: httpx.AsyncClient,
) -> None:
    for method, path in [("TRACE", "/metrics"), ("PUT", "/v1/completions"),
                         ("GET", "/internal/prefill"), ("TRACE", "/nowhere")]:  # fmt: skip
        resp = await keyed.request(method, path)
        assert resp.status_code == 401, (method, path, resp.text)
        assert "allow" not in resp.headers
    resp = await keyed.request("TRACE", "/metrics", headers={"Authorization": f"bearer {ADMIN}"})
    assert (resp.status_code, resp.headers["allow"]) == (405, "GET"), resp.text
    resp = await keyed.request("PUT", "/v1/completions", headers={"Authorization": f"Bearer {API}"})
    assert (resp.status_code, resp.headers["allow"]) == (405, "POST")
