"""Child-process lifecycle shared by the launcher, the master wrapper and the tests.

Every process is started in its own session (process group) so that stopping it by PID also
stops whatever it spawned; stop() escalates SIGTERM -> SIGKILL within a bounded time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import httpx

# PDROUTER_PORT_RANGE=LOW-HIGH narrows the ports find_free_port picks: processes that start
# clusters side by side on one machine (the test suite's parallel workers) give each its own
# range, so that a port one probed free is never bound by the other before its owner binds it.
PORT_RANGE_ENV = "PDROUTER_PORT_RANGE"


def port_range(low: int, high: int) -> tuple[int, int]:
    """[low, high), narrowed to PDROUTER_PORT_RANGE's part of it when that is set."""
    spec = os.environ.get(PORT_RANGE_ENV, "")
    if not spec:
        return low, high
    try:
        env_low, env_high = (int(part) for part in spec.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV} must be LOW-HIGH, got {spec!r}") from None
    narrowed = max(low, env_low), min(high, env_high)
    if narrowed[0] >= narrowed[1]:
        raise ValueError(f"{PORT_RANGE_ENV}={spec} leaves no port of [{low}, {high})")
    return narrowed


# The ports this process has handed out: a launcher probes every process's ports before any
# binds them, so a port probed free a moment ago must not be handed out twice.
_HANDED_OUT: set[int] = set()


def find_free_port(low: int = 20000, high: int = 32000, avoid: Collection[int] = ()) -> int:
    """A TCP port free on 127.0.0.1 now, from [low, high) (Mooncake wants ports below 32768),
    not in avoid (ports this process was given and has not bound yet), and not handed out by
    this process before (until half the range has been)."""
    # The kernel's ephemeral range sits above 32768, so binding port 0 would not do here:
    # probe random ports in the requested range instead.
    import random

    low, high = port_range(low, high)
    handed_here = {port for port in _HANDED_OUT if low <= port < high}
    if len(handed_here) >= (high - low) // 2:
        _HANDED_OUT.difference_update(handed_here)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _HANDED_OUT or port in avoid:
            continue
        try:
            hold_port("127.0.0.1", port).close()
        except RuntimeError:
            continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port in [{low}, {high}) on 127.0.0.1")


def hold_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, neither listening nor SO_REUSEADDR, so that no other
    process can bind the port until it is closed (a probe of find_free_port, anywhere, sees it
    taken). RuntimeError naming the port when something else holds it already."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"port {port} on {host} is in use ({exc.strerror})") from None
    return sock


# A thread in one of these states runs no more code: stopped (T), traced (t), or gone (Z, X).
_HALTED_STATES = frozenset("TtZX")


def _stat_fields(stat_path: Path) -> list[str] | None:
    """The fields of a /proc stat file after the command name (state, ppid, pgrp, ...), or None
    when the process or thread is gone."""
    try:
        return stat_path.read_text().rpartition(")")[2].split()
    except OSError:
        return None


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group pgid."""
    pids = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat_path)
        if fields is not None and int(fields[2]) == pgid:
            pids.append(int(stat_path.parent.name))
    return pids


def all_halted(pids: Sequence[int]) -> bool:
    """Whether every thread of every process in pids has stopped (or exited)."""
    for pid in pids:
        for stat_path in Path(f"/proc/{pid}/task").glob("*/stat"):
            fields = _stat_fields(stat_path)
            if fields is not None and fields[0] not in _HALTED_STATES:
                return False
    return True


def freeze(pids: Sequence[int], timeout_s: float = 10.0) -> None:
    """SIGSTOP pids and return once every thread of theirs has stopped. kill() returns before:
    a multi-threaded process stops when the thread that takes the signal next runs, and on a
    loaded machine another of its threads can answer a request sent meanwhile (fault-injection
    tests freeze a worker or the pool owner and count on it answering nothing more)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    wait_halted(pids, timeout_s)


def wait_halted(pids: Sequence[int], timeout_s: float) -> None:
    """Return once every thread of pids has stopped (all_halted); TimeoutError past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not all_halted(pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {list(pids)} not all stopped after {timeout_s:g} s")
        time.sleep(0.005)


class ManagedProcess:
    """A child process we own: started in a new session, stopped by PID (whole group)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        cwd: str | None = None,
        inherit_env: bool = True,
    ) -> None:
        """env is added to this process's environment, or, with inherit_env False, is the
        child's whole environment."""
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        full_env = dict(os.environ) if inherit_env else {}
        if env:
            full_env.update(env)
        self._log_file = open(log_path, "ab") if log_path else None  # noqa: SIM115
        out = self._log_file if self._log_file else subprocess.DEVNULL
        self.popen = subprocess.Popen(
            self.argv,
            env=full_env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, num_bytes: int = 4000) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()
        return data[-num_bytes:].decode("utf-8", "replace")

    def signal(self, sig: int) -> None:
        """Send sig to the whole process group (no-op when already gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def freeze(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP the whole group and return once all of it has stopped (wait_halted); SIGCONT
        (signal) resumes it."""
        self.signal(signal.SIGSTOP)  # the group at once: a child forked meanwhile too
        wait_halted(group_pids(self.popen.pid), timeout_s)

    def kill(self) -> None:
        """SIGKILL now, as a crash would (fault-injection tests use this)."""
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the group, wait up to timeout_s, then SIGKILL. Safe to call twice."""
        if self.alive():
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)  # a frozen group takes its SIGTERM only once resumed
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=10)
        # Children that ignored SIGTERM may outlive the leader: sweep the group.
        self.signal(signal.SIGKILL)
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        return self.popen.poll()


def _pid_of(resp: httpx.Response) -> object:
    try:
        body = resp.json()
    except ValueError:
        return None
    return body.get("pid") if isinstance(body, dict) else None


def wait_for_http(
    url: str,
    timeout_s: float,
    proc: ManagedProcess | None = None,
    expect_status: int = 200,
    pid: int | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    """Poll url until it answers expect_status; fail early if proc exits, late after timeout_s.
    With pid, the answer must also be a JSON object whose "pid" is pid: another server that
    holds the port (and answers /health) is not the one we started. A keyed router shows its
    pid only to the admin key: pass it in headers."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(
                f"{proc.name} (pid {proc.pid}) exited with code {proc.returncode} before "
                f"{url} was ready; log tail:\n{proc.log_tail()}"
            )
        try:
            resp = httpx.get(url, timeout=2.0, headers=headers)
            if resp.status_code == expect_status and (pid is None or _pid_of(resp) == pid):
                return
            last_error = f"HTTP {resp.status_code}"
            if pid is not None and resp.status_code == expect_status:
                last_error = f"answered by another server (pid {_pid_of(resp)}, not {pid})"
        except httpx.HTTPError as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        time.sleep(0.1)
    tail = f"; log tail:\n{proc.log_tail()}" if proc is not None else ""
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s ({last_error}){tail}")
