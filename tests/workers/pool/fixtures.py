"""Real Mooncake pools and pool-client processes for tests (this package's and others').

    from tests.workers.pool.fixtures import running_pool   # in a conftest.py or test module

running_pool (module scope) starts mooncake_master and `pdworker pool` on free loopback ports
and yields PoolAddresses (master_addr, metadata_url, owner_addr, owner_url, admin_url): all a
worker needs. Every process is stopped by PID in a finalizer, also when the test fails.
"""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdrouter.common.proc import ManagedProcess
from tests.repo import REPO_ROOT
from workers.pool.local_pool import LocalPool, PoolAddresses
from workers.pool.master import MasterConfig

POOL_BYTES = 256 << 20
CHILD_ENV = {"MC_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}


def start_pool(log_dir: Path, size_bytes: int = POOL_BYTES, **master: Any) -> LocalPool:
    """A started LocalPool; master keyword arguments override MasterConfig fields."""
    return LocalPool(size_bytes, log_dir=log_dir, master_config=MasterConfig(**master)).start()


@pytest.fixture(scope="module")
def running_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolAddresses]:
    """A master + pool owner shared by one test module; yields their addresses."""
    pool = LocalPool(POOL_BYTES, log_dir=tmp_path_factory.mktemp("pool"))
    try:
        pool.start()
        yield pool.addresses
    finally:
        pool.stop()


class PoolActor:
    """A KVPoolClient in its own process (tests/workers/pool/actor.py), commanded over a pipe."""

    def __init__(self, name: str, log_dir: Path) -> None:
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        env = {**CHILD_ENV, "PDPOOL_ACTOR_KEY": key.hex()}
        self.proc = ManagedProcess(
            name,
            [sys.executable, "-m", "tests.workers.pool.actor", f"{host}:{port}"],
            env=env,
            log_path=log_dir / f"{name}.log",
            cwd=str(REPO_ROOT),
        )
        self._conn: Connection | None = None

    def _connection(self, timeout_s: float) -> Connection:
        if self._conn is None:
            # Listener.accept() has no timeout: wait for the child's connect on the socket.
            sock = self._listener._listener._socket  # type: ignore[attr-defined]
            sock.settimeout(timeout_s)
            try:
                self._conn = self._listener.accept()
            finally:
                sock.settimeout(None)
        return self._conn

    def send(self, command: str, **kwargs: Any) -> None:
        self._connection(30.0).send((command, kwargs))

    def recv(self, timeout_s: float = 30.0) -> dict[str, Any]:
        conn = self._connection(timeout_s)
        if not conn.poll(timeout_s):
            raise TimeoutError(
                f"{self.proc.name}: no reply in {timeout_s}s\n{self.proc.log_tail()}"
            )
        try:
            return conn.recv()
        except EOFError as exc:
            raise RuntimeError(
                f"{self.proc.name} died (code {self.proc.returncode}):\n{self.proc.log_tail()}"
            ) from exc

    def call(self, command: str, timeout_s: float = 30.0, **kwargs: Any) -> dict[str, Any]:
        """Send a command and wait for its reply (the actor's exceptions become reply fields)."""
        start = time.monotonic()
        self.send(command, **kwargs)
        return self.recv(max(0.1, timeout_s - (time.monotonic() - start)))

    def alive(self) -> bool:
        return self.proc.alive()

    def stop(self) -> None:
        if self._conn is not None and self.proc.alive():
            try:
                self._conn.send(("exit", {}))
                self.proc.popen.wait(timeout=10)
            except Exception:
                pass  # stop() below kills it
        self.proc.stop()
        if self._conn is not None:
            self._conn.close()
        self._listener.close()


@pytest.fixture
def actors(tmp_path: Path) -> Iterator[Any]:
    """Factory: actors(name) -> a started PoolActor, stopped by PID after the test."""
    started: list[PoolActor] = []

    def make(name: str) -> PoolActor:
        actor = PoolActor(name, tmp_path)
        started.append(actor)
        return actor

    try:
        yield make
    finally:
        for actor in started:
            actor.stop()


def client_config(addr: PoolAddresses, transport: str, **overrides: Any) -> dict[str, Any]:
    """PoolClientConfig fields for addr over "tcp" or "shm" (as a dict, to send to an actor)."""
    config: dict[str, Any] = {
        "master_addr": addr.master_addr,
        "metadata_url": addr.metadata_url,
        "num_slots": 64,
        "slot_bytes": 64 << 10,
        "owner_addr": addr.owner_addr if transport == "shm" else None,
    }
    config.update(overrides)
    return config


def capacity_bytes(admin_url: str) -> int:
    """The pool memory the master counts (master_total_capacity_bytes on its admin port)."""
    for line in httpx.get(admin_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("master_total_capacity_bytes "):
            return int(float(line.split()[1]))
    raise AssertionError(f"{admin_url}/metrics has no master_total_capacity_bytes")
