"""Router, workers and pool on separate (simulated) hosts: the cross-host paths, by real
processes in network namespaces (pdrouter/launch/multihost.py has the topology).

One cluster per module. A test that kills or stops a process leaves it so; the next test's
`ready()` starts it again on its host and waits until both routers list both workers healthy
and both pool owners' segments are mounted, so every test passes alone and in any order.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdrouter.launch import netns
from pdrouter.launch.multihost import (
    ADMIN_KEY,
    HOSTS,
    PLACEMENT,
    PORTS,
    SECRET,
    MultiHostCluster,
)
from tests.e2e.pd.clients import Answer, client, complete, prompt_ids
from tests.metrics_scrape import metrics_of
from tests.wait import wait_until

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

MODEL = "tiny"
BLOCK_SIZE = 16
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
MOONCAKE_PORTS = (16000, 16099)  # MC_MIN_RPC_PORT, MC_MAX_RPC_PORT of examples/start_host.sh


class Cluster(MultiHostCluster):
    """The module's cluster with the probes the tests share (all run from the client host)."""

    def instances(self, router_url: str) -> list[dict[str, Any]]:
        resp = self.call(_get, f"{router_url}/instances", AUTH)
        assert resp.status_code == 200, resp.text
        return resp.json()["instances"]

    def registered(self, router_url: str) -> list[tuple[str, str, bool]]:
        return sorted(((i["role"], i["url"], i["healthy"]) for i in self.instances(router_url)),
                      reverse=True)  # fmt: skip

    def both_registered(self) -> list[tuple[str, str, bool]]:
        return [("prefill", self.url("prefill"), True), ("decode", self.url("decode"), True)]

    def segments(self) -> dict[str, float]:
        """Bytes allocated in each mounted pool segment, by the owner's host address."""
        assert self.pool is not None
        samples = self.call(metrics_of, self.pool.admin_url)
        prefix = 'segment_allocated_bytes{segment="'
        return {name[len(prefix) :].split(":")[0]: value
                for name, value in samples.items() if name.startswith(prefix)}  # fmt: skip

    def pool_keys(self) -> set[str]:
        assert self.pool is not None
        text = self.call(_get, f"{self.pool.admin_url}/get_all_keys").text
        return {line.strip() for line in text.splitlines() if line.strip()}

    def answer(self, base_url: str, stream: bool, body: dict[str, Any]) -> Answer:
        return self.call(lambda: complete(client(base_url), stream, **body))

    def ready(self, timeout_s: float = 240.0) -> None:
        for name, proc in self.procs.items():
            if not proc.alive():
                self.restart(name, timeout_s)
        owners = {self.address("owner-a"), self.address("owner-b")}
        wait_until(lambda: set(self.segments()), 60.0, "both pool segments mounted",
                   done=lambda seen: seen == owners, interval_s=0.2)  # fmt: skip
        for router_url in self.router_urls:
            wait_until(lambda u=router_url: self.registered(u), timeout_s,
                       f"both workers registered and healthy at {router_url}",
                       done=lambda seen: seen == self.both_registered(), interval_s=0.2,
                       retry_on=(httpx.HTTPError,))  # fmt: skip


