"""Keys and the internal secret: every admin endpoint 401 without the admin key, the client
and admin keys never open each other's doors, and the worker-side guard on /internal/*."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pdrouter.common.auth import (
    INTERNAL_SECRET_HEADER,
    GateMiddleware,
    bearer_matches,
    internal_headers,
    secret_matches,
)
from pdrouter.common.doors import worker_door
from pdrouter.router.config import RouterConfig
from tests.pdrouter.router.in_process_router import in_process_router

ADMIN = "admin-key-7"
API = "sk-client-9"
SECRET = "pd-secret-3"

ADMIN_ENDPOINTS = [
    ("GET", "/instances"),
    ("GET", "/instances/p0"),
    ("POST", "/instances"),
    ("PUT", "/instances/p0/heartbeat"),
    ("POST", "/instances/p0/drain"),
    ("POST", "/instances/p0/undrain"),
    ("DELETE", "/instances/p0"),
]


def test_secret_and_bearer_comparisons() -> None:
    assert secret_matches(None, None) and secret_matches("x", None)  # unset: open
    assert secret_matches("abc", "abc")
    assert not secret_matches("abd", "abc") and not secret_matches(None, "abc")
    assert not secret_matches("", "abc") and not secret_matches("abcd", "abc")
    assert bearer_matches(f"Bearer {ADMIN}", ADMIN)
    assert not bearer_matches(ADMIN, ADMIN)  # the scheme is required
    # The scheme in any case, one or more spaces after it (RFC 7235); the key exactly.
    assert bearer_matches(f"bearer {ADMIN}", ADMIN) and bearer_matches(f"BEARER  {ADMIN}", ADMIN)
    assert not bearer_matches(f"Bearer{ADMIN}", ADMIN) and not bearer_matches(
        f"Basic {ADMIN}", ADMIN
    )
    assert not bearer_matches(f"Bearer {ADMIN.upper()}", ADMIN)
    assert not bearer_matches(f"Bearer {ADMIN} ", ADMIN) and not bearer_matches("Bearer", ADMIN)
    assert not bearer_matches(None, ADMIN) and bearer_matches(None, None)
    assert internal_headers(None) == {} and internal_headers("s") == {INTERNAL_SECRET_HEADER: "s"}
    # Non-ASCII input must be a refusal, not a crash (compare_digest rejects non-ASCII str).
    assert not secret_matches("k\u00e9y", "key")


@contextlib.asynccontextmanager
async def _router(admin_key: str | None, api_key: str | None) -> AsyncIterator[httpx.AsyncClient]:
    cfg = RouterConfig(prefill_urls=(), decode_urls=(), admin_key=admin_key, api_key=api_key)
    async for client in in_process_router(cfg, timeout_s=5.0):
        yield client


@pytest.mark.parametrize(("method", "path"), ADMIN_ENDPOINTS)
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", f"Bearer {API}", ADMIN, f"Basic {ADMIN}", f"Bearer {ADMIN}x"],
)
async def test_admin_endpoints_need_the_admin_key(
    method: str, path: str, authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    async with _router(ADMIN, API) as router:
        resp = await router.request(method, path, headers=headers, json={})
        assert resp.status_code == 401, resp.text
        error = resp.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_admin_key")
        assert error["message"] == (
            "invalid or missing admin key (send 'Authorization: Bearer <admin key>')"
        )
        assert ADMIN not in resp.text
        # The right key gets past the door (404: no such instance; 400: empty registration).
        resp = await router.request(
            method, path, headers={"Authorization": f"Bearer {ADMIN}"}, json={}
        )
        assert resp.status_code == {"GET": 200 if path == "/instances" else 404,
                                    "POST": 400 if path == "/instances" else 404,
                                    "PUT": 404, "DELETE": 404}[method]  # fmt: skip


async def test_admin_key_does_not_open_the_client_api_and_no_admin_key_means_closed() -> None:
    async with _router(ADMIN, API) as router:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        resp = await router.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert (resp.status_code, resp.json()["error"]["code"]) == (401, "invalid_api_key")
        resp = await router.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 401
        resp = await router.get("/v1/models", headers={"Authorization": f"Bearer {API}"})
        assert (resp.status_code, resp.json()) == (200, {"object": "list", "data": []})
        # A header that is not ASCII is a refusal (401), never a crash (500).
        resp = await router.get("/v1/models", headers={"Authorization": "Bearer \u00e9".encode()})
        assert (resp.status_code, resp.json()["error"]["message"]) == (
            401, "invalid or missing API key (send 'Authorization: Bearer <API key>')")  # fmt: skip
    # An API key without an admin key: the admin doors are closed to everyone, the client
    # key included (they were open: a keyed router let anyone drain or register).
    async with _router(None, API) as router:
        for headers in ({}, {"Authorization": f"Bearer {API}"}):
            resp = await router.get("/instances", headers=headers)
            assert (resp.status_code, resp.json()["error"]["message"]) == (
                401, "/instances is closed: this server has no admin key set")  # fmt: skip
    async with _router(None, None) as router:  # no key at all: open, as before
        resp = await router.get("/instances")
        assert (resp.status_code, resp.json()) == (200, {"fingerprint": None, "instances": []})


# -- the worker side: /internal/* behind the shared secret ------------------------------------


def _guarded_app() -> FastAPI:
    app = FastAPI()

    @app.post("/internal/prefill")
    async def prefill() -> dict[str, str]:
        return {"ok": "prefill"}

    @app.post("/internal/decode")
    async def decode() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            for i in range(3):
                yield f"data: {i}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app.add_middleware(GateMiddleware, gate=worker_door(None, SECRET, None))
    return app


@pytest.mark.parametrize("path", ["/internal/prefill", "/internal/decode"])
@pytest.mark.parametrize("given", [None, "", "wrong", SECRET + "x", SECRET[:-1], "\u00e9"])
async def test_internal_endpoints_refuse_without_the_secret(path: str, given: str | None) -> None:
    headers = {INTERNAL_SECRET_HEADER: given.encode("utf-8")} if given is not None else {}
    transport = httpx.ASGITransport(app=_guarded_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        resp = await client.post(path, headers=headers, json={})
    assert resp.status_code == 401
    assert resp.json() == {"error": {
        "message": f"{path} needs the router's shared secret in the X-PD-Internal-Secret header",
        "type": "invalid_request_error", "param": None, "code": "invalid_secret"}}  # fmt: skip


async def test_internal_endpoints_pass_with_the_secret_and_others_stay_open() -> None:
    transport = httpx.ASGITransport(app=_guarded_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        headers = {INTERNAL_SECRET_HEADER: SECRET}
        resp = await client.post("/internal/prefill", headers=headers)
        assert (resp.status_code, resp.json()) == (200, {"ok": "prefill"})
        resp = await client.post("/internal/decode", headers=headers)
        assert (resp.status_code, resp.text) == (200, "data: 0\n\ndata: 1\n\ndata: 2\n\n")
        resp = await client.get("/health")
        assert (resp.status_code, resp.json()) == (200, {"status": "ok"})


def test_an_empty_secret_is_no_secret() -> None:
    assert worker_door(None, "", None).accepted("/internal/prefill") == frozenset()


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_a_worker_refusing_the_router_is_a_502_not_the_clients_401(stage: str) -> None:
    from pdrouter.router.orchestrator.failures import answer_outcome
    from pdrouter.wire.errors import APIError

    refusal = httpx.Response(
        401,
        json={
            "error": {
                "message": "needs the secret",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_secret",
            }
        },
    )
    err = answer_outcome(stage, "http://127.0.0.1:9", refusal).final
    assert isinstance(err, APIError)
    assert (err.status, err.stage, err.err_type, err.code) == (502, stage, "server_error", None)
    assert err.message == (
        f"{stage} instance http://127.0.0.1:9 refused the router (needs the secret); give the "
        "router and the workers the same --internal-secret"
    )
    # Other 4xx stay the client's (P is the tokenizer of record: a too-long prompt is a 400).
    too_long = httpx.Response(400, json={"error": {"message": "too long",
                                                   "type": "invalid_request_error"}})  # fmt: skip
    final = answer_outcome(stage, "http://127.0.0.1:9", too_long).final
    assert final is not None and final.status == 400


async def test_a_wrong_method_is_401_without_the_key_and_405_with_allow_with_it() -> None:
    """Without the key every method of every path is 401 (a 405 would tell a stranger which
    routes exist); with it, a method no route serves is 405 with Allow (RFC 9110)."""
    async with _router(ADMIN, API) as router:
        for method, path in [("TRACE", "/instances"), ("PATCH", "/debug/requests/x"),
                             ("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"),
                             ("TRACE", "/nowhere")]:  # fmt: skip
            resp = await router.request(method, path)
            assert resp.status_code == 401, (method, path, resp.text)
            assert "allow" not in resp.headers
        admin = {"Authorization": f"bearer {ADMIN}"}  # the scheme in lower case is fine
        resp = await router.request("TRACE", "/instances", headers=admin)
        assert (resp.status_code, resp.headers["allow"]) == (405, "GET, POST"), resp.text
        assert resp.json()["error"]["type"] == "invalid_request_error"
        resp = await router.request("PATCH", "/debug/requests/x", headers=admin)
        assert (resp.status_code, resp.headers["allow"]) == (405, "GET")
        client = {"Authorization": f"BEARER {API}"}
        resp = await router.get("/v1/completions", headers=client)
        assert (resp.status_code, resp.headers["allow"]) == (405, "POST"), resp.text
        assert (await router.get("/instances", headers=admin)).status_code == 200
