"""Simulated hosts on one machine: Linux network namespaces joined by a bridge.

    pdmh-hostA 10.231.0.1 ─┐
    pdmh-hostB 10.231.0.2 ─┤
    pdmh-hostC 10.231.0.3 ─┼── br0 in pdmh-net (no address: only a switch)
    pdmh-hostD 10.231.0.4 ─┤
    pdmh-client 10.231.0.5 ┘   the caller's HTTP calls run in a thread inside this one

Each host is a namespace with its own loopback and one veth into the bridge namespace; the
root namespace gets no link and no route to SUBNET, so nothing started on these hosts is
reachable from outside the namespaces made here, and no process in them reaches out. A process
runs on a host through `ip netns exec` (which execs: the PID is the command's own). The
caller's own calls run in one thread that has entered the client namespace (setns acts per
thread). The multi-host tests (tests/e2e/multihost) and `python -m benchmarks.pd_multihost`
run the cluster of pdrouter.launch.multihost on these hosts; making them needs root.

One run at a time on a machine: LOCK_PATH is held from up() to down(). A run that crashed
left namespaces named NAME_PREFIX*; the next up() (holding the lock, so they are nobody's)
kills their processes and deletes them. down() kills every process still in a namespace made
here, then deletes the namespaces, which removes their links; it runs also when the caller fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

T = TypeVar("T")

SUBNET = ipaddress.ip_network("10.231.0.0/24")  # every address the hosts use
NAME_PREFIX = "pdmh-"
BRIDGE_NETNS = f"{NAME_PREFIX}net"
CLIENT = "client"
LOCK_PATH = Path("/run/lock/pdrouter-multihost-netns.lock")
LOCK_WAIT_S = 900.0  # another run (tests, benchmark) may hold the machine's namespaces
_CLONE_NEWNET = 0x40000000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _wait(holds: Callable[[], bool], timeout_s: float, what: str, interval_s: float) -> None:
    """Poll holds() until it is true; past timeout_s raise TimeoutError naming what."""
    deadline = time.monotonic() + timeout_s
    while not holds():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def unavailable_reason() -> str | None:
    """None where namespaces can be made here, else why not (tests skip with it)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, as CI does)"
    probe = f"{NAME_PREFIX}probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:  # the link types the topology needs (a kernel may lack the modules)
        for args in (("type", "bridge"), ("type", "veth", "peer", "name", "probe1")):
            link = _ip("-n", probe, "link", "add", "probe0", *args, check=False)
            if link.returncode != 0:
                return f"`ip link add ... {args[1]}` failed: {link.stderr.strip()}"
            _ip("-n", probe, "link", "del", "probe0", check=False)
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    name: str  # "hostA"
    netns: str  # "pdmh-hostA"
    address: str  # "10.231.0.1"

    def argv(self, command: Sequence[str]) -> list[str]:
        """command run on this host (ip netns exec execs it: same PID)."""
        return ["ip", "netns", "exec", self.netns, *command]


def namespaces_now() -> list[str]:
    """Every namespace named NAME_PREFIX* on this machine (ours or a crashed run's)."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(NAME_PREFIX)]


def pids_in(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False).stdout
    return [int(pid) for pid in out.split()]


def try_lock(lock: IO[bytes]) -> bool:
    """Take the exclusive lock on an open file now, or say it is held."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def remove_namespace(netns: str, timeout_s: float = 15.0) -> None:
    """SIGKILL each process in netns (by PID), wait until none is left, delete it."""

    def none_left() -> bool:
        pids = pids_in(netns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not pids

    _wait(none_left, timeout_s, f"every process in {netns} gone after SIGKILL", 0.02)
    _ip("netns", "del", netns, check=False)


class Topology:
    """Hosts on one bridge; up() makes them, down() removes them and everything in them."""

    def __init__(self, host_names: Sequence[str]) -> None:
        names = [*host_names, CLIENT]
        addresses = list(SUBNET.hosts())
        self.hosts = {
            name: Host(name, f"{NAME_PREFIX}{name}", str(addresses[i]))
            for i, name in enumerate(names)
        }
        self._lock: IO[bytes] | None = None
        self._client: ThreadPoolExecutor | None = None

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    @property
    def netns_names(self) -> list[str]:
        return [BRIDGE_NETNS, *(h.netns for h in self.hosts.values())]

    def up(self) -> Topology:
        self._take_lock()
        try:
            for leftover in namespaces_now():  # a crashed run's: we hold the lock
                remove_namespace(leftover)
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _take_lock(self) -> None:
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        lock = open(LOCK_PATH, "ab")  # noqa: SIM115 (held until down())
        try:
            _wait(lambda: try_lock(lock), LOCK_WAIT_S, "the lock", interval_s=0.1)
        except TimeoutError:
            lock.close()
            raise TimeoutError(f"{LOCK_PATH} held by another run for {LOCK_WAIT_S}s") from None
        self._lock = lock

    def _make(self) -> None:
        _ip("netns", "add", BRIDGE_NETNS)
        _ip("-n", BRIDGE_NETNS, "link", "add", "br0", "type", "bridge")
        _ip("-n", BRIDGE_NETNS, "link", "set", "br0", "up")
        for host in self.hosts.values():
            _ip("netns", "add", host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            port = f"v{host.name}"[:15]
            # Made directly inside the namespaces: the root namespace never holds either end.
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                host.netns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                BRIDGE_NETNS,
            )
            _ip("-n", BRIDGE_NETNS, "link", "set", port, "master", "br0", "up")
            _ip(
                "-n", host.netns, "addr", "add", f"{host.address}/{SUBNET.prefixlen}", "dev", "eth0"
            )
            _ip("-n", host.netns, "link", "set", "eth0", "up")
        self._client = ThreadPoolExecutor(
            1, f"{NAME_PREFIX}client", initializer=_enter_netns, initargs=(self[CLIENT].netns,)
        )

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) run from the client host (its sockets are that namespace's)."""
        assert self._client is not None, "Topology.up() first"
        return self._client.submit(fn, *args).result()

    def down(self) -> None:
        """Kill every process on these hosts, delete the namespaces (and so their links)."""
        try:
            if self._client is not None:
                self._client.shutdown(wait=True)
                self._client = None
            for netns in self.netns_names:
                if netns in namespaces_now():
                    remove_namespace(netns)
        finally:
            if self._lock is not None:
                self._lock.close()  # releases the flock
                self._lock = None

    def __enter__(self) -> Topology:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def _enter_netns(netns: str) -> None:
    """This thread's sockets from now on belong to netns (setns is per thread for CLONE_NEWNET)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({netns}): {os.strerror(errno)}")
    finally:
        os.close(fd)
