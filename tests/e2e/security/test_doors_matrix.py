"""Every door of every process, under each way a launched cluster authenticates.

One cluster per configuration (tests/e2e/security/door_table.py: none, --api-key, a keys
file, both), each a router, a P, a D, a mixed worker and the pool owner, real processes
started by pdrouter.launch.cluster.Cluster. Every route of every HTTP server is walked, read
from the server itself (its OpenAPI document, fetched with the admin key, plus the routes
FastAPI serves outside it, a wrong method and an unknown path), with no key, a wrong key, the
API key, a keys-file key, the admin key and the internal secret:

- a caller the documented table refuses gets exactly 401, an OpenAI error body naming the
  credential (invalid_api_key, invalid_admin_key, invalid_secret), WWW-Authenticate: Bearer;
- every caller it admits gets one and the same status from the route itself (never 401, never
  a 5xx), and /health's detail only for who may read /metrics.

And every body the router reads is bounded (test_every_body_the_router_reads_is_bounded).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdrouter.common.auth import INTERNAL_SECRET_HEADER
from pdrouter.common.body_limit import DRAIN_MAX_BYTES, ENVELOPE_BYTES
from pdrouter.common.doors import ROUTER_ADMIN_PATHS
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from pdrouter.router.app import OPENAI_ROUTES
from tests.e2e.cluster_fixture import QUIET_ENV, started_cluster
from tests.e2e.security.door_table import CALLERS, CONFIGS, DoorConfig, detail_callers, who_may
from workers.pool.owner_http import OWNER_PATHS

pytestmark = pytest.mark.slow

API_KEY = "sk-doors-api-" + "1" * 20
FILE_KEY = "sk-doors-file-" + "2" * 20
ADMIN_KEY = "doors-admin-" + "3" * 20
SECRET = "doors-secret-" + "4" * 20
CALLER_HEADERS: dict[str, dict[str, str]] = {
    "none": {},
    "wrong": {"Authorization": "Bearer sk-wrong", INTERNAL_SECRET_HEADER: "wrong-secret"},
    "user": {"Authorization": f"Bearer {API_KEY}"},
    "file user": {"Authorization": f"Bearer {FILE_KEY}"},
    "admin": {"Authorization": f"Bearer {ADMIN_KEY}"},
    "secret": {INTERNAL_SECRET_HEADER: SECRET},
}
REFUSAL_CODES = {"invalid_api_key", "invalid_admin_key", "invalid_secret"}
# FastAPI serves these outside its OpenAPI document (the workers turn /docs off: 404 there).
UNDOCUMENTED = (("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"),
                ("GET", "/redoc"), ("GET", "/no-such-path"), ("DELETE", "/health"))  # fmt: skip
WORKER_ARGS = ("--block-size", "16", "--num-kv-blocks", "64", "--max-model-len", "256")


@pytest.fixture(scope="module", params=CONFIGS, ids=[c.name for c in CONFIGS])
def launched(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path
) -> Iterator[tuple[DoorConfig, Cluster]]:
    config: DoorConfig = request.param
    tmp = tmp_path_factory.mktemp(f"doors-{config.name}")
    router_args: tuple[str, ...] = ()
    if config.keys_file:
        keys = tmp / "keys.json"
        keys.write_text(json.dumps({"keys": [{"id": "file-user", "key": FILE_KEY}]}))
        router_args = ("--api-keys-file", str(keys))
    spec = ClusterSpec(
        num_prefill=1, num_decode=1, num_mixed=1, pool_size="128MiB",
        worker_args=(*WORKER_ARGS, "--model-cache-dir", str(tiny_cache_dir)),
        router_args=router_args, api_key=API_KEY if config.api_key else None,
        admin_key=ADMIN_KEY, internal_secret=SECRET, env=QUIET_ENV,
        log_dir=str(tmp / "logs"), startup_timeout_s=240.0,
    )  # fmt: skip
    for cluster in started_cluster(spec):
        yield config, cluster


def _servers(cluster: Cluster) -> dict[str, str]:
    return {
        "router": cluster.router_url,
        "prefill": cluster.prefill_urls[0],
        "decode": cluster.decode_urls[0],
        "mixed": cluster.mixed_urls[0],
        "pool owner": cluster.pool_addresses.owner_url if cluster.pool_addresses else "",
    }


def _routes(client: httpx.Client, server: str, base_url: str) -> list[tuple[str, str]]:
    """(method, path) of every route server serves, path parameters filled with "x"."""
    if server == "pool owner":
        return [("GET", path) for path in OWNER_PATHS] + [("GET", "/no-such-path")]
    schema = client.get(f"{base_url}/openapi.json", headers=CALLER_HEADERS["admin"])
    assert schema.status_code == 200, (server, schema.text)
    routes = [
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, ops in schema.json()["paths"].items()
        for method in ops
    ]
    if server == "router":
        routes += [("POST", path) for path in OPENAI_ROUTES]
    return list(dict.fromkeys([*routes, *UNDOCUMENTED]))


def _router_routes_outside_the_walk() -> set[str]:
    """The walk reads the routes from each server's OpenAPI document: a route left out of it
    (include_in_schema=False) must be in UNDOCUMENTED, or the walk would miss it."""
    from pdrouter.router.app import create_app
    from pdrouter.router.config import RouterConfig
    from pdrouter.router.instances.registry import Registry

    cfg = RouterConfig(prefill_urls=("http://p",), decode_urls=("http://d",))
    app = create_app(cfg, Registry(list(cfg.prefill_urls), list(cfg.decode_urls)))
    walked = {re.sub(r"\{[^}]+\}", "x", path) for path in app.openapi()["paths"]}
    walked |= {path for _, path in UNDOCUMENTED}
    held = {re.sub(r"\{[^}]+\}", "x", route.path) for route in app.routes}
    return held - walked


def _call(client: httpx.Client, base_url: str, method: str, path: str, caller: str):
    body = None if method in ("GET", "HEAD") else b"{}"
    headers = {**CALLER_HEADERS[caller], "content-type": "application/json"}
    return client.request(method, f"{base_url}{path}", content=body, headers=headers)


def _walk(client: httpx.Client, config: DoorConfig, server: str, base_url: str) -> list[str]:
    """Every way server's doors differ from the table, as lines (none: all as documented)."""
    wrong: list[str] = []
    routes = _routes(client, server, base_url)
    assert len(routes) >= (2 if server == "pool owner" else 10), (server, routes)
    for method, path in routes:
        admitted = who_may(config, server, path)
        through: dict[str, int] = {}
        for caller in CALLERS:
            resp = _call(client, base_url, method, path, caller)
            where = f"{config.name} {server} {method} {path} as {caller!r}"
            if caller not in admitted:
                error = resp.json().get("error", {}) if resp.status_code == 401 else {}
                if (
                    resp.status_code != 401
                    or error.get("code") not in REFUSAL_CODES
                    or resp.headers.get("www-authenticate") != "Bearer"
                ):
                    wrong.append(f"{where}: {resp.status_code} {resp.text[:120]} (want 401)")
                continue
            through[caller] = resp.status_code
            if resp.status_code == 401 or resp.status_code >= 500:
                wrong.append(f"{where}: {resp.status_code} {resp.text[:120]} (want through)")
        if len(set(through.values())) > 1:
            wrong.append(f"{config.name} {server} {method} {path}: admitted get {through}")
    return wrong


