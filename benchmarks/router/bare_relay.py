"""The router benchmark's floor: the bare PD relay, with nothing a production router needs.

    python -m benchmarks.router.bare_relay --prefill URL --decode URL --port 8300 [--server raw]

It does exactly the two hops of our router, through the same stack (uvicorn, our HTTP/1.1
client pdrouter.router.upstream.h1, json): the client's body to P's /internal/prefill, P's first
token to the client, then D's /internal/decode events relayed as OpenAI completion chunks,
one write per network read.
Nothing else: no validation, no request ids, no metrics, no timeline, no instance selection,
breakers, limits, retries, failover, timeouts or disconnect handling. What it adds over a
direct call is what the process hops themselves cost on the machine; what our router adds
over it is the price of those features. It serves only streamed completions and exists for
the benchmark alone (`benchmarks.router.bench_router`, case `bare`).

`--server raw` serves the same relay without uvicorn: a bare asyncio protocol on uvloop that
parses requests with httptools and writes chunked answers itself (case `bare-raw`). It shows
how much of the floor is the server framework rather than the hops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from pdrouter.common.body_limit import BodyLimit, read_body
from pdrouter.router.asgi import Receive, Scope, Send, run_lifespan
from pdrouter.router.upstream.contract import HopTimeout
from pdrouter.router.upstream.h1 import H1Upstream

_SSE = [(b"content-type", b"text/event-stream")]
_JSON = {"content-type": "application/json"}
_BOUNDS = HopTimeout(connect_s=10.0, read_s=60.0)
_MAX_BODY_BYTES = 32 * 1024 * 1024  # the router's default --max-body-bytes
_BODY_LIMIT = BodyLimit(_MAX_BODY_BYTES, None, 0, "_MAX_BODY_BYTES")


class BareRelay:
    """The ASGI app: POST /v1/completions (streamed) and GET /health."""

    def __init__(self, prefill_url: str, decode_url: str) -> None:
        self.prefill_url = prefill_url + "/internal/prefill"
        self.decode_url = decode_url + "/internal/decode"
        self.client = H1Upstream(1024, {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await run_lifespan(receive, send, self.client.aclose)
        elif scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
        else:
            await self._relay(receive, send)

    async def _relay(self, receive: Receive, send: Send) -> None:
        body = json.loads(await read_body(receive, _BODY_LIMIT))
        prefill = {"request_id": "bare", "endpoint": "completions", "body": body}
        data = json.dumps(prefill).encode()
        async with self.client.request("POST", self.prefill_url, data, _JSON, _BOUNDS) as resp:
            result = json.loads(await resp.read())
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        await send(
            {"type": "http.response.body", "body": _chunk(result["first_text"]), "more_body": True}
        )
        decode = {**prefill, "prompt_token_ids": result["prompt_token_ids"],
                  "output_token_ids": [result["first_token_id"]], "kv": result["kv"]}  # fmt: skip
        buffer = b""
        data = json.dumps(decode).encode()
        async with self.client.request("POST", self.decode_url, data, _JSON, _BOUNDS) as resp:
            async for raw_read in resp.chunks():
                *events, buffer = (buffer + raw_read).split(b"\n\n")
                out = b"".join(_chunk(json.loads(event[6:])["text"]) for event in events)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


# A chunk is this prefix, the token's text as a JSON string, this suffix: the cheapest way to
# build it (a json.dumps of the whole chunk per token cost the relay 0.5 ms per 32 tokens).
_CHUNK_HEAD = b'data: {"object": "text_completion", "choices": [{"index": 0, "text": '
_CHUNK_TAIL = b"}]}\n\n"


def _chunk(text: str) -> bytes:
    return _CHUNK_HEAD + json.dumps(text).encode() + _CHUNK_TAIL


class _RawServer(asyncio.Protocol):
    """One client connection, requests one at a time, each served by BareRelay._relay through
    a receive/send pair that writes HTTP/1.1 chunked frames straight to the socket."""

    def __init__(self, app: BareRelay) -> None:
        import httptools

        self.app = app
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        if self.url == b"/health":
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            return
        asyncio.get_running_loop().create_task(self._serve(body))

    async def _serve(self, body: bytes) -> None:
        write = self.transport.write

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                      b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
                return
            data = message.get("body", b"")
            frame = b"%x\r\n%s\r\n" % (len(data), data) if data else b""
            write(frame if message.get("more_body") else frame + b"0\r\n\r\n")

        await self.app._relay(receive, send)


async def _serve_raw(app: BareRelay, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(
        lambda: _RawServer(app), "127.0.0.1", port
    )
    await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    import uvloop

    parser = argparse.ArgumentParser(prog="python -m benchmarks.router.bare_relay")
    parser.add_argument("--prefill", required=True, help="the prefill mock's URL")
    parser.add_argument("--decode", required=True, help="the decode mock's URL")
    parser.add_argument("--port", type=int, required=True, help="port to serve on")
    parser.add_argument("--server", choices=["uvicorn", "raw"], default="uvicorn",
                        help="raw: no server framework, a bare asyncio protocol")  # fmt: skip
    args = parser.parse_args(argv)
    app = BareRelay(args.prefill, args.decode)
    if args.server == "raw":
        uvloop.run(_serve_raw(app, args.port))
        return 0
    # The router's uvicorn settings (pdrouter.router.serve): the same stack, the same options.
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False,
                proxy_headers=False, server_header=False)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
