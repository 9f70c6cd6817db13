"""The router benchmark's floor: the bare PD relay, with nothing a production router needs.

    python -m pdrouter.bench_bare_relay --prefill URL --decode URL --port 8300

It does exactly the two hops of our router, through the same stack (uvicorn, aiohttp,
json): the client's body to P's /internal/prefill, P's first token to the client, then D's
/internal/decode events relayed as OpenAI completion chunks, one write per network read.
Nothing else: no validation, no request ids, no metrics, no timeline, no instance selection,
breakers, limits, retries, failover, timeouts or disconnect handling. What it adds over a
direct call is what the process hops themselves cost on the machine; what our router adds
over it is the price of those features. It serves only streamed completions and exists for
the benchmark alone (`pdrouter.bench_router`, case `bare`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pdrouter.asgi import Receive, Scope, Send

_SSE = [(b"content-type", b"text/event-stream")]
_JSON = {"content-type": "application/json"}


class BareRelay:
    """The ASGI app: POST /v1/completions (streamed) and GET /health."""

    def __init__(self, prefill_url: str, decode_url: str) -> None:
        self.prefill_url = prefill_url + "/internal/prefill"
        self.decode_url = decode_url + "/internal/decode"
        self.session: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
        else:
            await self._relay(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        import aiohttp

        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _relay(self, receive: Receive, send: Send) -> None:
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw)
        prefill = {"request_id": "bare", "endpoint": "completions", "body": body}
        async with self.session.post(
            self.prefill_url, data=json.dumps(prefill), headers=_JSON
        ) as resp:
            result = json.loads(await resp.read())
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        await send(
            {"type": "http.response.body", "body": _chunk(result["first_text"]), "more_body": True}
        )
        decode = {**prefill, "prompt_token_ids": result["prompt_token_ids"],
                  "output_token_ids": [result["first_token_id"]], "kv": result["kv"]}  # fmt: skip
        buffer = b""
        async with self.session.post(
            self.decode_url, data=json.dumps(decode), headers=_JSON
        ) as resp:
            async for raw_read in resp.content.iter_any():
                *events, buffer = (buffer + raw_read).split(b"\n\n")
                out = b"".join(_chunk(json.loads(event[6:])["text"]) for event in events)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _chunk(text: str) -> bytes:
    payload = {"object": "text_completion", "choices": [{"index": 0, "text": text}]}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m pdrouter.bench_bare_relay")
    parser.add_argument("--prefill", required=True, help="the prefill mock's URL")
    parser.add_argument("--decode", required=True, help="the decode mock's URL")
    parser.add_argument("--port", type=int, required=True, help="port to serve on")
    args = parser.parse_args(argv)
    app = BareRelay(args.prefill, args.decode)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
