"""An attacker's audit of a launched cluster: every open door fails this test.

`pdrouter launch --prefill 1 --decode 1` with an API key (given in the environment, as a
deployer should), and PDROUTER_HOST / PDWORKER_HOST set to 0.0.0.0 in the launcher's own
environment (they once moved every child onto every interface while the launcher printed
127.0.0.1). Then, for every process the launcher started (the whole process tree):

- every listening socket is bound to 127.0.0.1, or is one of the Mooncake sockets listed in
  pdrouter.launch.exposure, exactly (a new one fails until it is listed and documented; with
  --pool-tcp too, on a cluster of its own);
- every HTTP server of ours answers 401 to an unauthenticated request on each of its routes
  (the router's and workers' routes from their own OpenAPI schema, read with the admin key),
  except /health, which answers {"status": "ok"} and nothing more;
- no command line holds a secret; the admin key file is 0600; the launcher prints its path;
- the right keys do open the doors (a chat completion, /instances, a worker's /v1/models).
"""

from __future__ import annotations

import os
import re
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdrouter.common.auth import INTERNAL_SECRET_HEADER
from pdrouter.common.proc import ManagedProcess, find_free_port
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.exposure import EXPOSURES, POOL_TCP_EXPOSURES
from pdrouter.launch.secrets import ADMIN_KEY_FILE
from pdrouter.launch.spec import ClusterSpec
from pdrouter.router.app import OPENAI_ROUTES
from tests.e2e.security.listeners import Listener, listeners, process_tree
from tests.pdrouter.launch.launch_cli import start_launch
from tests.wait import wait_until

pytestmark = pytest.mark.slow

API_KEY = "sk-audit-" + "7" * 24
HOST = "127.0.0.1"
LIVENESS = {"status": "ok"}
# What each of our processes is, from its command line; Mooncake's by their binary's name.
ROLES = (
    ("pdrouter.cli launch", "launcher"),
    ("pdrouter.cli serve", "router"),
    ("workers.cli serve", "worker"),
    ("workers.cli pool", "pool owner"),
    ("workers.cli metadata", "pdworker metadata"),
    ("mooncake_master", "mooncake_master"),
    ("mooncake_client", "mooncake_client"),
)
MOONCAKE = {e.process for e in EXPOSURES}
OWNER_ROUTES = ("/health", "/metrics")  # workers/pool/owner_http.py serves these two


@dataclass
class Launched:
    proc: ManagedProcess
    port: int
    log_dir: Path

    @property
    def admin_key(self) -> str:
        return (self.log_dir / ADMIN_KEY_FILE).read_text().strip()

    def tree(self) -> list[int]:
        return process_tree(self.proc.pid)


def _role(pid: int) -> str:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    for needle, role in ROLES:
        if needle in cmdline:
            return role
    raise AssertionError(f"pid {pid} is no process the launcher should start: {cmdline!r}")


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path) -> Iterator[Launched]:
    tmp = tmp_path_factory.mktemp("audit")
    port = find_free_port()
    proc = start_launch(port, tmp, tiny_cache_dir, env={"PDROUTER_API_KEY": API_KEY,
                        "PDROUTER_HOST": "0.0.0.0", "PDWORKER_HOST": "0.0.0.0"})  # fmt: skip
    try:

        def ready() -> bool:
            assert proc.alive(), f"launcher exited {proc.returncode}:\n{proc.log_tail()}"
            return f"router ready: http://{HOST}:{port}/v1" in proc.log_tail(100_000)

        wait_until(ready, 240, "the launched cluster", interval_s=0.2)
        yield Launched(proc, port, tmp / "logs")
    finally:
        proc.stop()


def _by_role(launched: Launched) -> dict[str, list[Listener]]:
    found: dict[str, list[Listener]] = {}
    for listener in listeners(launched.tree()):
        found.setdefault(_role(listener.pid), []).append(listener)
    return found


def _census(found: dict[str, list[Listener]]) -> tuple[dict[str, list[str]], Counter]:
    """(our HTTP listeners' hosts by role, Counter of every other socket as (process, bind))."""
    ours: dict[str, list[str]] = {}
    others: Counter = Counter()
    for role, lsns in found.items():
        for lsn in lsns:
            if role in MOONCAKE or lsn.host != HOST:
                others[(role, "host" if lsn.host == HOST else lsn.host)] += 1
            else:
                ours.setdefault(role, []).append(lsn.host)
    return ours, others


def test_every_socket_is_bound_to_the_host_or_a_listed_mooncake_exception(
    launched: Launched,
) -> None:
    ours, others = _census(_by_role(launched))
    # One HTTP port each, on the host the launcher printed, none on 0.0.0.0.
    assert ours == {"router": [HOST], "worker": [HOST, HOST], "pool owner": [HOST]}
    assert others == Counter((e.process, e.bind) for e in EXPOSURES)


def test_pool_tcp_adds_only_the_listed_worker_sockets(tiny_cache_dir: Path, tmp_path: Path) -> None:
    """Workers that reach the pool over TCP run transfer engines of their own."""
    spec = ClusterSpec(
        num_prefill=1, num_decode=1, pool_size="128MiB", api_key=API_KEY, shared_memory=False,
        worker_args=("--num-kv-blocks", "32", "--model-cache-dir", str(tiny_cache_dir)),
        log_dir=str(tmp_path), startup_timeout_s=240.0,
    )  # fmt: skip
    with Cluster(spec) as cluster:
        pids = [pid for c in cluster.children if c.proc for pid in process_tree(c.proc.pid)]
        found: dict[str, list[Listener]] = {}
        for listener in listeners(pids):
            found.setdefault(_role(listener.pid), []).append(listener)
    ours, others = _census(found)
    assert ours == {"router": [HOST], "worker": [HOST, HOST], "pool owner": [HOST]}
    per_worker = [(e.process, e.bind) for e in POOL_TCP_EXPOSURES]
    assert others == Counter((e.process, e.bind) for e in EXPOSURES) + Counter(per_worker * 2)


