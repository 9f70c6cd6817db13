"""The data-path client to the workers, over our h1 client and aiohttp alike: answers,
connection reuse, and each failure mapped onto the httpx exception the orchestrator's
failure policy expects. The servers are real loopback sockets scripted byte by byte, because
the failures (a hang, a cut body) are what is tested."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from pdrouter.common.proc import find_free_port
from pdrouter.router.upstream.aiohttp_client import AiohttpUpstream
from pdrouter.router.upstream.contract import HopTimeout, Upstream
from pdrouter.router.upstream.factory import make_upstream, resolve_upstream_client
from pdrouter.router.upstream.h1 import H1Upstream
from tests.pdrouter.router.scripted_http import read_request
from tests.wait import async_wait_until

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK_BODY = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhello"


class _Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.num_connections = 0
        self.num_closed = 0  # connections this server has closed (its FIN sent)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            await self.handler(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            self.num_closed += 1


async def _started(handler: Handler) -> AsyncIterator[tuple[_Server, str]]:
    server = _Server(handler)
    port = find_free_port()
    listener = await asyncio.start_server(server._serve, "127.0.0.1", port)
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        listener.close()


IMPLEMENTATIONS = {"h1": H1Upstream, "aiohttp": AiohttpUpstream}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
async def upstream(request: pytest.FixtureRequest) -> AsyncIterator[Upstream]:
    client = IMPLEMENTATIONS[request.param](8, {"X-Router": "r1"})
    try:
        yield client
    finally:
        await client.aclose()


def _bounds(read_s: float = 2.0) -> HopTimeout:
    return HopTimeout(connect_s=1.0, read_s=read_s, write_s=1.0)


async def _call(upstream: Upstream, url: str, read_s: float = 2.0) -> tuple[int, bytes]:
    async with upstream.request("POST", url, b'{"a":1}', {}, _bounds(read_s)) as resp:
        return resp.status_code, await resp.read()


async def test_answers_and_reuses_one_connection(upstream: Upstream) -> None:
    async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(3):
            request = await read_request(reader)
            assert request.startswith(b"POST /x HTTP/1.1\r\n")
            assert b'{"a":1}' in request
            assert b"x-router: r1\r\n" in request.lower()  # the client's headers on every call
            writer.write(OK_BODY)

    async for server, url in _started(keep_alive):
        for _ in range(3):
            assert await _call(upstream, url + "/x") == (200, b"hello")
        assert server.num_connections == 1


async def test_a_connection_the_server_closed_while_idle_is_not_reused(upstream: Upstream) -> None:
    async def one_then_idle_close(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(reader)
        w.write(OK_BODY)
        await w.drain()
        await asyncio.sleep(0.1)  # then close while the router holds it idle in its pool

    async for server, url in _started(one_then_idle_close):
        assert (await _call(upstream, url + "/a"))[0] == 200
        closed = lambda s=server: s.num_closed  # noqa: E731
        await async_wait_until(closed, 5, "the server to close the connection")
        assert (await _call(upstream, url + "/b"))[0] == 200
        assert server.num_connections == 2


async def test_refused_connection_is_connect_error(upstream: Upstream) -> None:
    with pytest.raises(httpx.ConnectError):
        await _call(upstream, f"http://127.0.0.1:{find_free_port()}/health")


async def test_silent_server_is_read_timeout(upstream: Upstream) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async for _, url in _started(silent):
        with pytest.raises(httpx.ReadTimeout):
            await _call(upstream, url + "/slow", read_s=0.3)


async def test_close_before_answer_is_remote_protocol_error(upstream: Upstream) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async for _, url in _started(hang_up):
        with pytest.raises(httpx.RemoteProtocolError):
            await _call(upstream, url + "/x")


async def test_body_cut_mid_stream_is_remote_protocol_error_after_the_bytes_sent(
    upstream: Upstream,
) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nw0 w1\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)

    async for _, url in _started(cut):
        received = b""
        with pytest.raises(httpx.RemoteProtocolError):
            async with upstream.request("GET", url + "/stream", None, {}, _bounds()) as resp:
                async for chunk in resp.chunks():
                    received += chunk
        assert received == b"w0 w1"


async def _first_chunk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read the request, answer a chunked 200 and its first chunk ("w0 "): a stream begun."""
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nw0 \r\n")
    await writer.drain()


async def test_body_complete_says_when_the_end_of_the_body_is_in(upstream: Upstream) -> None:
    go_on = asyncio.Event()

    async def two_writes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _first_chunk(reader, writer)
        await go_on.wait()
        writer.write(b"3\r\nw1 \r\n0\r\n\r\n")  # the last event and the end: one write
        await writer.drain()
        await reader.read(1)

    async for _, url in _started(two_writes):
        seen = []
        async with upstream.request("GET", url + "/s", None, {}, _bounds()) as resp:
            async for chunk in resp.chunks():
                seen.append((chunk, resp.body_complete))
                go_on.set()
        assert seen == [(b"w0 ", False), (b"w1 ", True)]


async def test_a_stream_silent_mid_body_is_read_timeout(upstream: Upstream) -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _first_chunk(reader, writer)
        await asyncio.sleep(5)

    async for _, url in _started(stall):
        received = b""
        with pytest.raises(httpx.ReadTimeout):
            async with upstream.request("GET", url + "/s", None, {}, _bounds(0.3)) as resp:
                async for chunk in resp.chunks():
                    received += chunk
        assert received == b"w0 "


async def test_leaving_a_stream_early_closes_its_connection(upstream: Upstream) -> None:
    saw_eof = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _first_chunk(reader, writer)
        if await reader.read(1) == b"":  # the router gave up: this is a worker's abort signal
            saw_eof.set()

    async for _, url in _started(endless):
        async with upstream.request("GET", url + "/stream", None, {}, _bounds()) as resp:
            assert await resp.chunks().__anext__() == b"w0 "
        await asyncio.wait_for(saw_eof.wait(), 2.0)


async def test_error_answers_keep_status_headers_and_body(upstream: Upstream) -> None:
    answer = (b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 3\r\ncontent-length: 4\r\n"
              b"\r\nbusy")  # fmt: skip

    async def busy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)

    async for _, url in _started(busy):
        async with upstream.request("POST", url + "/x", b"{}", {}, _bounds()) as resp:
            await resp.read()
            assert (resp.status_code, resp.content, resp.text) == (503, b"busy", "busy")
            assert resp.headers.get("Retry-After") == "3"  # case-insensitive


async def test_choice_of_client() -> None:
    assert resolve_upstream_client("auto") == "h1"
    assert resolve_upstream_client("aiohttp") == "aiohttp"
    for name, cls in IMPLEMENTATIONS.items():
        client = make_upstream(name, 8, {})
        assert isinstance(client, cls)
        await client.aclose()
    for gone in ("curl", "httpx"):  # httpx's own client was removed: 12x the CPU, no use
        with pytest.raises(ValueError, match=f"'{gone}' is not one of"):
            resolve_upstream_client(gone)
