"""A uvicorn server on a thread, behind the project's guarded HTTP protocol (request heads and
bodies bounded: pdrouter.common.http_guard), for the tests of that protocol over raw sockets."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from pdrouter.common.http_guard import HeadLimits, guarded_protocol
from pdrouter.common.proc import find_free_port
from tests.wait import wait_until


@contextlib.contextmanager
def guarded_server(
    app: Any, limits: HeadLimits
) -> Iterator[tuple[tuple[str, int], uvicorn.Server]]:
    """(address, server) of app served on a free loopback port until the block ends."""
    port = find_free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            http=guarded_protocol(limits), lifespan="off")  # fmt: skip
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: srv.started or not thread.is_alive(), 30, "uvicorn to start")
        assert srv.started
        yield ("127.0.0.1", port), srv
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