def _routes(base_url: str, admin_key: str) -> list[tuple[str, str]]:
    """(method, path) of every route in the server's OpenAPI schema, path parameters filled."""
    schema = httpx.get(
        f"{base_url}/openapi.json", headers={"Authorization": f"Bearer {admin_key}"}, timeout=10
    )
    assert schema.status_code == 200, schema.text
    return [
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, ops in schema.json()["paths"].items()
        for method in ops
    ]


def _assert_refused(base_url: str, routes: list[tuple[str, str]]) -> None:
    routes = [*routes, ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no-such-path")]
    for method, path in routes:
        resp = httpx.request(method, f"{base_url}{path}", timeout=30, json={})
        if path == "/health":
            assert (resp.status_code, resp.json()) == (200, LIVENESS), (base_url, path)
        else:
            assert resp.status_code == 401, (base_url, method, path, resp.text)
            code = resp.json()["error"]["code"]
            assert code in ("invalid_api_key", "invalid_admin_key", "invalid_secret"), path


def test_every_route_of_every_http_server_refuses_a_request_without_a_key(
    launched: Launched,
) -> None:
    found = _by_role(launched)
    router = f"http://{HOST}:{found['router'][0].port}"
    routes = _routes(router, launched.admin_key)
    # The OpenAI POST routes are served ahead of FastAPI (not in the schema): add them.
    routes += [("POST", path) for path in OPENAI_ROUTES]
    assert ("GET", "/instances") in routes and ("GET", "/health") in routes
    _assert_refused(router, routes)
    for worker in found["worker"]:
        url = f"http://{HOST}:{worker.port}"
        routes = _routes(url, launched.admin_key)
        assert ("POST", "/internal/prefill") in routes or ("POST", "/internal/decode") in routes
        _assert_refused(url, routes)
    owner = f"http://{HOST}:{found['pool owner'][0].port}"
    _assert_refused(owner, [("GET", path) for path in OWNER_ROUTES])


def _secrets(launched: Launched) -> dict[str, str]:
    router_pid = next(pid for pid in launched.tree() if _role(pid) == "router")
    raw = Path(f"/proc/{router_pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
    return {
        "api key": env["PDROUTER_API_KEY"],
        "admin key": env["PDROUTER_ADMIN_KEY"],
        "internal secret": env["PDROUTER_INTERNAL_SECRET"],
    }


def test_secrets_travel_in_the_environment_and_a_0600_file_only(launched: Launched) -> None:
    secrets = _secrets(launched)
    assert secrets["api key"] == API_KEY and secrets["admin key"] == launched.admin_key
    assert min(len(s) for s in secrets.values()) >= 32
    for pid in launched.tree():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        for name, value in secrets.items():
            assert value.encode() not in cmdline, f"{_role(pid)} (pid {pid}) shows the {name}"
    key_file = launched.log_dir / ADMIN_KEY_FILE
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    output = launched.proc.log_tail(100_000)
    assert str(key_file) in output
    assert all(value not in output for value in secrets.values())
    assert "security: 7 Mooncake sockets have no authentication" in output


def test_the_right_keys_open_the_doors(launched: Launched) -> None:
    secrets = _secrets(launched)
    found = _by_role(launched)
    router = f"http://{HOST}:{found['router'][0].port}"
    client = {"Authorization": f"Bearer {API_KEY}"}
    admin = {"Authorization": f"Bearer {launched.admin_key}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = httpx.post(f"{router}/v1/chat/completions", json=body, headers=client, timeout=60)
    assert (resp.status_code, resp.json()["usage"]["completion_tokens"]) == (200, 2)
    # The keys do not stand in for each other.
    assert httpx.get(f"{router}/instances", headers=client, timeout=10).status_code == 401
    listed = httpx.get(f"{router}/instances", headers=admin, timeout=10)
    assert [i["role"] for i in listed.json()["instances"]] == ["prefill", "decode"]
    health = httpx.get(f"{router}/health", headers=admin, timeout=10).json()
    assert (health["status"], health["num_decode_healthy"]) == ("ok", 1)
    for worker in found["worker"]:
        url = f"http://{HOST}:{worker.port}"
        internal = {INTERNAL_SECRET_HEADER: secrets["internal secret"]}
        for headers in (client, internal):
            resp = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
            assert resp.json()["data"][0]["id"] == "tiny", resp.text
        assert httpx.get(f"{url}/metrics", headers=client, timeout=10).status_code == 401
        assert httpx.get(f"{url}/metrics", headers=admin, timeout=10).status_code == 200
        assert "fingerprint" in httpx.get(f"{url}/health", headers=internal, timeout=10).json()
    owner = f"http://{HOST}:{found['pool owner'][0].port}"
    assert httpx.get(f"{owner}/health", headers=admin, timeout=10).json()["status"] == "ok"
    assert httpx.get(f"{owner}/metrics", headers=admin, timeout=10).status_code == 200