def _health_detail(client: httpx.Client, config: DoorConfig, server: str, url: str) -> list[str]:
    """/health: {"status": "ok"} alone, but to who may read /metrics, who sees it all."""
    wrong = []
    for caller in CALLERS:
        resp = client.get(f"{url}/health", headers=CALLER_HEADERS[caller])
        detailed = caller in detail_callers(config, server)
        body = resp.json()
        if resp.status_code != 200 or body.get("status") != "ok":
            wrong.append(f"{config.name} {server} /health as {caller!r}: {resp.status_code} {body}")
        elif (body != {"status": "ok"}) != detailed:
            wrong.append(f"{config.name} {server} /health as {caller!r}: detail {sorted(body)}")
    return wrong


def test_every_route_of_every_process_admits_exactly_the_documented_callers(
    launched: tuple[DoorConfig, Cluster],
) -> None:
    config, cluster = launched
    assert _router_routes_outside_the_walk() == set()
    wrong: list[str] = []
    with httpx.Client(timeout=60) as client:
        for server, url in _servers(cluster).items():
            wrong += _walk(client, config, server, url)
            wrong += _health_detail(client, config, server, url)
    assert wrong == [], "\n".join(wrong)


# Over every bound the router has (a tiny model's context: a few hundred KB), under the
# length past which a refused body is no longer drained (the answer is then read for sure).
OVERSIZE_BYTES = 8 * 1024 * 1024
BURST_BYTES = DRAIN_MAX_BYTES * 3 // 4  # 48 MiB each, 8 at once (the 8 x 100 MB)
BURST_CALLS = 8
RSS_GROWTH_BOUND_KB = 128 * 1024  # the 8 bodies held whole would be 384 MiB


