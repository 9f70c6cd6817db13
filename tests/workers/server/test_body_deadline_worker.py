"""A real keyed worker lets go of connections whose body never comes: refused ones (401
without a key) at once, read ones at the body deadline (408). Before, 200 unauthenticated
sockets that sent one body byte were held for good, and a keyed partial body had no deadline."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.socket_flood import (
    ensure_fd_limit,
    expect_all_408_and_closed,
    open_fds,
    open_with_partial_bodies,
    post_head,
)
from tests.socket_read import read_to_close
from tests.wait import wait_until
from tests.workers.server.conftest import WorkerHandle, start_worker

API_KEY = "worker-body-deadline-key"
BODY_TIMEOUT_S = 3.0
NUM_SOCKETS = 200
SLACK_S = 10.0  # on the deadline, for a loaded machine


@pytest.fixture(scope="module")
def keyed_worker(
    tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path
) -> Iterator[WorkerHandle]:
    ensure_fd_limit(4 * NUM_SOCKETS + 1024)
    handle = start_worker(tmp_path_factory.mktemp("worker-logs"), tiny_cache_dir,
                          "--api-key", API_KEY, "--body-timeout-s", str(BODY_TIMEOUT_S),
                          name="pdworker-body-deadline")  # fmt: skip
    try:
        yield handle
    finally:
        assert handle.proc is not None
        handle.proc.stop()


def _address(worker: WorkerHandle) -> tuple[str, int]:
    host, port = worker.base_url.removeprefix("http://").split(":")
    return host, int(port)


def test_unauthenticated_sockets_with_one_body_byte_are_closed(
    keyed_worker: WorkerHandle,
) -> None:
    assert keyed_worker.proc is not None
    pid = keyed_worker.proc.pid
    baseline = open_fds(pid)
    head = post_head("t", "/v1/completions", 10_000_000, {})
    socks = open_with_partial_bodies(_address(keyed_worker), head + b"{", NUM_SOCKETS)
    try:
        wait_until(lambda: open_fds(pid), BODY_TIMEOUT_S + SLACK_S,
                   f"the worker to close {NUM_SOCKETS} refused connections",
                   done=lambda n: n <= baseline)  # fmt: skip
        for sock in socks:
            answer = read_to_close(sock)
            assert answer.startswith(b"HTTP/1.1 401 Unauthorized\r\n"), answer[:200]
            assert b"connection: close" in answer
    finally:
        for sock in socks:
            sock.close()


def test_a_keyed_body_that_stops_coming_is_408_and_closed(keyed_worker: WorkerHandle) -> None:
    assert keyed_worker.proc is not None
    pid = keyed_worker.proc.pid
    baseline = open_fds(pid)
    head = post_head("t", "/v1/completions", 50_000, {"Authorization": f"Bearer {API_KEY}"})
    socks = open_with_partial_bodies(_address(keyed_worker), head + b'{"prompt": "', 20)
    expect_all_408_and_closed(socks, pid, baseline, BODY_TIMEOUT_S + SLACK_S, SLACK_S, "the worker")