def _get(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(url, headers=headers, timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("multihost-logs")
    engine_args = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "96",
                   "--max-model-len", "512", "--model-cache-dir", str(tiny_cache_dir),
                   "--staging-slots", "64", "--transfer-batch-blocks", "8")  # fmt: skip
    with netns.Topology(HOSTS) as topo:
        c = Cluster(topo, log_dir, MODEL, engine_args)
        try:
            c.start()
            yield c
        finally:
            c.stop()


def _body(num_tokens: int, salt: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt_ids(num_tokens, salt), "max_tokens": 6,
            "temperature": 0}  # fmt: skip


def test_every_process_binds_its_hosts_address(cluster: Cluster) -> None:
    """Every port pdrouter chooses binds the host's address; Mooncake's own listeners stay in
    the range docs/deploy.md opens (start_host.sh sets it), or are the two it binds to every
    interface whatever it is told: an owner's internal health port (docs/deploy.md says so).
    The metadata store is `pdworker metadata`, on the host's address like ours."""
    cluster.ready()
    ours = {"hostA": ["master_rpc", "metadata", "master_admin", "owner_http", "owner"],
            "hostB": ["owner_http", "owner", "worker"], "hostC": ["worker", "mixed"],
            "hostD": ["r0", "r1"]}  # fmt: skip
    for host in HOSTS:
        address = cluster.topo[host].address
        out = subprocess.run(cluster.topo[host].argv(["ss", "-Hltnp"]), capture_output=True,
                             text=True, check=True, timeout=30).stdout  # fmt: skip
        bound = {}  # port -> (address, process)
        for line in out.splitlines():
            local, users = line.split()[3], line.split()[-1]
            bound[int(local.rpartition(":")[2])] = (local.rpartition(":")[0], users.split('"')[1])
        assert {bound[PORTS[p]][0] for p in ours[host]} == {address}, (host, out)
        others = {port: where for port, where in bound.items()
                  if port not in {PORTS[p] for p in ours[host]}}  # fmt: skip
        for port, (_, process) in others.items():
            in_range = MOONCAKE_PORTS[0] <= port <= MOONCAKE_PORTS[1]
            owner_health = process == "mooncake_client" and 20000 <= port < 32000
            assert in_range or owner_health, (host, port, out)


def test_no_command_line_holds_a_secret(cluster: Cluster) -> None:
    """start_host.sh hands the admin key and the internal secret to routers and workers
    through their environment: `ps` shows every user each process's argv."""
    cluster.ready()
    argvs = []
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            try:
                argvs.append((pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:  # ended meanwhile
                continue
    names = ("workers.cli", "pdrouter.cli", "mooncake_master", "mooncake_client")
    ours = [argv for argv in argvs if any(name in argv for name in names)]
    assert len(ours) >= len(PLACEMENT), ours  # every process of the cluster was seen
    assert [argv for argv in ours if ADMIN_KEY in argv or SECRET in argv] == []


def test_hosts_talk_to_each_other_only_on_the_documented_ports(cluster: Cluster) -> None:
    """Between hosts A-D, every connection goes to a port of docs/deploy.md's table: master
    RPC and metadata, router and worker HTTP, Mooncake's transfer range (never the owner's
    same-host port)."""
    cluster.ready()
    body = _body(392, salt=1806)  # 25 objects over both owners: transfer connections to each
    assert cluster.answer(cluster.router_urls[0], False, body).completion_tokens == 6
    allowed = {PORTS[p] for p in ("master_rpc", "metadata", "r0", "r1", "worker")}
    listening: set[tuple[str, int]] = set()
    connections: set[tuple[str, str, int]] = set()  # (from address, to address, port)
    for host in HOSTS:
        for state, columns in (("listening", (2,)), ("established", (2, 3))):
            argv = ["ss", "-Htn", "state", state]
            out = subprocess.run(cluster.topo[host].argv(argv), capture_output=True, text=True,
                                 check=True, timeout=30).stdout  # fmt: skip
            for line in out.splitlines():
                ends = [_address(line.split()[c]) for c in columns]
                if state == "listening":
                    listening.add((cluster.topo[host].address, ends[0][1]))
                elif ends[0][0] != ends[1][0]:
                    connections.add((ends[0][0], *ends[1]))
    # Keep the side that connected (its peer is a listening port).
    outgoing = {(src, dst, port) for src, dst, port in connections if (dst, port) in listening}
    assert {(src, dst) for src, dst, _ in outgoing} >= {
        (cluster.address("prefill"), cluster.address("owner-a")),
        (cluster.address("decode"), cluster.address("owner-b")),
    }
    for src, dst, port in outgoing:
        in_range = MOONCAKE_PORTS[0] <= port <= MOONCAKE_PORTS[1]
        assert port in allowed or in_range, (src, dst, port)


def _address(text: str) -> tuple[str, int]:
    """("10.231.0.1", 16053) from "10.231.0.1:16053" or "[::ffff:10.231.0.1]:16053"."""
    host, _, port = text.rpartition(":")
    return host.strip("[]").removeprefix("::ffff:"), int(port)


def test_workers_register_and_heartbeat_with_both_routers(cluster: Cluster) -> None:
    cluster.ready()
    fingerprints = set()
    for router_url in cluster.router_urls:
        for inst in cluster.instances(router_url):
            assert (inst["source"], inst["block_size"], inst["model"]) == (
                "registered", BLOCK_SIZE, MODEL)  # fmt: skip
            assert 0.0 <= inst["heartbeat_age_s"] < 2.0
            fingerprints.add(inst["fingerprint"])
    assert len(fingerprints) == 1


def test_either_router_serves_token_exact_and_the_kv_lands_in_both_owners(
    cluster: Cluster,
) -> None:
    cluster.ready()
    before, keys_before = cluster.segments(), cluster.pool_keys()
    body = _body(392, salt=1801)  # 24 full blocks + a partial: each owner gets some
    expected = cluster.answer(cluster.url("mixed"), False, body)
    assert expected.completion_tokens == 6
    for router_url in cluster.router_urls:
        for stream in (False, True):
            assert cluster.answer(router_url, stream, body) == expected, (router_url, stream)
    # P is on host B: the objects in host A's owner crossed the bridge, over Mooncake's TCP.
    after = cluster.segments()
    new_keys = cluster.pool_keys() - keys_before
    assert len(new_keys) == 25  # 24 full blocks and the partial one, written once by P
    grown = {address: after[address] - before[address] for address in after}
    assert set(grown) == {cluster.address("owner-a"), cluster.address("owner-b")}
    assert all(n > 0 for n in grown.values()), grown


def test_losing_host_b_pool_owner_loses_only_its_objects(cluster: Cluster) -> None:
    cluster.ready()
    a, b = cluster.address("owner-a"), cluster.address("owner-b")
    body = _body(392, salt=1802)
    expected = cluster.answer(cluster.url("mixed"), False, body)
    keys_before = cluster.pool_keys()
    assert cluster.answer(cluster.router_urls[0], False, body) == expected
    keys_written = cluster.pool_keys() - keys_before
    segments_before, keys_before = cluster.segments(), cluster.pool_keys()
    assert segments_before[a] > 0 and segments_before[b] > 0
    cluster.procs["owner-b"].kill()
    segments = wait_until(cluster.segments, 60.0, "the master drops host B's segment",
                          done=lambda seen: b not in seen, interval_s=0.2)  # fmt: skip
    assert segments == {a: segments_before[a]}  # host A's objects all stay
    keys_left = cluster.pool_keys()
    lost = keys_before - keys_left
    assert keys_left < keys_before and lost & keys_written, "B held none of the new keys"
    # The same prompt again succeeds, and P writes what the pool lost again (it puts what the
    # pool lacks), now to host A.
    for router_url in cluster.router_urls:
        assert cluster.answer(router_url, True, body) == expected
    assert keys_written <= cluster.pool_keys()
    fresh = _body(100, salt=1803)
    assert cluster.answer(cluster.router_urls[1], False, fresh) == cluster.answer(
        cluster.url("mixed"), False, fresh
    )


def test_one_router_killed_the_other_serves(cluster: Cluster) -> None:
    cluster.ready()
    body = _body(70, salt=1804)
    expected = cluster.answer(cluster.url("mixed"), False, body)
    r0, r1 = cluster.router_urls
    cluster.procs["r0"].kill()
    with pytest.raises(httpx.ConnectError):
        cluster.call(_get, f"{r0}/health")
    assert cluster.answer(r1, True, body) == expected
    assert cluster.answer(r1, False, body) == expected
    # A router started again on its host knows nobody; the workers' heartbeats get 404 and
    # they register with it again.
    cluster.restart("r0")
    wait_until(lambda: cluster.registered(r0), 60.0, "both workers back at the new r0",
               done=lambda seen: seen == cluster.both_registered(), interval_s=0.2)  # fmt: skip
    assert cluster.answer(r0, False, body) == expected


def test_a_restarted_worker_registers_again_with_both_routers(cluster: Cluster) -> None:
    cluster.ready()
    decode = cluster.procs["decode"]
    decode.signal(signal.SIGTERM)  # a clean stop deregisters from each router
    assert decode.popen.wait(timeout=30) == -signal.SIGTERM
    for router_url in cluster.router_urls:
        assert cluster.registered(router_url) == [("prefill", cluster.url("prefill"), True)]
    cluster.restart("decode")
    cluster.ready()
    body = _body(90, salt=1805)
    expected = cluster.answer(cluster.url("mixed"), False, body)
    for router_url in cluster.router_urls:
        assert cluster.answer(router_url, True, body) == expected
