"""The router's tokenizer routes (pdrouter.wire.tokenize): relayed to a prefill worker, the
tokenizer of record (a decode worker when no P is healthy), its answer passed through.

A keys-file key's call counts against its key's call limits (requests_per_minute,
max_concurrent) as a completion's does (Tenancy.call). The router has no tokenizer of its
own; these calls are rare (an evaluation's set-up, a client counting tokens) and small, so
they take the control plane's client, the one the health checks use, with its bound, and no
retry: a worker's error is the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import httpx
from fastapi import FastAPI, Request, Response

from pdrouter.router.instances.registry import Registry
from pdrouter.wire.errors import APIError
from pdrouter.wire.tokenize import (
    DETOKENIZE_PATH,
    TOKENIZE_PATH,
    TOKENIZER_INFO_PATH,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfo,
)


async def _relay(
    client: httpx.AsyncClient | None, registry: Registry, method: str, path: str, body: bytes
) -> Response:
    workers = registry.healthy("prefill") or registry.healthy("decode")
    if client is None or not workers:
        raise APIError(503, "no worker to tokenize with", stage="prefill", retry_after_s=1)
    url = workers[0].url
    try:
        resp = await client.request(
            method, f"{url}{path}", content=body, headers={"content-type": "application/json"}
        )
    except httpx.HTTPError as exc:
        raise APIError(
            502, f"the tokenizer call to {url} failed: {exc!r}", stage="prefill"
        ) from None
    media = resp.headers.get("content-type", "application/json")
    return Response(resp.content, status_code=resp.status_code, media_type=media)


def install_tokenize_routes(
    app: FastAPI,
    registry: Registry,
    client: Callable[[], httpx.AsyncClient | None],
    key_call: Callable[[str | None], AbstractContextManager[None]],
) -> None:
    """POST /tokenize, /detokenize and GET /tokenizer_info (client: the health checks', made
    at startup; key_call(authorization): the call counted against its API key's call limits,
    as a completion is: Tenancy.call)."""

    @app.post(TOKENIZE_PATH, response_model=TokenizeResponse)
    async def tokenize(
        body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request
    ) -> Response:
        with key_call(request.headers.get("authorization")):
            return await _relay(client(), registry, "POST", TOKENIZE_PATH, await request.body())

    @app.post(DETOKENIZE_PATH, response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        with key_call(request.headers.get("authorization")):
            return await _relay(client(), registry, "POST", DETOKENIZE_PATH, await request.body())

    @app.get(TOKENIZER_INFO_PATH, response_model=TokenizerInfo)
    async def tokenizer_info(request: Request) -> Response:
        with key_call(request.headers.get("authorization")):
            return await _relay(client(), registry, "GET", TOKENIZER_INFO_PATH, b"")
