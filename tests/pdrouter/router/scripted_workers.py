"""Scripted P and D servers for router tests: real HTTP on loopback, faults on demand.

A real worker cannot be told to answer 500 on its next two calls or to hold a stream open until
the test says so; these servers speak the internal P/D protocol (pdrouter.wire.pd) and do
exactly that, so the router's breaker, admission and metrics paths are tested over real
sockets in milliseconds. Each server runs under uvicorn inside the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdrouter.common.proc import find_free_port
from pdrouter.wire.pd import (
    DecodeEvent,
    DecodeRequest,
    DecodeTimings,
    KVHandle,
    LocalPrefill,
    PrefetchAnswer,
    PrefetchRequest,
    PrefillRequest,
    PrefillResult,
    PrefillTimings,
    decode_event_sse,
)
from tests.pdrouter.router.worker_health import worker_health

FINGERPRINT = "fp-scripted"
BLOCK_SIZE = 4
MAX_MODEL_LEN = 256
PROMPT_IDS = [11, 12, 13, 14, 15, 16]  # 1 full block + a partial block of 2
NUM_UNCACHED = 2  # P's caches hold the full block: a threshold above 2 leaves it to D
FIRST_TOKEN = 100
PREFILL_TIMINGS = PrefillTimings(
    queue_compute_s=0.004,
    engine_queue_s=0.001,
    engine_compute_s=0.0025,
    d2h_s=0.001,
    put_s=0.002,
    write_wait_s=0.0015,
    total_s=0.008,
)
DECODE_TIMINGS = DecodeTimings(alloc_wait_s=0.0005, get_s=0.003, h2d_s=0.001, ttft_s=0.006)


class ScriptedWorker:
    """One P or D. statuses: HTTP statuses of the next calls (200 when the list is empty);
    gate: when set, D waits on it before its final event (a stream held open);
    cut_after: D ends its next stream after this many events, unfinished (it died);
    frozen: set, the worker stops answering: /health and P's answers wait until it is
    cleared (D's stream waits on gate as before);
    faults: how the next calls fail, one entry per call (taken before statuses):
    "malformed" (200 with a body that is no PrefillResult / a stream of no DecodeEvent),
    "error_body_502_missing" (D's 502 of the `fail` missing-KV policy, naming the keys);
    health_gate: when set, /health waits on it (a saturated worker that answers late) while
    everything else goes on; event_gap_s: D's pause between two events (a stream that
    progresses slowly); first_event_delays_s: D's wait before the first event of each next
    call, one entry per call (a request queued behind others in the engine).

    leaves_short_prompts: P answers LocalPrefill when the request's threshold is above
    NUM_UNCACHED (off: P always prefills, whatever the router's default); D then streams
    from the first token (" t0", as P's), and its final event reports 4 cached tokens."""

    def __init__(self, role: str, num_tokens: int = 4) -> None:
        self.role = role
        self.num_tokens = num_tokens  # output tokens of a request, P's first included
        self.statuses: list[int] = []
        self.faults: list[str] = []
        self.gate: asyncio.Event | None = None
        self.cut_after: int | None = None
        self.frozen = False
        self._thawed = asyncio.Event()
        self.health_gate: asyncio.Event | None = None
        self.num_health_checks = 0  # /health requests received
        self.event_gap_s = 0.0
        self.first_event_delays_s: list[float] = []
        self.leaves_short_prompts = False
        self.output_ids_seen: list[list[int]] = []  # output_token_ids of each decode call
        self.request_ids: list[str] = []
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []  # (headers, OpenAI body)
        # D's prefetches (early decode): the ids asked for and released, and the statuses
        # of the next ones (202 when empty)
        self.prefetched: list[str] = []
        self.released: list[str] = []
        self.prefetch_statuses: list[int] = []
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = self._make_app()
        self._server: LoopServer | None = None

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, Any]:
            self.num_health_checks += 1
            await self._unless_frozen()
            if self.health_gate is not None:
                await self.health_gate.wait()
            return worker_health(FINGERPRINT, role=self.role, block_size=BLOCK_SIZE,
                                 max_model_len=MAX_MODEL_LEN).model_dump()  # fmt: skip

        @app.post("/internal/prefill")
        async def prefill(request: Request) -> Response:
            req = PrefillRequest.model_validate(await request.json())
            self.request_ids.append(req.request_id)
            self.seen.append((dict(request.headers), req.body))
            await self._unless_frozen()
            fault = self._fault()
            if fault is not None:
                return fault
            status = self.statuses.pop(0) if self.statuses else 200
            if status != 200:
                return JSONResponse({"error": {"message": f"scripted {status}"}}, status)
            if self.leaves_short_prompts and req.local_prefill_below_tokens > NUM_UNCACHED:
                local = LocalPrefill(request_id=req.request_id, prompt_token_ids=PROMPT_IDS,
                                     num_uncached_tokens=NUM_UNCACHED,
                                     threshold_tokens=req.local_prefill_below_tokens)  # fmt: skip
                return JSONResponse(local.model_dump())
            kv = KVHandle(fingerprint=FINGERPRINT, block_size=BLOCK_SIZE,
                          num_tokens=len(PROMPT_IDS), keys=["k/0", "k/1:partial:2"])  # fmt: skip
            result = PrefillResult(
                request_id=req.request_id, prompt_token_ids=PROMPT_IDS,
                first_token_id=FIRST_TOKEN, first_text=" t0", kv=kv, num_blocks_written=1,
                num_blocks_skipped=1, num_bytes_written=4096, timings=PREFILL_TIMINGS,
                num_cached_tokens=4, num_pool_cached_tokens=4,
            )  # fmt: skip
            return JSONResponse(result.model_dump())

        @app.post("/internal/decode")
        async def decode(request: Request) -> Response:
            req = DecodeRequest.model_validate(await request.json())
            self.request_ids.append(req.request_id)
            self.seen.append((dict(request.headers), req.body))
            self.output_ids_seen.append(list(req.output_token_ids))
            fault = self._fault()
            if fault is not None:
                return fault
            status = self.statuses.pop(0) if self.statuses else 200
            if status != 200:
                return JSONResponse({"error": {"message": f"scripted {status}"}}, status)
            return StreamingResponse(self._events(req), media_type="text/event-stream")

        @app.post("/internal/prefetch")
        async def prefetch(request: Request) -> Response:
            req = PrefetchRequest.model_validate(await request.json())
            self.prefetched.append(req.request_id)
            status = self.prefetch_statuses.pop(0) if self.prefetch_statuses else 202
            if status != 202:
                return JSONResponse({"error": {"message": f"scripted {status}"}}, status)
            answer = PrefetchAnswer(
                request_id=req.request_id, num_prompt_tokens=len(PROMPT_IDS), num_blocks_reserved=2
            )
            return JSONResponse(answer.model_dump(), 202)

        @app.delete("/internal/prefetch/{request_id}")
        async def release(request_id: str) -> Response:
            self.released.append(request_id)
            return Response(status_code=204)

        return app

    def _fault(self) -> Response | None:
        if not self.faults:
            return None
        fault = self.faults.pop(0)
        if fault == "malformed":
            if self.role == "prefill":
                return JSONResponse({"not": "a prefill result"})
            return StreamingResponse(iter([b"data: {not json\n\n"]), media_type="text/event-stream")
        if fault == "error_body_502_missing":
            error = {"message": "1 block missing from the pool", "type": "server_error",
                     "code": "kv_missing", "missing_keys": ["k/1:partial:2"]}  # fmt: skip
            return JSONResponse({"error": error}, 502)
        raise AssertionError(f"unknown scripted fault {fault!r}")

    def freeze(self) -> None:
        self.frozen = True
        self._thawed.clear()

    def thaw(self) -> None:
        self.frozen = False
        self._thawed.set()

    async def _unless_frozen(self) -> None:
        if self.frozen:
            await self._thawed.wait()

    async def _events(self, req: DecodeRequest) -> AsyncIterator[bytes]:
        done = len(req.output_token_ids)
        cut_after, self.cut_after = self.cut_after, None
        if self.first_event_delays_s:
            await asyncio.sleep(self.first_event_delays_s.pop(0))
        for k in range(done, self.num_tokens):
            if k > done and self.event_gap_s:
                await asyncio.sleep(self.event_gap_s)
            if cut_after is not None and k - done == cut_after:
                return
            last = k == self.num_tokens - 1
            if last and self.gate is not None:
                await self.gate.wait()
            ev = DecodeEvent(
                token_ids=[FIRST_TOKEN + k],
                text=f" t{k}",
                finished=last,
                finish_reason="length" if last else None,
                num_output_tokens=k + 1,
            )
            if last and req.kv is None:  # D prefilled: its cache held the full block
                ev.num_tokens_recomputed, ev.num_cached_tokens, ev.num_pool_cached_tokens = 0, 4, 4
            elif last:
                ev.num_blocks_loaded, ev.num_tokens_recomputed = 1, 2
                ev.num_bytes_read, ev.timings = 2048, DECODE_TIMINGS
            yield decode_event_sse(ev)  # as D writes it

    async def start(self) -> None:
        self._server = LoopServer(self.app, self.port)
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()


class LoopServer:
    """An ASGI app under uvicorn in this event loop on a loopback port; stop() ends it."""

    def __init__(self, app: Any, port: int | None = None, lifespan: str = "off") -> None:
        self.port = port if port is not None else find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                lifespan=lifespan)  # fmt: skip
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout=5)
