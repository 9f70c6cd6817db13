"""`--upstream-client`: which client the router's data path uses (h1 unless told otherwise).

httpx's own client was a third choice until it measured 12x the default's CPU per call
(docs/benchmarks/upstream.md) with no use the other two do not cover: it is gone.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdrouter.router.upstream.aiohttp_client import AiohttpUpstream
from pdrouter.router.upstream.contract import Upstream
from pdrouter.router.upstream.h1 import H1Upstream

UPSTREAM_CLIENTS = ("auto", "h1", "aiohttp")


def resolve_upstream_client(name: str) -> str:
    """'auto' -> 'h1' (httptools is a dependency of pdrouter), else the name as given."""
    if name not in UPSTREAM_CLIENTS:
        raise ValueError(f"upstream client {name!r} is not one of {UPSTREAM_CLIENTS}")
    return "h1" if name == "auto" else name


def make_upstream(name: str, max_connections: int, headers: Mapping[str, str]) -> Upstream:
    """The data-path client for `--upstream-client name`; headers go with every call."""
    if resolve_upstream_client(name) == "h1":
        return H1Upstream(max_connections, headers)
    return AiohttpUpstream(max_connections, headers)
