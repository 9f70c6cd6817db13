"""Workers that register themselves: a router started with no instance list, one P and one D
started with --router, all real processes sharing the session cluster's pool.

Covers registration (and a fingerprint the router checks), the shared secret on /internal/*
(the router sends it, a caller without it gets 401), re-registration after a router restart,
draining, deregistration on a clean shutdown, and expiry of a worker killed without one.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdrouter.common.auth import INTERNAL_SECRET_HEADER
from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http
from tests.e2e.pd.clients import client, complete, prompt_ids
from tests.e2e.pd.conftest import BLOCK_SIZE, MAX_MODEL_LEN, MODEL, NUM_KV_BLOCKS, PDCluster
from tests.wait import wait_until

pytestmark = pytest.mark.slow

ADMIN = "admin-key-reg"
SECRET = "internal-secret-reg"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
HEARTBEAT_TTL_S = 6.0
MAX_PENDING = 48


@dataclass
class Registered:
    """The module's router and its two self-registered workers. A test that stops or kills one
    of them leaves it so; the next test's `ready()` starts it again on the same port."""

    router_url: str
    router_port: int
    workers: dict[str, ManagedProcess]  # role -> the live process
    urls: dict[str, str]  # role -> its URL (its port never changes)
    start_router: Callable[[], ManagedProcess]
    start_worker: Callable[[str], ManagedProcess]
    procs: list[ManagedProcess]

    @property
    def prefill(self) -> ManagedProcess:
        return self.workers["prefill"]

    @property
    def decode(self) -> ManagedProcess:
        return self.workers["decode"]

    @property
    def prefill_url(self) -> str:
        return self.urls["prefill"]

    @property
    def decode_url(self) -> str:
        return self.urls["decode"]

    def instances(self) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.router_url}/instances", headers=AUTH, timeout=10)
        assert resp.status_code == 200, resp.text
        return resp.json()["instances"]

    def restart_router(self) -> None:
        """Stop the router (every one started so far) and start a fresh one on its port."""
        for proc in self.procs:
            if proc.name.startswith("router-"):
                proc.stop()
        self.start_router()

    def ready(self, timeout_s: float = 180.0) -> None:
        """Restart whichever worker an earlier test stopped; wait until both are registered
        and healthy."""
        for role, proc in self.workers.items():
            if not proc.alive():
                self.workers[role] = self.start_worker(role)
        _until("both workers registered and healthy", _both_healthy(self), timeout_s)


def _until(what: str, predicate: Callable[[], bool], timeout_s: float) -> None:
    wait_until(predicate, timeout_s, what, interval_s=0.1)


@pytest.fixture(scope="module")
def registered(
    pd_cluster: PDCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Registered]:
    log_dir: Path = tmp_path_factory.mktemp("registration-logs")
    router_port = find_free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    procs: list[ManagedProcess] = []

    def start_router() -> ManagedProcess:
        router = ManagedProcess(
            f"router-{len(procs)}",
            [sys.executable, "-m", "pdrouter.cli", "serve", "--port", str(router_port),
             "--admin-key", ADMIN, "--internal-secret", SECRET, "--health-interval-s", "0.3",
             "--heartbeat-ttl-s", str(HEARTBEAT_TTL_S), "--unhealthy-after", "2",
             "--healthy-after", "2"],
            log_path=log_dir / f"router-{len(procs)}.log",
        )  # fmt: skip
        procs.append(router)
        wait_for_http(f"{router_url}/instances", 30.0, proc=router, expect_status=401)
        return router

    addrs = pd_cluster.cluster.pool_addresses
    assert addrs is not None

    ports = {"prefill": find_free_port(), "decode": find_free_port()}

    def start_worker(role: str) -> ManagedProcess:
        port = ports[role]
        worker = ManagedProcess(
            f"{role}-registered",
            [sys.executable, "-m", "workers.cli", "serve", "--role", role, "--model", MODEL,
             "--port", str(port), "--master", addrs.master_addr, "--metadata", addrs.metadata_url,
             "--pool-owner", addrs.owner_addr, "--block-size", str(BLOCK_SIZE),
             "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN),
             "--model-cache-dir", str(pd_cluster.cache_dir), "--staging-slots", "64",
             "--transfer-batch-blocks", "8", "--max-pending-requests", str(MAX_PENDING),
             "--router", router_url, "--admin-key", ADMIN, "--internal-secret", SECRET,
             "--heartbeat-interval-s", "0.5"],
            env={"OMP_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"},
            log_path=log_dir / f"{role}.log",
        )  # fmt: skip
        procs.append(worker)
        return worker

    try:
        start_router()
        workers = {role: start_worker(role) for role in ("prefill", "decode")}
        urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
        yield Registered(router_url, router_port, workers, urls, start_router, start_worker,
                         procs)  # fmt: skip
    finally:
        for proc in reversed(procs):
            proc.stop()


def _state(reg: Registered) -> list[tuple[str, str, bool]]:
    return [(i["role"], i["url"], i["healthy"]) for i in reg.instances()]


def _both_healthy(reg: Registered) -> Callable[[], bool]:
    expected = [("prefill", reg.prefill_url, True), ("decode", reg.decode_url, True)]
    return lambda: sorted(_state(reg), reverse=True) == expected


