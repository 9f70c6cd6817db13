"""The pool owner's small HTTP face: /health for launchers and routers, /metrics for Prometheus.

A stdlib ThreadingHTTPServer is enough here: two GET routes, no request bodies, and the owner
process stays free of an event loop. /metrics is our registry followed by the mooncake_client
child's own Prometheus text (transfer counts and latencies), so one scrape sees both.
With an admin key (pdrouter.common.doors.owner_door) every path but /health needs it, and
/health tells a caller without it only whether the pool is up.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from pdrouter.common.doors import OWNER_DETAIL_PATH, owner_door
from workers.pool.owner_process import OwnerProcess

CHILD_TIMEOUT_S = 1.0
HEALTH_PATH, METRICS_PATH = "/health", "/metrics"
OWNER_PATHS = (HEALTH_PATH, METRICS_PATH)  # every route it serves (GET; others answer 405)


def owner_health(owner: OwnerProcess) -> tuple[int, dict[str, object]]:
    """(HTTP status, body): 200 only while the child runs and answers its own /health."""
    body: dict[str, object] = {
        "owner_addr": owner.owner_addr,
        "size_bytes": owner.config.size_bytes,
        "master": owner.config.master_addr,
        "metadata": owner.config.metadata_url,
    }
    if not owner.alive():
        return 503, {"status": "down", "detail": "mooncake_client exited", **body}
    try:
        resp = httpx.get(owner.child_health_url, timeout=CHILD_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return 503, {"status": "down", "detail": f"mooncake_client /health: {exc}", **body}
    if resp.status_code != 200:
        return 503, {
            "status": "down",
            "detail": f"mooncake_client /health {resp.status_code}",
            **body,
        }
    return 200, {"status": "ok", **body}


def serve_owner_http(
    owner: OwnerProcess, port: int, admin_key: str | None = None
) -> ThreadingHTTPServer:
    """Start the server on a daemon thread at owner.config.host:port; return it (shutdown())."""
    door = owner_door(admin_key)
    registry = CollectorRegistry()
    size_gauge = Gauge(
        "pdpool_owner_size_bytes", "Pool memory this owner mounts", registry=registry
    )
    up_gauge = Gauge(
        "pdpool_owner_up", "1 while mooncake_client runs and answers", registry=registry
    )
    size_gauge.set(owner.config.size_bytes)

    class Handler(BaseHTTPRequestHandler):
        def _admitted(self) -> bool:
            path = self.path.split("?", 1)[0]
            if door.admits(path, self.headers.get):
                return True
            self._send(401, "application/json", door.refusal_body(path), auth=True)
            return False

        def do_GET(self) -> None:
            if not self._admitted():
                return
            if self.path == HEALTH_PATH:
                status, body = owner_health(owner)
                if not door.admits(OWNER_DETAIL_PATH, self.headers.get):
                    body = {"status": body["status"]}  # liveness: up or not, nothing else
                self._send(status, "application/json", json.dumps(body).encode())
            elif self.path == METRICS_PATH:
                status, _ = owner_health(owner)
                up_gauge.set(1 if status == 200 else 0)
                text = generate_latest(registry)
                if status == 200:
                    try:
                        child = httpx.get(
                            owner.child_health_url.replace("/health", "/metrics"),
                            timeout=CHILD_TIMEOUT_S,
                        )
                        text += child.content
                    except httpx.HTTPError:
                        pass  # our own gauges already say the child is unhealthy
                self._send(200, "text/plain; version=0.0.4", text)
            else:
                self._send(404, "application/json", b'{"error": "not found"}')

        def do_other(self) -> None:
            if self._admitted():
                self._send(405, "application/json", b'{"error": "method not allowed"}')

        do_POST = do_PUT = do_DELETE = do_PATCH = do_other

        def _send(self, status: int, content_type: str, data: bytes, auth: bool = False) -> None:
            self.send_response(status)
            if auth:
                self.send_header("WWW-Authenticate", "Bearer")
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            return  # health probes every few hundred ms would drown the owner's log

    server = ThreadingHTTPServer((owner.config.host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="pool-owner-http", daemon=True).start()
    return server