def _prompt_body(num_bytes: int) -> bytes:
    return b'{"model": "tiny", "prompt": "' + b"x" * num_bytes + b'"}'


def _memory_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _user(config: DoorConfig) -> str:
    return "user" if config.api_key else "file user" if config.keys_file else "none"


def _refusal(path: str) -> tuple[int, str]:
    """The bound of path and how it answers: the admin API's own (413); every other route
    the OpenAI routes' (a /tokenize body is a prompt: 400 past the context it must fit)."""
    if any(path.startswith(prefix) for prefix in ROUTER_ADMIN_PATHS):
        return 413, f"request body is larger than {ENVELOPE_BYTES} bytes (the admin API's bound)"
    # The router's own bound, not a worker's relayed (which names the worker's flags).
    return 400, "This model's maximum context length is 256 tokens"


def _send_oversize(url: str, path: str, method: str, caller: str, chunked: bool):
    body = _prompt_body(BURST_BYTES if chunked else OVERSIZE_BYTES)
    # An iterator goes out chunked (no Content-Length): the bound holds while reading too.
    content = (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)) if chunked else body
    headers = {**CALLER_HEADERS[caller], "content-type": "application/json"}
    with httpx.Client(timeout=120) as client:
        return client.request(method, f"{url}{path}", content=content, headers=headers)


def test_every_body_the_router_reads_is_bounded(launched: tuple[DoorConfig, Cluster]) -> None:
    config, cluster = launched
    url = cluster.router_url
    router_pid = cluster.child("router").proc.pid  # type: ignore[union-attr]
    with httpx.Client(timeout=60) as client:
        routes = _routes(client, "router", url)
    reading = [(m, p) for m, p in routes if m in ("POST", "PUT", "PATCH", "DELETE")]
    assert ("POST", "/tokenize") in reading and ("POST", "/detokenize") in reading
    wrong = []
    for method, path in reading:
        caller = "admin" if "admin" in who_may(config, "router", path) - {"none"} else _user(config)
        resp = _send_oversize(url, path, method, caller, chunked=False)
        status, message = _refusal(path)
        error = resp.json().get("error", {}) if resp.status_code == status else {}
        said = error.get("message", "")
        if not said.startswith(message) or (status == 400 and "the router's" not in said):
            wrong.append(f"{method} {path}: {resp.status_code} {resp.text[:200]}")
    assert wrong == [], "\n".join(wrong)
    rss_before_kb = _memory_kb(router_pid, "VmRSS")
    with ThreadPoolExecutor(BURST_CALLS) as pool:
        answers = list(pool.map(
            lambda i: _send_oversize(url, "/tokenize", "POST", _user(config), chunked=i % 2 == 1),
            range(BURST_CALLS),
        ))  # fmt: skip
    assert [a.status_code for a in answers] == [400] * BURST_CALLS, answers[0].text
    assert {a.json()["error"]["code"] for a in answers} == {"context_length_exceeded"}
    # The peak resident memory since start (VmHWM) covers the whole burst.
    growth_kb = _memory_kb(router_pid, "VmHWM") - rss_before_kb
    print(f"router RSS before the burst {rss_before_kb} KB, peak after {growth_kb} KB more")
    assert growth_kb < RSS_GROWTH_BOUND_KB, f"the router grew by {growth_kb} KB"
    # And it still serves: a completion through P and D, a token count through P.
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = CALLER_HEADERS[_user(config)]
    resp = httpx.post(f"{url}/v1/chat/completions", json=chat, headers=headers, timeout=60)
    assert (resp.status_code, resp.json()["usage"]["completion_tokens"]) == (200, 2), resp.text
    count = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "hi"}, headers=headers)
    assert (count.status_code, count.json()["count"]) == (200, len(count.json()["tokens"]))
