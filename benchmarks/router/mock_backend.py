"""A model-free backend for the router benchmark: streams N one-token chunks, fast.

    python -m benchmarks.router.mock_backend --role decode --port 8200 [--token-interval-ms 0]

It speaks every protocol the routers under comparison call, so one pair of mock processes
(one P, one D) serves all of them in the same run:

    POST /v1/completions, /v1/chat/completions   OpenAI, streamed or not (direct calls, the vLLM
                                                 toy proxy, the SGLang gateway); a `prefill`
                                                 role answers one token, as a real P does
    POST /internal/prefill                       our PrefillResult (first token, KV handle)
    POST /internal/decode                        our DecodeEvent stream, one token an event
    POST /internal/prefetch, DELETE .../{id}     202 (nothing reserved), 204: a D's answers
    POST /v1/traces (OTLP/HTTP: accepted and dropped, for the traced router)
    GET  /health, /v1/models, /get_model_info, /get_server_info, /health_generate

Token k of every answer has the text " w{k}" (k from 0), so a client can check that a stream
arrived whole and in order. It is a bare ASGI callable (no FastAPI routing, no pydantic) so
that the backend costs as little CPU as possible: on a 2-core machine it shares the cores
with the router under test and the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pdrouter.common.body_limit import BodyLimit, read_body
from pdrouter.common.cli_args import add_flag
from pdrouter.router.asgi import Receive, Scope, Send, run_lifespan
from pdrouter.wire.worker import WorkerHealth

logger = logging.getLogger("benchmarks.router.mock_backend")

MockRole = Literal["mixed", "prefill", "decode"]

DEFAULT_MAX_TOKENS = 16
_MAX_BODY_BYTES = 32 * 1024 * 1024
_BODY_LIMIT = BodyLimit(_MAX_BODY_BYTES, None, 0, "_MAX_BODY_BYTES")
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


@dataclass(frozen=True)
class MockConfig:
    role: MockRole = "mixed"
    model: str = "mock"
    fingerprint: str = "mock-fingerprint"
    block_size: int = 16
    # Reported as model_path to the SGLang gateway, which loads a tokenizer from it: a local
    # folder holding tokenizer.json keeps it from trying to download one by model name.
    model_path: str | None = None
    token_interval_s: float = 0.0  # pause before each streamed token after the first


def token_text(index: int) -> str:
    """The text of output token `index` (0-based) in every mock answer."""
    return f" w{index}"


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    return max(1, int(value))


def _prompt_len(body: dict[str, Any]) -> int:
    """A stand-in for the tokenized prompt length: one token per 4 characters, at least 1."""
    prompt = body.get("prompt") if "prompt" in body else body.get("messages", "")
    return max(1, len(json.dumps(prompt)) // 4)


class MockBackend:
    """The ASGI app. Counters are per instance (one per process), read by tests."""

    def __init__(self, cfg: MockConfig) -> None:
        self.cfg = cfg
        self.num_requests: dict[str, int] = {}
        # Built once (no pydantic per request). An engine no benchmark load fills and a context
        # no benchmark prompt nears: the router derives its in-flight bounds (max_num_seqs,
        # num_kv_blocks) and its body limit (max_model_len) from these, and the mock must not
        # be what limits a run.
        self._health = WorkerHealth(
            role=cfg.role,
            model=cfg.model,
            served_model_names=[cfg.model],
            fingerprint=cfg.fingerprint,
            block_size=cfg.block_size,
            num_kv_blocks=1 << 24,
            max_model_len=1 << 19,
            max_num_seqs=1 << 16,
        ).model_dump()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await run_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        self.num_requests[path] = self.num_requests.get(path, 0) + 1
        if method == "GET":
            info = self._info(path)
            if info is None:
                await self._json(send, 404, {"error": {"message": f"no route GET {path}"}})
            else:
                await self._json(send, 200, info)
            return
        raw = await read_body(receive, _BODY_LIMIT)
        if path == "/v1/traces":  # a traced router's spans (OTLP/HTTP, protobuf): taken, dropped
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"0")]})  # fmt: skip
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            await self._json(send, 400, {"error": {"message": "body is not JSON"}})
            return
        if path == "/internal/prefill":
            await self._json(send, 200, self._prefill_result(body))
        elif path == "/internal/decode":
            await self._decode_stream(send, body)
        elif path == "/internal/prefetch":  # a real D's 202: the reservation it made
            answer = {"request_id": body.get("request_id", ""), "num_prompt_tokens": 0,
                      "num_blocks_reserved": 0}  # fmt: skip
            await self._json(send, 202, answer)
        elif method == "DELETE" and path.startswith("/internal/prefetch/"):
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            await self._openai(send, path, body)
        else:
            logger.warning("mock backend: no route %s %s", method, path)
            await self._json(send, 404, {"error": {"message": f"no route POST {path}"}})

    def _info(self, path: str) -> dict[str, Any] | None:
        cfg = self.cfg
        if path in ("/health", "/health_generate", "/readiness", "/liveness"):
            return self._health
        if path == "/v1/models":
            return {"object": "list", "data": [{"id": cfg.model, "object": "model"}]}
        model_path = cfg.model_path or cfg.model
        if path in ("/model_info", "/get_model_info"):
            return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True}
        if path in ("/server_info", "/get_server_info"):
            return {"model_path": model_path, "disaggregation_mode": cfg.role, "dp_size": 1}
        return None

    # -- our internal P/D protocol ----------------------------------------------------------

    def _prefill_result(self, req: dict[str, Any]) -> dict[str, Any]:
        body = req.get("body", {})
        num_prompt = _prompt_len(body)
        done = _max_tokens(body) == 1
        num_blocks = -(-num_prompt // self.cfg.block_size)
        keys = [f"mock/{self.cfg.fingerprint}/{i:064x}" for i in range(num_blocks)]
        return {
            "request_id": req.get("request_id", ""),
            "prompt_token_ids": list(range(1, num_prompt + 1)),
            "first_token_id": 1000,
            "first_text": token_text(0),
            "finish_reason": "length" if done else None,
            "kv": None
            if done
            else {
                "fingerprint": self.cfg.fingerprint,
                "block_size": self.cfg.block_size,
                "num_tokens": num_prompt,
                "keys": keys,
            },
            "num_blocks_written": num_blocks,
        }

    async def _decode_stream(self, send: Send, req: dict[str, Any]) -> None:
        num_sent = len(req.get("output_token_ids", [1]))  # tokens the client already has
        num_total = _max_tokens(req.get("body", {}))
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        for k in range(num_sent, num_total):
            await self._pace()
            last = k == num_total - 1
            event: dict[str, Any] = {
                "token_ids": [1000 + k],
                "text": token_text(k),
                "num_output_tokens": k + 1,
            }
            if last:
                event.update(finished=True, finish_reason="length", num_blocks_loaded=1)
            await send({"type": "http.response.body", "body": _sse(event), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # -- OpenAI -----------------------------------------------------------------------------

    async def _openai(self, send: Send, path: str, body: dict[str, Any]) -> None:
        chat = path.endswith("chat/completions")
        num_out = 1 if self.cfg.role == "prefill" else _max_tokens(body)
        num_prompt = _prompt_len(body)
        common = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "created": int(time.time()),
            "model": body.get("model") or self.cfg.model,
        }
        usage = {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_out,
            "total_tokens": num_prompt + num_out,
        }
        if not body.get("stream"):
            text = "".join(token_text(k) for k in range(num_out))
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            obj = "chat.completion" if chat else "text_completion"
            answer = {**common, "object": obj, "choices": [choice], "usage": usage}
            answer["kv_transfer_params"] = None  # what the vLLM toy proxy reads back from P
            await self._json(send, 200, answer)
            return
        obj = "chat.completion.chunk" if chat else "text_completion"
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        for k in range(num_out):
            if k:
                await self._pace()
            finish = "length" if k == num_out - 1 else None
            if chat:
                delta = {"content": token_text(k)}
                if not k:
                    delta["role"] = "assistant"
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": token_text(k), "finish_reason": finish}
            chunk = _sse({**common, "object": obj, "choices": [choice]})
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = _sse({**common, "object": obj, "choices": [], "usage": usage})
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    # -- helpers ----------------------------------------------------------------------------

    async def _pace(self) -> None:
        if self.cfg.token_interval_s > 0:
            await asyncio.sleep(self.cfg.token_interval_s)

    async def _json(self, send: Send, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": status, "headers": _JSON})
        await send({"type": "http.response.body", "body": data, "more_body": False})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--role", default="mixed", choices=["mixed", "prefill", "decode"],
             help="prefill: OpenAI answers hold one token, as a real P's do")  # fmt: skip
    add_flag(parser, "--host", default="127.0.0.1", help="address to bind")
    add_flag(parser, "--port", type=int, required=True, help="port to serve on")
    add_flag(parser, "--model", default="mock", help="model name the backend reports")
    add_flag(parser, "--model-path", default=None,
             help="model_path to report (a local folder with tokenizer.json)")  # fmt: skip
    add_flag(parser, "--token-interval-ms", type=float, default=0.0,
             help="pause before each streamed token after the first")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import uvicorn

    cfg = MockConfig(
        role=args.role,
        model=args.model,
        model_path=args.model_path,
        token_interval_s=args.token_interval_ms / 1000.0,
    )
    uvicorn.run(
        MockBackend(cfg), host=args.host, port=args.port, log_level="warning", access_log=False
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router.mock_backend")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
