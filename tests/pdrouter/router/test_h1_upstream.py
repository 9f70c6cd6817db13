"""What only our own HTTP/1.1 client (pdrouter.router.upstream.h1) has to get right itself: body
framings, keep-alive rules, its connection limit, back-pressure, the read bound's meaning,
cancellation and malformed answers. The contract it shares with the other clients is tested
in test_upstream.py. Servers are real loopback sockets scripted byte by byte."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from pdrouter.common.proc import find_free_port
from pdrouter.router.upstream import h1 as h1_upstream
from pdrouter.router.upstream import h1_connection
from pdrouter.router.upstream.contract import HopTimeout
from pdrouter.router.upstream.h1 import H1Upstream
from tests.pdrouter.router.scripted_http import read_request
from tests.wait import async_wait_until

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@contextlib.asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[tuple[list[int], str]]:
    """A scripted server; yields ([connections accepted], base URL)."""
    accepted = [0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client hung up: what some tests do on purpose
        finally:
            writer.close()

    port = find_free_port()
    listener = await asyncio.start_server(serve, "127.0.0.1", port)
    try:
        yield accepted, f"http://127.0.0.1:{port}"
    finally:
        listener.close()


@pytest.fixture
async def client() -> AsyncIterator[H1Upstream]:
    upstream = H1Upstream(8, {"X-Router": "r1"})
    try:
        yield upstream
    finally:
        await upstream.aclose()


def _bounds(read_s: float = 2.0, connect_s: float = 1.0) -> HopTimeout:
    return HopTimeout(connect_s=connect_s, read_s=read_s)


async def _get(client: H1Upstream, url: str, read_s: float = 2.0) -> tuple[int, bytes]:
    async with client.request("POST", url, b"{}", {}, _bounds(read_s)) as resp:
        return resp.status_code, await resp.read()


async def _answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       answer: bytes, times: int = 10) -> None:  # fmt: skip
    for _ in range(times):
        await read_request(reader)
        writer.write(answer)
        await writer.drain()


async def test_request_bytes_on_the_wire(client: H1Upstream) -> None:
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(OK)

    async with (
        _server(record) as (_, url),
        client.request(
            "POST", url + "/internal/prefill?x=1", b'{"a":1}', {"X-Request-Id": "r-7"}, _bounds()
        ) as resp,  # fmt: skip
    ):
        assert await resp.read() == b"ok"
    port = url.rsplit(":", 1)[1]
    assert seen == [
        b"POST /internal/prefill?x=1 HTTP/1.1\r\nhost: 127.0.0.1:" + port.encode()
        + b"\r\nX-Router: r1\r\nX-Request-Id: r-7\r\ncontent-length: 7\r\n\r\n"
        + b'{"a":1}'
    ]  # fmt: skip


async def test_chunked_body_split_over_many_reads_arrives_whole(client: H1Upstream) -> None:
    events = [b"data: %d\n\n" % k for k in range(200)]

    async def dribble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        wire = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
        for i in range(0, len(wire), 7):  # cut across chunk sizes, data and CRLFs
            writer.write(wire[i : i + 7])
            await writer.drain()
            if i % 700 == 0:
                await asyncio.sleep(0.001)
        await _answer_each(reader, writer, OK, 1)

    async with _server(dribble) as (accepted, url):
        received = b""
        async with client.request("POST", url + "/s", b"{}", {}, _bounds()) as resp:
            async for piece in resp.chunks():
                received += piece
        assert received == b"".join(events)
        assert await _get(client, url + "/again") == (200, b"ok")  # the connection was reused
        assert accepted[0] == 1


async def test_body_to_the_end_of_the_connection_is_whole_and_not_reused(
    client: H1Upstream,
) -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")

    async with _server(until_close) as (accepted, url):
        assert await _get(client, url + "/a") == (200, b"all of it")
        assert await _get(client, url + "/b") == (200, b"all of it")
        assert accepted[0] == 2
        assert (client.num_open, client.num_idle()) == (0, 0)


async def test_connection_close_answer_is_not_reused(client: H1Upstream) -> None:
    answer = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_each(reader, writer, answer, 1)

    async with _server(once) as (accepted, url):
        for _ in range(3):
            assert await _get(client, url + "/x") == (200, b"ok")
        assert accepted[0] == 3
        assert client.num_idle() == 0


async def test_idle_connections_expire_before_the_workers_keep_alive(
    client: H1Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(h1_upstream, "KEEPALIVE_S", 0.2)

    async def keep(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_each(reader, writer, OK)

    async with _server(keep) as (accepted, url):
        assert await _get(client, url + "/a") == (200, b"ok")
        assert await _get(client, url + "/b") == (200, b"ok")
        assert accepted[0] == 1
        await asyncio.sleep(0.3)  # idle longer than KEEPALIVE_S: the time is what is tested
        assert await _get(client, url + "/c") == (200, b"ok")
        assert accepted[0] == 2
        assert (client.num_open, client.num_idle()) == (1, 1)


async def test_the_connection_limit_bounds_the_wait_with_pool_timeout() -> None:
    client = H1Upstream(1, {})
    release = asyncio.Event()

    async def slow_then_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if b"POST /s " not in await read_request(reader):
            writer.write(OK)
            await reader.read(1)  # open until the client closes it
            return
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"0\r\n\r\n")
        await _answer_each(reader, writer, OK)

    try:
        async with _server(slow_then_ok) as (accepted, url):
            async with client.request("POST", url + "/s", b"{}", {}, _bounds()) as held:
                assert await held.chunks().__anext__() == b"a"
                with pytest.raises(httpx.PoolTimeout):
                    async with client.request("POST", url + "/t", b"{}", {}, _bounds(2, 0.2)):
                        pass
                # a waiter takes over the slot the moment the held call ends
                waiting = asyncio.ensure_future(_get(client, url + "/u"))
                await asyncio.sleep(0.05)
                assert not waiting.done()
                release.set()
                assert await held.read() == b""
            assert await asyncio.wait_for(waiting, 2) == (200, b"ok")
            assert client.num_open == 1
            assert accepted[0] == 2  # the held connection gave its slot up rather than idling
    finally:
        await client.aclose()


async def test_a_slow_reader_pauses_the_socket_and_loses_nothing(client: H1Upstream) -> None:
    piece = bytes(range(256)) * 256  # 64 KiB
    num_pieces = 1024  # 64 MiB: more than the kernel's socket buffers hold on both sides
    sent = [0]

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(piece) * num_pieces))
        for _ in range(num_pieces):
            writer.write(piece)
            await writer.drain()
            sent[0] += 1

    async with _server(flood) as (_, url):
        received = bytearray()
        async with client.request("POST", url + "/big", b"{}", {}, _bounds()) as resp:
            chunks = resp.chunks()
            received += await chunks.__anext__()
            await asyncio.sleep(0.3)  # the reader is busy: the server must stall, not we buffer
            buffered = resp._conn.num_buffered_bytes  # type: ignore[attr-defined]
            assert buffered <= h1_connection._PAUSE_BYTES + 512 * 1024
            assert sent[0] < num_pieces
            async for data in chunks:
                received += data
        assert received == piece * num_pieces


async def test_the_read_bound_counts_only_time_spent_waiting(client: H1Upstream) -> None:
    async def pause_between(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)
        writer.write(b"1\r\nb\r\n0\r\n\r\n")

    async with (
        _server(pause_between) as (_, url),
        client.request("POST", url + "/s", b"{}", {}, _bounds(read_s=0.3)) as resp,
    ):
        chunks = resp.chunks()
        assert await chunks.__anext__() == b"a"
        await asyncio.sleep(0.4)  # busy elsewhere, longer than the bound, then wait again
        assert [piece async for piece in chunks] == [b"b"]


async def test_cancelling_a_waiting_call_closes_its_connection(client: H1Upstream) -> None:
    saw_eof = asyncio.Event()

    got_request = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        got_request.set()
        if await reader.read(1) == b"":
            saw_eof.set()

    async with _server(silent) as (_, url):
        call = asyncio.ensure_future(_get(client, url + "/x"))
        await asyncio.wait_for(got_request.wait(), 5)  # the call now waits for its answer
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(saw_eof.wait(), 2)
        assert (client.num_open, client.num_idle()) == (0, 0)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 2xx Nonsense\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nok\r\n",
    ],
)
async def test_malformed_answers_are_remote_protocol_errors(
    client: H1Upstream, answer: bytes
) -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await asyncio.sleep(1)

    async with _server(broken) as (_, url):
        with pytest.raises(httpx.RemoteProtocolError, match="malformed"):
            await _get(client, url + "/x")
        assert client.num_open == 0


async def test_a_second_answer_to_one_request_is_refused(client: H1Upstream) -> None:
    async def twice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK + OK)
        await asyncio.sleep(1)

    async with _server(twice) as (accepted, url):
        assert await _get(client, url + "/x") == (200, b"ok")
        assert await _get(client, url + "/y") == (200, b"ok")
        assert accepted[0] == 2  # the first connection was not trusted again


async def test_line_breaks_in_headers_are_refused_before_sending(client: H1Upstream) -> None:
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_each(reader, writer, OK)

    async with _server(never) as (accepted, url):
        with pytest.raises(httpx.LocalProtocolError, match="line break"):
            async with client.request("POST", url, b"", {"X-Id": "a\r\nx: y"}, _bounds()):
                pass
        assert accepted[0] == 0
    with pytest.raises(httpx.LocalProtocolError):
        H1Upstream(8, {"X-Secret": "s\n"})


async def test_https_urls_go_through_the_tls_client(client: H1Upstream) -> None:
    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)

    async with _server(plain) as (_, url):
        with pytest.raises(httpx.TransportError):  # a TLS handshake with a plain server
            await _get(client, url.replace("http:", "https:") + "/x")
        assert client._tls is not None and client._tls.name == "aiohttp"
        assert client.num_open == 0


async def test_aclose_closes_idle_connections(client: H1Upstream) -> None:
    saw_eof = asyncio.Event()

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_each(reader, writer, OK, 1)
        if await reader.read(1) == b"":
            saw_eof.set()

    async with _server(one) as (_, url):
        assert await _get(client, url + "/x") == (200, b"ok")
        assert client.num_idle() == 1
        await client.aclose()
        await asyncio.wait_for(saw_eof.wait(), 2)
        assert (client.num_open, client.num_idle()) == (0, 0)


async def test_a_large_answer_read_whole_leaves_its_connection_usable(client: H1Upstream) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB: past the pause threshold within one answer

    async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_each(reader, writer, b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                           % (len(big), big), 3)  # fmt: skip

    async with _server(large) as (accepted, url):
        for _ in range(3):
            assert await _get(client, url + "/big", read_s=1.0) == (200, big)
        assert accepted[0] == 1


async def test_an_upgrade_answer_is_a_remote_protocol_error(client: H1Upstream) -> None:
    async def upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
                     b"connection: upgrade\r\n\r\n")  # fmt: skip
        await asyncio.sleep(1)

    async with _server(upgrade) as (_, url):
        with pytest.raises(httpx.RemoteProtocolError, match=r"upgrade answer \(HTTP 101\)"):
            await _get(client, url + "/x")
        assert client.num_open == 0


async def test_an_interim_answer_is_refused_and_its_connection_not_reused(
    client: H1Upstream,
) -> None:
    async def interim_then_late(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if b"POST /a " not in await read_request(reader):
            w.write(OK)
            return
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.1)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nthe first!")
        await _answer_each(reader, w, OK)

    async with _server(interim_then_late) as (accepted, url):
        with pytest.raises(httpx.RemoteProtocolError, match=r"interim .*\(HTTP 100\)"):
            await _get(client, url + "/a")
        assert await _get(client, url + "/b") == (200, b"ok")  # its own answer, not the late one
        assert accepted[0] == 2


async def test_a_reset_cuts_a_body_that_ends_with_the_connection_into_read_error(
    client: H1Upstream,
) -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npart-of-the-bo")
        await writer.drain()
        await asyncio.sleep(0.1)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not FIN: the body did not end, it broke

    async with _server(reset) as (_, url):
        with pytest.raises(httpx.ReadError):
            await _get(client, url + "/x")


async def test_a_connection_closing_in_this_loop_turn_is_not_reused(client: H1Upstream) -> None:
    async def keep(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_each(reader, writer, OK)

    async with _server(keep) as (accepted, url):
        assert await _get(client, url + "/a") == (200, b"ok")
        (idle,) = next(iter(client._idle.values()))
        # What asyncio does on the worker's FIN, one loop turn before connection_lost runs:
        idle.transport.close()
        assert await _get(client, url + "/b") == (200, b"ok")
        assert accepted[0] == 2


async def test_headers_stay_with_their_answer_after_the_connection_moves_on(
    client: H1Upstream,
) -> None:
    first = b"HTTP/1.1 503 Busy\r\nretry-after: 7\r\ncontent-length: 4\r\n\r\nbusy"
    second = b"HTTP/1.1 200 OK\r\nx-other: second\r\ncontent-length: 2\r\n\r\nok"

    async def two(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_each(reader, writer, first, 1)
        await _answer_each(reader, writer, second, 1)

    async with _server(two) as (accepted, url):
        async with client.request("POST", url + "/a", b"{}", {}, _bounds()) as r1:
            await r1.read()
        assert await _get(client, url + "/b") == (200, b"ok")
        assert accepted[0] == 1
        assert dict(r1.headers) == {"retry-after": "7", "content-length": "4"}


async def test_aclose_with_a_call_in_flight_closes_it_when_the_call_ends() -> None:
    client = H1Upstream(1, {})
    saw_eof = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")
        if await reader.read(1) == b"":
            saw_eof.set()

    async with _server(stream) as (_, url):
        async with client.request("POST", url + "/s", b"{}", {}, _bounds()) as resp:
            await client.aclose()
            assert await resp.read() == b"a"
        await asyncio.wait_for(saw_eof.wait(), 2)
        assert (client.num_open, client.num_idle()) == (0, 0)


_CHAOS = ("ok", "ok", "ok", "close", "reset", "slow", "stream", "idle_junk", "fin_later", "hang")


async def _chaotic(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rnd: Any) -> None:
    """Answers each request in one of _CHAOS's ways, the worst ones included."""
    while True:
        await read_request(reader)
        way = rnd.choice(_CHAOS)
        if way in ("ok", "idle_junk", "fin_later"):
            writer.write(OK)
            await writer.drain()
            if way != "ok":
                await asyncio.sleep(rnd.random() * 0.02)
                if way == "fin_later":
                    return
                writer.write(b"junk")  # bytes on an idle connection
        elif way == "close":
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
            return
        elif way == "reset":
            await asyncio.sleep(rnd.random() * 0.01)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        elif way == "slow":
            await asyncio.sleep(rnd.random() * 0.05)
            writer.write(OK)
        elif way == "stream":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(rnd.randint(1, 5)):
                writer.write(b"5\r\nhello\r\n")
                await writer.drain()
                await asyncio.sleep(rnd.random() * 0.01)
            writer.write(b"0\r\n\r\n")
        else:  # hang
            await asyncio.sleep(0.3)
            return
        await writer.drain()


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_slot_count_matches_open_sockets_after_random_failures_and_cancellations(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 calls over two chaotic servers and one refusing port, with random bounds, ways of
    reading and cancellations: every failure is an httpx error, and once all is quiet the
    client's count of open connections is exactly its idle ones and the sockets really open."""
    rnd = random.Random(seed)
    monkeypatch.setattr(h1_upstream, "KEEPALIVE_S", 0.05)
    live: set[Any] = set()
    made, lost = (
        h1_connection.H1Connection.connection_made,
        h1_connection.H1Connection.connection_lost,
    )

    def tracked_made(conn: Any, transport: Any) -> None:
        live.add(conn)
        made(conn, transport)

    def tracked_lost(conn: Any, exc: Exception | None) -> None:
        live.discard(conn)
        lost(conn, exc)

    monkeypatch.setattr(h1_connection.H1Connection, "connection_made", tracked_made)
    monkeypatch.setattr(h1_connection.H1Connection, "connection_lost", tracked_lost)
    client = H1Upstream(3, {})
    outcomes: dict[str, int] = {}

    async def call(url: str) -> None:
        bounds = _bounds(rnd.choice([0.02, 0.1, 1.0]), rnd.choice([0.01, 0.05, 0.5]))
        how = rnd.choice(["read", "chunks", "leave", "partial"])
        async with client.request("POST", url + "/x", b"{}", {}, bounds) as resp:
            if how == "read":
                await resp.read()
            elif how in ("chunks", "partial"):
                async for _ in resp.chunks():
                    if how == "partial":
                        break

    async def one(urls: list[str]) -> None:
        await asyncio.sleep(rnd.random() * 0.5)
        task = asyncio.ensure_future(call(rnd.choice(urls)))
        if rnd.random() < 0.3:
            await asyncio.sleep(rnd.random() * 0.05)
            task.cancel()
        try:
            await task
            name = "ok"
        except asyncio.CancelledError:
            name = "cancelled"
        except httpx.TransportError as exc:
            name = type(exc).__name__
        outcomes[name] = outcomes.get(name, 0) + 1

    try:
        async with (
            _server(lambda r, w: _chaotic(r, w, random.Random(rnd.random()))) as (_, url1),
            _server(lambda r, w: _chaotic(r, w, random.Random(rnd.random()))) as (_, url2),
        ):
            urls = [url1, url2, f"http://127.0.0.1:{find_free_port()}"]
            await asyncio.gather(*(one(urls) for _ in range(300)))
            # Closes and connection_lost calls still land after the calls ended (a "hang"
            # answer closes 0.3 s later): wait until the counts agree for 10 samples in a row.
            samples: list[tuple[int, int, int]] = []

            def settled() -> bool:
                really_open = sum(1 for conn in live if not conn.transport.is_closing())
                samples.append((client.num_open, client.num_idle(), really_open))
                last = samples[-10:]
                return len(last) == 10 and len(set(last)) == 1

            await async_wait_until(settled, 5, "the connection counts to settle", interval_s=0.05)
            num_open, num_idle, really_open = samples[-1]
            assert num_open == num_idle == really_open, (samples[-1], outcomes)
            assert not client._slot_waiters
            assert sum(outcomes.values()) == 300 and outcomes.get("ok", 0) > 0, outcomes
    finally:
        await client.aclose()


async def test_an_endless_head_fails_the_call_within_its_bound(client: H1Upstream) -> None:
    """A worker that streams one header forever: refused once the head passes
    MAX_HEAD_BYTES, not buffered without bound; the connection is closed."""
    sent = [0]

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx-pad: ")
        with contextlib.suppress(ConnectionError):
            while sent[0] < 64 * h1_connection.MAX_HEAD_BYTES:
                writer.write(b"a" * 4096)
                sent[0] += 4096
                await writer.drain()

    async with _server(endless) as (_, url):
        with pytest.raises(httpx.RemoteProtocolError, match="head is longer than 65536 bytes"):
            await _get(client, url + "/x")
        assert (client.num_open, client.num_idle()) == (0, 0)
    assert sent[0] < 64 * h1_connection.MAX_HEAD_BYTES  # it stopped reading: the worker did too


async def test_too_many_headers_fail_the_call_and_the_client_keeps_serving(
    client: H1Upstream,
) -> None:
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(h1_connection.MAX_HEADERS + 1))

    async def crowded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if b"/bad" in await read_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\n" + many + b"content-length: 2\r\n\r\nok")
            await writer.drain()
            await asyncio.Event().wait()  # keeps the connection open: the client must close it
        writer.write(OK)
        await _answer_each(reader, writer, OK)

    async with _server(crowded) as (accepted, url):
        with pytest.raises(httpx.RemoteProtocolError, match="more than 100 headers"):
            await _get(client, url + "/bad")
        assert (client.num_open, client.num_idle()) == (0, 0)
        assert await _get(client, url + "/good") == (200, b"ok")
        assert accepted[0] == 2


async def test_a_head_at_the_bound_is_accepted(client: H1Upstream) -> None:
    """Exactly MAX_HEADERS headers and a head of at most MAX_HEAD_BYTES: a normal answer."""
    names = [b"x-h%d" % i for i in range(h1_connection.MAX_HEADERS - 1)]
    lines = [name + b": v\r\n" for name in names]
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(lines) + b"content-length: 2\r\n\r\n"
    pad = h1_connection.MAX_HEAD_BYTES - len(head)
    lines[0] = names[0] + b": " + b"v" * (pad + 1) + b"\r\n"
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(lines) + b"content-length: 2\r\n\r\n"
    assert len(head) == h1_connection.MAX_HEAD_BYTES

    async def full(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head + b"ok")

    async with _server(full) as (_, url):
        assert await _get(client, url + "/x") == (200, b"ok")
