"""The namespace helper itself: hosts reach each other and nothing else, everything made is
removed (also a crashed run's leftovers), and two runs never share the namespaces."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from pdrouter.launch import netns
from pdrouter.launch.netns import CLIENT, Topology, namespaces_now, pids_in
from tests.wait import wait_until

REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")

SERVE = [sys.executable, "-m", "http.server", "--bind"]


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def _get(url: str) -> int:
    return httpx.get(url, timeout=2.0).status_code


@needs_netns
def test_hosts_reach_each_other_by_address_and_everything_goes_at_the_end() -> None:
    links_before = _root_links()
    topo = Topology(["hostA", "hostB"])
    with topo:
        a, b = topo["hostA"], topo["hostB"]
        assert (a.address, b.address, topo[CLIENT].address) == (
            "10.231.0.1", "10.231.0.2", "10.231.0.3")  # fmt: skip
        assert set(topo.netns_names) <= set(namespaces_now())
        # The root namespace got no interface: nothing here is reachable from outside.
        assert _root_links() == links_before
        server = subprocess.Popen(a.argv([*SERVE, a.address, "8000"]),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        # ip netns exec enters the namespace, then execs: the PID there is the server's own.
        wait_until(lambda: pids_in(a.netns), 30.0, "the server in hostA's namespace",
                   done=lambda pids: pids == [server.pid])  # fmt: skip
        url = f"http://{a.address}:8000/"
        status = wait_until(lambda: topo.call(_get, url), 30.0, "hostA's server from the client",
                            retry_on=(httpx.HTTPError,))  # fmt: skip
        assert status == 200
        # From host B too: over the bridge, to the address the server bound.
        probe = [sys.executable, "-c", f"import httpx; print(httpx.get({url!r}).status_code)"]
        assert subprocess.run(b.argv(probe), capture_output=True, text=True,
                              timeout=60).stdout.strip() == "200"  # fmt: skip
    assert server.wait(timeout=10) == -9  # killed by down(), by its PID
    assert [n for n in topo.netns_names if n in namespaces_now()] == []
    assert _root_links() == links_before


@needs_netns
def test_a_crashed_runs_namespaces_and_processes_are_removed_by_the_next_run() -> None:
    leftover = f"{netns.NAME_PREFIX}crashed"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", leftover, "sleep", "infinity"])
    try:
        with Topology(["hostA"]):
            assert leftover not in namespaces_now()
            assert sleeper.wait(timeout=10) == -9
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        subprocess.run(["ip", "netns", "del", leftover], capture_output=True)


@needs_netns
def test_a_second_run_waits_for_the_lock_and_makes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(netns, "LOCK_WAIT_S", 0.5)
    netns.LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(netns.LOCK_PATH, "ab") as held:
        wait_until(lambda: netns.try_lock(held), 900.0, "the namespace lock (another run holds it)")
        before = namespaces_now()
        with pytest.raises(TimeoutError, match="held by another run"):
            Topology(["hostA"]).up()
        assert namespaces_now() == before


def test_without_root_the_reason_to_skip_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.unavailable_reason() == "network namespaces need root (run as root, as CI does)"
