"""--max-pending-requests is one bound for the whole worker: a call held open on
/internal/prefill fills a prefill worker bounded at 1, so the next internal call and a client's
/v1 request both get 503 + Retry-After with the OpenAI error body, while /health still answers;
once the held call ends, calls are served again. A real cluster (`pdrouter launch`'s Cluster)
over real HTTP; the held call is a request whose body never finishes arriving."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from pdrouter.common.auth import INTERNAL_SECRET_HEADER
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.cluster_fixture import QUIET_ENV, started_cluster
from tests.wait import wait_until

FULL = {
    "error": {
        "message": "server is full (1 requests in flight, --max-pending-requests 1); retry later",
        "type": "service_unavailable",
        "param": None,
        "code": "overloaded",
    }
}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path) -> Iterator[Cluster]:
    spec = ClusterSpec(
        pool_size="64MiB",
        worker_args=(
            "--max-pending-requests",
            "1",
            "--num-kv-blocks",
            "64",
            "--staging-slots",
            "16",
            "--transfer-batch-blocks",
            "8",
            "--model-cache-dir",
            str(tiny_cache_dir),
        ),
        env=QUIET_ENV,
        log_dir=str(tmp_path_factory.mktemp("in-flight-logs")),
        startup_timeout_s=240.0,
    )
    yield from started_cluster(spec)


def _hold(url: str, secret: str) -> socket.socket:
    """A POST /internal/prefill whose body never completes: in flight until closed."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sock.sendall(
        f"POST /internal/prefill HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"{INTERNAL_SECRET_HEADER}: {secret}\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n{".encode()
    )
    return sock


def test_internal_and_client_calls_share_one_bound(cluster: Cluster) -> None:
    p_url = cluster.prefill_urls[0]
    secret = {INTERNAL_SECRET_HEADER: cluster.internal_secret}
    with httpx.Client(base_url=p_url, timeout=10) as client:

        def prefill_status() -> httpx.Response:
            # Not a valid prefill request: admitted, it is a quick 400 and no work.
            return client.post("/internal/prefill", json={}, headers=secret)

        assert prefill_status().status_code == 400
        held = _hold(p_url, cluster.internal_secret)
        try:
            refused = wait_until(prefill_status, 30, "P to count the held call",
                                 done=lambda r: r.status_code == 503)  # fmt: skip
            assert refused.json() == FULL
            assert refused.headers["Retry-After"] == "1"
            chat = client.post("/v1/chat/completions", json=CHAT, headers=secret)
            assert (chat.status_code, chat.json(), chat.headers["Retry-After"]) == (503, FULL, "1")
            assert client.get("/health").status_code == 200  # never counted
        finally:
            held.close()
        wait_until(prefill_status, 30, "P to release the held call",
                   done=lambda r: r.status_code == 400)  # fmt: skip
    answer = httpx.post(f"{cluster.router_url}/v1/chat/completions", json=CHAT, timeout=60)
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 2