def test_workers_register_and_serve_through_the_router(
    registered: Registered, pd_cluster: PDCluster
) -> None:
    registered.ready()
    fingerprint = pd_cluster.fingerprint()
    for inst in registered.instances():
        assert (inst["source"], inst["fingerprint"], inst["block_size"], inst["model"]) == (
            "registered", fingerprint, BLOCK_SIZE, MODEL)  # fmt: skip
        assert (inst["capacity"], inst["num_kv_blocks"], inst["draining"]) == (
            MAX_PENDING, NUM_KV_BLOCKS, False)  # fmt: skip
        assert inst["max_model_len"] == MAX_MODEL_LEN
        assert inst["max_num_seqs"] == 64  # the engine's default: the router's bound follows it
        assert 0.0 <= inst["heartbeat_age_s"] < 2.0
    # The workers refuse /internal/* without the secret, so an answer proves the router sent it.
    body = {"model": MODEL, "prompt": prompt_ids(37, salt=171), "max_tokens": 6, "temperature": 0}
    expected = complete(client(pd_cluster.mixed_url), False, **body)
    assert complete(client(registered.router_url), True, **body) == expected
    assert complete(client(registered.router_url), False, **body) == expected


def test_a_router_without_the_secret_gets_a_502_naming_the_flag(
    registered: Registered, tmp_path: Path
) -> None:
    registered.ready()
    port = find_free_port()
    router = ManagedProcess(
        "router-no-secret",
        [sys.executable, "-m", "pdrouter.cli", "serve", "--port", str(port),
         "--prefill", registered.prefill_url, "--decode", registered.decode_url],
        log_path=tmp_path / "router-no-secret.log",
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/health", 30.0, proc=router)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 502
        assert resp.json()["error"]["message"] == (
            f"prefill instance {registered.prefill_url} refused the router (/internal/prefill "
            "needs the router's shared secret in the X-PD-Internal-Secret header); give the "
            "router and the workers the same --internal-secret"
        )
    finally:
        router.stop()


@pytest.mark.parametrize("path", ["/internal/prefill", "/internal/decode"])
def test_internal_endpoints_need_the_secret(registered: Registered, path: str) -> None:
    registered.ready()
    url = (registered.prefill_url if path.endswith("prefill") else registered.decode_url) + path
    body = {"request_id": "no-secret", "endpoint": "completions",
            "body": {"model": MODEL, "prompt": "hi"}}  # fmt: skip
    for headers in ({}, {INTERNAL_SECRET_HEADER: "wrong"}):
        resp = httpx.post(url, json=body, headers=headers, timeout=10)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_secret"
    # With the secret the request gets past the guard (and is judged on its body: 400/422).
    resp = httpx.post(url, json={}, headers={INTERNAL_SECRET_HEADER: SECRET}, timeout=10)
    assert resp.status_code in (400, 422), resp.text
    assert httpx.get(registered.prefill_url + "/health", timeout=10).status_code == 200


def test_workers_register_again_after_a_router_restart(registered: Registered) -> None:
    registered.ready()
    registered.restart_router()
    # A fresh router knows nobody; heartbeats get 404 and the workers register again.
    _until("both workers back after the restart", _both_healthy(registered), 30.0)


def test_drain_then_clean_shutdown_deregisters_the_decode(registered: Registered) -> None:
    registered.ready()
    d_id = next(i["id"] for i in registered.instances() if i["role"] == "decode")
    resp = httpx.post(f"{registered.router_url}/instances/{d_id}/drain", headers=AUTH)
    assert (resp.status_code, resp.json()["draining"], resp.json()["drained"]) == (200, True, True)
    body = {"model": MODEL, "prompt": prompt_ids(20, salt=172), "max_tokens": 3, "temperature": 0}
    resp = httpx.post(f"{registered.router_url}/v1/completions", json=body, timeout=30)
    # The only decode instance drains: nothing may take the request.
    assert (resp.status_code, resp.headers["Retry-After"]) == (503, "1")
    assert "no decode instance" in resp.json()["error"]["message"]
    resp = httpx.post(f"{registered.router_url}/instances/{d_id}/undrain", headers=AUTH)
    assert (resp.status_code, resp.json()["draining"]) == (200, False)
    resp = httpx.post(f"{registered.router_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    # SIGTERM: the worker deregisters on its way out, well before its heartbeat would expire.
    t0 = time.monotonic()
    registered.decode.signal(signal.SIGTERM)
    _until(
        "the decode instance deregistered",
        lambda: [i["role"] for i in registered.instances()] == ["prefill"],
        HEARTBEAT_TTL_S - 1.0,
    )
    assert time.monotonic() - t0 < HEARTBEAT_TTL_S
    # uvicorn re-raises the signal it caught once its graceful shutdown is done.
    assert registered.decode.popen.wait(timeout=20) == -signal.SIGTERM
    assert "Application shutdown complete." in registered.decode.log_tail()


def test_a_killed_worker_expires_after_its_heartbeat_ttl(registered: Registered) -> None:
    registered.ready()
    registered.prefill.kill()  # no deregistration: only the missing heartbeats tell
    t0 = time.monotonic()
    _until("the killed prefill expired",
           lambda: [i["role"] for i in registered.instances()] == ["decode"],
           HEARTBEAT_TTL_S + 5.0)  # fmt: skip
    # Not before its TTL: the router does not drop a worker for one missed heartbeat.
    assert time.monotonic() - t0 >= HEARTBEAT_TTL_S - 1.0
