"""aiohttp as the router's upstream client: `--upstream-client aiohttp`, and https:// workers.

It keeps the contract of pdrouter.router.upstream.contract: aiohttp's exceptions are mapped to
the same httpx types the h1 client raises (_mapped_errors), and a response released before its
end closes its connection. aiohttp has no write timeout; the request bodies are small JSON
documents written to a socket that accepted them, so the connect and read bounds bound the
whole call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import httpx

from pdrouter.router.upstream.contract import (
    KEEPALIVE_S,
    BufferedAnswer,
    HopTimeout,
    UpstreamResponse,
)


def _aiohttp() -> Any:
    try:
        import aiohttp
    except ImportError:
        raise RuntimeError(
            "--upstream-client aiohttp (and https:// worker URLs) need the aiohttp package: "
            ".venv/bin/pip install aiohttp"
        ) from None
    return aiohttp


def _is_read_timeout(aiohttp: Any, exc: BaseException) -> bool:
    socket_timeout = getattr(aiohttp, "SocketTimeoutError", None)
    return socket_timeout is not None and isinstance(exc, socket_timeout)


@contextlib.contextmanager
def _mapped_errors(aiohttp: Any, connecting: bool) -> Iterator[None]:
    try:
        yield
    except aiohttp.ClientConnectorError as exc:  # refused, unreachable, DNS
        raise httpx.ConnectError(str(exc)) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        raise httpx.RemoteProtocolError(str(exc) or type(exc).__name__) from exc
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        read = not connecting or _is_read_timeout(aiohttp, exc)
        cls = httpx.ReadTimeout if read else httpx.ConnectTimeout
        raise cls(str(exc) or type(exc).__name__) from exc
    except aiohttp.ClientOSError as exc:
        raise httpx.ReadError(str(exc)) from exc
    except aiohttp.ClientError as exc:
        raise httpx.TransportError(f"{type(exc).__name__}: {exc}") from exc


# Built once per distinct value, not per call: instance URLs x paths and hop bounds are few.
@functools.lru_cache(maxsize=4096)
def _parsed_url(url: str) -> Any:
    import yarl

    return yarl.URL(url)


@functools.lru_cache(maxsize=64)
def _client_timeout(t: HopTimeout) -> Any:
    return _aiohttp().ClientTimeout(
        total=None, connect=t.connect_s, sock_connect=t.connect_s, sock_read=t.read_s
    )


class _AiohttpResponse(BufferedAnswer):
    def __init__(self, aiohttp: Any, response: Any) -> None:
        self._aiohttp = aiohttp
        self._response = response
        self.status_code: int = response.status
        self.headers: Mapping[str, str] = response.headers

    async def read(self) -> bytes:
        if self._content is None:
            with _mapped_errors(self._aiohttp, connecting=False):
                self._content = await self._response.read()
        return self._content

    @property
    def body_complete(self) -> bool:
        return bool(self._response.content.at_eof())

    async def chunks(self) -> AsyncIterator[bytes]:
        with _mapped_errors(self._aiohttp, connecting=False):
            async for chunk in self._response.content.iter_any():
                yield chunk


class AiohttpUpstream:
    """aiohttp's connection pool, one ClientSession created on first use (inside the
    router's event loop): no cookies, no decompression (a relay passes bytes through)."""

    name = "aiohttp"

    def __init__(self, max_connections: int, headers: Mapping[str, str]) -> None:
        self.max_connections = max_connections
        self.headers = dict(headers)
        self._session: Any = None

    def _get_session(self) -> Any:
        if self._session is None:
            aiohttp = _aiohttp()
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, keepalive_timeout=KEEPALIVE_S
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self.headers,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
            )
        return self._session

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str],
        timeout: HopTimeout,
    ) -> AsyncIterator[UpstreamResponse]:
        aiohttp = _aiohttp()
        session = self._get_session()
        with _mapped_errors(aiohttp, connecting=True):
            response = await session.request(
                method,
                _parsed_url(url),
                data=content,
                headers=headers,
                allow_redirects=False,
                timeout=_client_timeout(timeout),
            )
        try:
            yield _AiohttpResponse(aiohttp, response)
        finally:
            # Back to the pool when the body was read to its end; closed otherwise.
            response.release()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
