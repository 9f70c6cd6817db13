"""The aiohttp transport under httpx: answers, connection reuse, and each failure mapped onto
the httpx exception the orchestrator's failure policy expects. The servers are real loopback
sockets scripted byte by byte, because the failures (a hang, a cut body) are what is tested."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from pdrouter.proc import find_free_port
from pdrouter.upstream_transport import (
    AiohttpTransport,
    make_upstream_transport,
    resolve_upstream_client,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK_BODY = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhello"


class _Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.num_connections = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            await self.handler(reader, writer)
        finally:
            writer.close()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


async def _started(handler: Handler) -> AsyncIterator[tuple[_Server, str]]:
    server = _Server(handler)
    port = find_free_port()
    listener = await asyncio.start_server(server._serve, "127.0.0.1", port)
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        listener.close()


def _client(**kw: float) -> httpx.AsyncClient:
    timeout = httpx.Timeout(connect=1.0, read=kw.get("read", 2.0), write=1.0, pool=1.0)
    return httpx.AsyncClient(transport=AiohttpTransport(8), timeout=timeout)


async def test_answers_and_reuses_one_connection() -> None:
    async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(3):
            request = await _read_request(reader)
            assert request.startswith(b"POST /x HTTP/1.1\r\n")
            assert b'{"a":1}' in request
            writer.write(OK_BODY)

    async for server, url in _started(keep_alive):
        async with _client() as client:
            for _ in range(3):
                resp = await client.post(url + "/x", content=b'{"a":1}')
                assert (resp.status_code, resp.text) == (200, "hello")
        assert server.num_connections == 1


async def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    async def one_then_idle_close(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        w.write(OK_BODY)
        await w.drain()
        await asyncio.sleep(0.1)  # then close while the router holds it idle in its pool

    async for server, url in _started(one_then_idle_close):
        async with _client() as client:
            assert (await client.get(url + "/a")).status_code == 200
            await asyncio.sleep(0.4)
            assert (await client.get(url + "/b")).status_code == 200
        assert server.num_connections == 2


async def test_refused_connection_is_connect_error() -> None:
    async with _client() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{find_free_port()}/health")


async def test_silent_server_is_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    async for _, url in _started(silent):
        async with _client(read=0.3) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.get(url + "/slow")


async def test_close_before_answer_is_remote_protocol_error() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)

    async for _, url in _started(hang_up):
        async with _client() as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(url + "/x")


async def test_body_cut_mid_stream_is_remote_protocol_error_after_the_bytes_sent() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nw0 w1\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)

    async for _, url in _started(cut):
        async with _client() as client:
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("GET", url + "/stream") as resp:
                    async for chunk in resp.aiter_bytes():
                        received += chunk
            assert received == b"w0 w1"


async def test_leaving_a_stream_early_closes_its_connection() -> None:
    saw_eof = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nw0 \r\n")
        await writer.drain()
        if await reader.read(1) == b"":  # the router gave up: this is a worker's abort signal
            saw_eof.set()

    async for _, url in _started(endless):
        async with _client() as client:
            async with client.stream("GET", url + "/stream") as resp:
                assert await resp.aiter_bytes().__anext__() == b"w0 "
            await asyncio.wait_for(saw_eof.wait(), 2.0)


def test_choice_of_client() -> None:
    assert resolve_upstream_client("auto") == "aiohttp"  # installed in this environment
    assert resolve_upstream_client("httpx") == "httpx"
    assert make_upstream_transport("httpx", 8) is None
    assert isinstance(make_upstream_transport("aiohttp", 8), AiohttpTransport)
    with pytest.raises(ValueError, match="'curl' is not one of"):
        resolve_upstream_client("curl")
