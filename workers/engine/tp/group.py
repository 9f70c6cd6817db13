"""The ranks of one tensor-parallel worker: started by rank 0, joined by paddle.distributed.

    rank 0 (the worker)   TPGroup.start: free ports, spawns ranks 1..N-1 (`python -m
                          workers.engine.tp.peer`, the RankSpec in their environment), joins
                          the collective group, accepts each rank's control connection
    rank r (a peer)       join_group: the collective group, then the control connection

The collectives (the all-reduce after each row-parallel layer) go through paddle.distributed:
gloo on the CPU, NCCL on GPUs. The step plan does not: rank 0 sends each step's
ScheduledBatch to every rank over its control connection (a socket: a peer that reads EOF
knows rank 0 is gone), and every rank runs that step.

A rank that dies takes the worker down: rank 0 watches its peers' processes and exits at
once when one ends (its /health stops answering, the router stops sending, a launcher
restarts the worker), and every peer exits when rank 0's process is gone (its parent changes),
also while blocked inside a collective. Nothing waits for a dead rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

log = logging.getLogger(__name__)

SPEC_ENV = "PDWORKER_TP_SPEC"
WATCH_INTERVAL_S = 0.1
# A peer must connect and report loaded within this; rank 0 gives up and fails its start.
JOIN_TIMEOUT_S = 300.0
EXIT_RANK_DIED = 70


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to join: its place, the collective endpoints, rank 0's control
    address and key, and the worker's settings (engine config fields, pool settings)."""

    rank: int
    world_size: int
    endpoints: tuple[str, ...]  # host:port per rank, for paddle.distributed
    control: tuple[str, int]
    authkey_hex: str
    engine: dict[str, Any]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        raw = json.loads(text)
        raw["endpoints"] = tuple(raw["endpoints"])
        raw["control"] = tuple(raw["control"])
        return cls(**raw)


def init_collectives(spec: RankSpec) -> None:
    """Join paddle.distributed's group as spec.rank (blocks until every rank has joined)."""
    os.environ.update(
        PADDLE_TRAINER_ID=str(spec.rank),
        PADDLE_TRAINERS_NUM=str(spec.world_size),
        PADDLE_TRAINER_ENDPOINTS=",".join(spec.endpoints),
        PADDLE_CURRENT_ENDPOINT=spec.endpoints[spec.rank],
        PADDLE_MASTER=spec.endpoints[0],
    )
    if spec.engine.get("device", "cpu").startswith("cpu"):
        os.environ["PADDLE_DISTRI_BACKEND"] = "gloo"
    from workers.engine.paddle_runtime import paddle

    paddle.distributed.init_parallel_env()


def all_reduce(tensor: Any) -> Any:
    """The sum over ranks, in place (a row-parallel layer's partial outputs)."""
    from workers.engine.paddle_runtime import paddle

    paddle.distributed.all_reduce(tensor)
    return tensor


def rank_device(device: str, rank: int) -> str:
    """Rank r of a GPU worker runs on GPU r (gpu:K: on K + r); CPU ranks share the CPU."""
    if device.startswith("cpu"):
        return device
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"gpu:{base + rank}"


class TPGroup:
    """Rank 0's side: the peers' processes and control connections, and the watchdog."""

    def __init__(
        self, procs: list[subprocess.Popen], conns: list[Connection], authkey: bytes
    ) -> None:
        self.procs, self.conns, self.authkey = procs, conns, authkey
        self.peer_info: list[dict[str, Any]] = []
        self._stopping = False
        self._lock = threading.Lock()
        self._watch = threading.Thread(target=self._watchdog, name="tp-watchdog", daemon=True)
        self._watch.start()

    @classmethod
    def start(
        cls, world_size: int, engine: dict[str, Any], extra: dict[str, Any] | None = None
    ) -> tuple[TPGroup, RankSpec]:
        """Spawn ranks 1..world_size-1 and join the collective group as rank 0; returns the
        group and rank 0's own spec. The peers then load their shards (wait_ready)."""
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        ports = _free_ports(world_size)
        specs = [
            RankSpec(
                rank,
                world_size,
                tuple(f"127.0.0.1:{p}" for p in ports),
                listener.address,
                authkey.hex(),
                engine,
                extra or {},
            )
            for rank in range(world_size)
        ]
        procs = [_spawn(spec) for spec in specs[1:]]
        try:
            init_collectives(specs[0])
            conns = _accept(listener, procs)
        except BaseException:
            for proc in procs:
                proc.kill()
            raise
        finally:
            listener.close()
        return cls(procs, conns, authkey), specs[0]

    def wait_ready(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Wait until every peer has loaded its shard (each sends its info once)."""
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(timeout_s):
                raise RuntimeError(f"tensor-parallel rank {rank} did not load in {timeout_s} s")
            message = conn.recv()
            if message.get("error"):
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {message['error']}")
            self.peer_info.append(message)

    def connect_pools(self, message: dict[str, Any], timeout_s: float = 60.0) -> list[Any]:
        """Before the engine steps: every peer connects its pool client and serves handoff
        calls (peer.py); returns their addresses in rank order."""
        addresses = []
        with self._lock:
            for rank, conn in enumerate(self.conns, start=1):
                conn.send({"pool": message})
                if not conn.poll(timeout_s):
                    raise RuntimeError(f"tensor-parallel rank {rank}: no pool in {timeout_s} s")
                answer = conn.recv()
                if answer.get("error"):
                    raise RuntimeError(f"tensor-parallel rank {rank}: {answer['error']}")
                addresses.append(tuple(answer["handoff"]))
        return addresses

    def stop(self) -> None:
        """End every peer (rank 0 failed to start): the watchdog stands down first."""
        self._stopping = True
        for proc in self.procs:
            proc.kill()
            proc.wait()

    def send_step(self, batch: Any) -> None:
        """Every peer runs this step (sent before rank 0 computes it)."""
        with self._lock:
            for conn in self.conns:
                conn.send(batch)

    def _watchdog(self) -> None:
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    # SIGTERM: the worker's process group is being stopped (a launcher).
                    level = logging.INFO if code == -signal.SIGTERM else logging.ERROR
                    log.log(
                        level,
                        "tensor-parallel rank %d (pid %d) exited with %s: the worker stops",
                        rank,
                        proc.pid,
                        code,
                    )
                    logging.shutdown()
                    os._exit(EXIT_RANK_DIED)
            time.sleep(WATCH_INTERVAL_S)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _spawn(spec: RankSpec) -> subprocess.Popen:
    env = dict(os.environ, **{SPEC_ENV: spec.to_json()})
    return subprocess.Popen([sys.executable, "-m", "workers.engine.tp.peer"], env=env)


def _accept(listener: Listener, procs: list[subprocess.Popen]) -> list[Connection]:
    """Each peer's control connection, in rank order (a peer sends its rank first)."""
    listener._listener._socket.settimeout(JOIN_TIMEOUT_S)  # accept() has no timeout of its own
    by_rank: dict[int, Connection] = {}
    while len(by_rank) < len(procs):
        conn = listener.accept()
        by_rank[conn.recv()] = conn
    return [by_rank[r] for r in range(1, len(procs) + 1)]


def connect_control(spec: RankSpec) -> Connection:
    conn = Client(spec.control, authkey=bytes.fromhex(spec.authkey_hex))
    conn.send(spec.rank)
    return conn


def exit_with_parent() -> None:
    """A peer's watchdog: exit at once when rank 0's process is gone (also while this
    process is blocked in a collective that will never complete)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_INTERVAL_S)
        os._exit(EXIT_RANK_DIED)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
