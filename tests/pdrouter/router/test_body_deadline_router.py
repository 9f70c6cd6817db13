"""A real `pdrouter serve` process with an API key lets go of connections whose body never
comes: refused ones (401 without a key) at once, read ones at the body deadline (408).

Before, a POST without a key and with a large Content-Length got its 401, but the socket stayed
open for good once the client sent one body byte (2,000 such sockets: 2,000 descriptors held
with no traffic), and a keyed body that stopped coming had no deadline at all."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http
from tests.repo import REPO_ROOT
from tests.socket_flood import (
    ensure_fd_limit,
    expect_all_408_and_closed,
    open_fds,
    open_with_partial_bodies,
    post_head,
)
from tests.socket_read import read_to_close
from tests.wait import wait_until

API_KEY = "body-deadline-key"
BODY_TIMEOUT_S = 3.0
NUM_SOCKETS = 2000
# Slack on the deadline for a loaded machine (the test's own work counts too).
SLACK_S = 10.0


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[tuple[str, int], int]]:
    ensure_fd_limit(2 * NUM_SOCKETS + 512)  # the test's sockets, and the router's (inherited)
    port = find_free_port()
    log_dir: Path = tmp_path_factory.mktemp("router-logs")
    argv = [sys.executable, "-m", "pdrouter.cli", "serve", "--port", str(port),
            "--api-key", API_KEY, "--body-timeout-s", str(BODY_TIMEOUT_S)]  # fmt: skip
    proc = ManagedProcess("router", argv, log_path=log_dir / "router.log", cwd=str(REPO_ROOT))
    try:
        # No instances: /health says 503 (degraded), which is all the test needs.
        wait_for_http(f"http://127.0.0.1:{port}/health", 60, proc, expect_status=503)
        yield ("127.0.0.1", port), proc.pid
    finally:
        proc.stop()


def test_unauthenticated_sockets_with_one_body_byte_are_all_closed_within_the_deadline(
    router: tuple[tuple[str, int], int],
) -> None:
    address, pid = router
    baseline = open_fds(pid)
    head = post_head("t", "/v1/completions", 10_000_000, {})
    began_s = time.monotonic()
    socks = open_with_partial_bodies(address, head + b"{", NUM_SOCKETS)
    try:
        wait_until(lambda: open_fds(pid), BODY_TIMEOUT_S + SLACK_S,
                   f"the router to close {NUM_SOCKETS} refused connections",
                   done=lambda n: n <= baseline)  # fmt: skip
        closed_after_s = time.monotonic() - began_s
        for sock in socks:
            answer = read_to_close(sock)
            assert answer.startswith(b"HTTP/1.1 401 Unauthorized\r\n"), answer[:200]
            assert b"connection: close" in answer
            assert b"invalid_api_key" in answer
    finally:
        for sock in socks:
            sock.close()
    assert closed_after_s < BODY_TIMEOUT_S + SLACK_S


def test_a_keyed_body_that_stops_coming_is_408_and_closed(
    router: tuple[tuple[str, int], int],
) -> None:
    address, pid = router
    baseline = open_fds(pid)
    head = post_head("t", "/v1/completions", 190_000, {"Authorization": f"Bearer {API_KEY}"})
    socks = open_with_partial_bodies(address, head + b'{"model": "tiny", "prompt": "', 50)
    expect_all_408_and_closed(socks, pid, baseline, BODY_TIMEOUT_S + SLACK_S, SLACK_S, "the router")
