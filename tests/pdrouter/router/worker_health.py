"""What a stand-in worker answers on GET /health: the real WorkerHealth, from one factory.

Every test double the router health-checks (scripted workers, in-process /health apps, raw
socket servers) and every direct `Registry.check_passed` call builds its answer here, so a
field added to pdrouter.wire.worker.WorkerHealth breaks these tests first, in one place.

    worker_health(fingerprint="fp-x", role="prefill")      WorkerHealth (check_passed)
    worker_health(...).model_dump()                         a FastAPI handler's return value
    worker_health(...).model_dump_json().encode()           a raw HTTP body
    answering_client({"status": 200, "body": ...})          an httpx client whose every
                                                            GET /health answers that
"""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pdrouter.wire.worker import WorkerHealth

# An engine larger than any test's load: the in-flight bounds the router derives from
# max_num_seqs and num_kv_blocks (Admission.bound_of, token_bound) never bite unless a test
# passes its own.
ROOMY_MAX_NUM_SEQS = 1024
ROOMY_NUM_KV_BLOCKS = 1 << 20


def worker_health(
    fingerprint: str = "fp",
    *,
    role: str = "decode",
    model: str = "tiny",
    block_size: int = 16,
    num_kv_blocks: int = ROOMY_NUM_KV_BLOCKS,
    max_model_len: int = 4096,
    max_num_seqs: int = ROOMY_MAX_NUM_SEQS,
    degraded: list[str] | None = None,
) -> WorkerHealth:
    """A ready worker's /health body; degraded: its reasons (status "degraded"), None: ok."""
    return WorkerHealth(
        status="degraded" if degraded else "ok",
        degraded=degraded or [],
        role=role,
        model=model,
        served_model_names=[model],
        fingerprint=fingerprint,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
    )


def answering_client(answer: dict[str, Any]) -> httpx.AsyncClient:
    """A client whose every GET /health is answered by `answer` (status, body: JSON-able, or
    bytes sent as they are), mutable: a test changes what the worker says between checks."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        body, status = answer["body"], answer["status"]
        if isinstance(body, bytes):
            return Response(body, status_code=status, media_type="application/json")
        return JSONResponse(body, status_code=status)

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
