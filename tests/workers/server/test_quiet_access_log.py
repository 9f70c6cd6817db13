"""A worker's log at INFO has an access line per request but none for /health (the
checks of the router, twice a second, buried the request lines)."""

from __future__ import annotations

import httpx
import pytest

from tests.wait import wait_until
from tests.workers.server.conftest import WorkerHandle


def test_health_checks_leave_no_access_line(worker: WorkerHandle) -> None:
    if worker.proc is None:
        pytest.skip("an external worker: its log is not ours to read")
    for _ in range(3):
        assert httpx.get(f"{worker.base_url}/health", timeout=10).status_code == 200
    resp = httpx.get(f"{worker.base_url}/v1/models", timeout=10)
    assert resp.status_code == 200
    log = wait_until(lambda: worker.proc.log_tail(1_000_000), 10, "the /v1/models access line",
                     done=lambda text: '"GET /v1/models HTTP/1.1" 200' in text)  # fmt: skip
    assert "/health" not in log
