"""D starts with P (early decode, on by default) on a real cluster: master + pool owner, 2 P,
1 D, 1 mixed worker and the router, every one a real process (pdrouter.launch.cluster).

Every prompt goes through P here (--local-prefill-below-tokens 0). The router sends D a
prefetch beside P's prefill; D tokenizes, reserves the prompt's blocks
and reads P's chunk writes as they land; the decode adopts the reservation. Answers equal the
mixed worker's token for token; D read blocks ahead (the race really ran); and every other
end releases what D reserved, to the block: D full (the prefetch refused, the request served
in the usual order), the TTL, a prompt D tokenized otherwise, a client gone while D follows,
a P killed mid-prefill (retried on the other P). A request of n sequences (one group: one
prefill, one decode) adopts its prefetch as a plain request does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from pdrouter.common.auth import internal_headers
from pdrouter.common.proc import freeze
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.cluster_fixture import QUIET_ENV, started_cluster, timeline
from tests.e2e.pd.clients import chat, client, complete, prompt_ids
from tests.metrics_scrape import metrics_of
from tests.wait import wait_until
from workers.pool.keys import block_keys, shard_key

MODEL = "tiny"
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 256
MAX_FRACTION = 0.5  # --prefetch-max-fraction: 128 blocks may wait reserved
TTL_S = 6.0  # --prefetch-ttl-s
CHUNK_TOKENS = 64  # --max-num-batched-tokens: a long prompt is prefilled in chunks
LONG = 1500  # tokens: 24 chunks, 94 blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir) -> Iterator[Cluster]:
    worker_args = (
        "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--max-model-len", "2048", "--max-num-batched-tokens", str(CHUNK_TOKENS),
        "--model-cache-dir", str(tiny_cache_dir), "--staging-slots", "64",
        "--transfer-batch-blocks", "8", "--prefetch-max-fraction", str(MAX_FRACTION),
        "--prefetch-ttl-s", str(TTL_S),
    )  # fmt: skip
    spec = ClusterSpec(
        model=MODEL, num_prefill=2, num_decode=1, num_mixed=1, pool_size="256MiB",
        worker_args=worker_args, env=QUIET_ENV,
        router_args=("--health-interval-s", "0.5", "--local-prefill-below-tokens", "0"),
        log_dir=str(tmp_path_factory.mktemp("early-logs")), startup_timeout_s=240.0,
    )  # fmt: skip
    yield from started_cluster(spec)


def d_url(c: Cluster) -> str:
    return c.decode_urls[0]


def outcome(c: Cluster, name: str) -> float:
    return metrics_of(d_url(c))[f'pdworker_prefetch_total{{outcome="{name}"}}']


def wait_d_idle(c: Cluster, timeout_s: float = 30.0) -> dict[str, float]:
    """D holds no block, reserves none, runs nothing: its metrics then."""

    def idle(m: dict[str, float]) -> bool:
        busy = m["pdworker_num_requests_running"] + m["pdworker_num_requests_waiting"]
        return m["pdworker_kv_blocks_used"] + m["pdworker_prefetch_reserved_blocks"] + busy == 0

    return wait_until(lambda: metrics_of(d_url(c)), timeout_s, "D idle", done=idle)


def prefetch(c: Cluster, request_id: str, prompt: list[int]) -> httpx.Response:
    """A prefetch straight to D, as the router sends one."""
    body = {"request_id": request_id, "endpoint": "completions",
            "body": {"model": MODEL, "prompt": prompt, "max_tokens": 4}}  # fmt: skip
    return httpx.post(f"{d_url(c)}/internal/prefetch", json=body, timeout=30,
                      headers=internal_headers(c.internal_secret))  # fmt: skip


def greedy(prompt: list[int], max_tokens: int = 6) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_answers_equal_the_mixed_worker_and_d_reads_ahead(cluster: Cluster, stream: bool) -> None:
    router, mixed = client(cluster.router_url), client(cluster.mixed_urls[0])
    ended = ("adopted", "cancelled", "refused")
    before = {name: outcome(cluster, name) for name in ended}
    ahead = []
    for n, num_tokens in enumerate((5, 16, 100, 700, LONG)):
        body = greedy(prompt_ids(num_tokens, salt=1000 + 10 * n + stream))
        rid = f"eq-{int(stream)}-{n}"
        pd = complete(router, stream, **body, extra_headers={"X-Request-Id": rid})
        assert pd == complete(mixed, False, **body), (num_tokens, stream)
        ahead.append(timeline(cluster, rid)["decode"]["num_blocks_loaded_ahead"])
    messages = [{"role": "user", "content": "early " * 60}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    assert chat(router, stream, **kwargs) == chat(mixed, False, **kwargs)
    # Each of the 6 prefetches ended once: adopted by its decode, or, for a prompt so short
    # that P answered before the router's prefetch task reached D (a loaded machine), taken
    # back (came while D prepared it) or refused (came after the decode).
    got = {name: outcome(cluster, name) - before[name] for name in ended}
    assert sum(got.values()) == 6 and got["adopted"] >= 1, got
    # The long prompts' chunks were read while P still computed later ones.
    # (None: that decode adopted no prefetch.)
    assert ahead[4] > 0 and sum(n is not None for n in ahead) <= got["adopted"], ahead
    assert wait_d_idle(cluster)["pdworker_kv_blocks_used"] == 0


def test_d_full_refuses_and_the_request_is_served_in_the_usual_order(cluster: Cluster) -> None:
    held = []
    for n in range(3):  # 94 + 94 > 128 blocks: the second is refused
        resp = prefetch(cluster, f"fill-{n}", prompt_ids(LONG, salt=2000 + n))
        held.append((f"fill-{n}", resp.status_code))
        if resp.status_code != 202:
            break
    assert [status for _, status in held] == [202, 503]
    assert resp.json()["error"]["code"] == "prefetch_full"
    assert metrics_of(d_url(cluster))["pdworker_prefetch_reserved_blocks"] == 94
    body = greedy(prompt_ids(LONG, salt=2100))
    pd = complete(client(cluster.router_url), True, **body, extra_headers={"X-Request-Id": "full"})
    assert pd == complete(client(cluster.mixed_urls[0]), False, **body)
    events = timeline(cluster, "full")["events"]
    assert [e["status"] for e in events if e["event"] == "prefetch_answered"] == [503]
    assert timeline(cluster, "full")["decode"]["num_blocks_loaded_ahead"] is None
    gone = httpx.delete(f"{d_url(cluster)}/internal/prefetch/fill-0", timeout=30,
                        headers=internal_headers(cluster.internal_secret))  # fmt: skip
    assert gone.status_code == 204
    assert wait_d_idle(cluster)["pdworker_kv_blocks_used"] == 0


def test_a_reservation_nobody_adopts_expires(cluster: Cluster) -> None:
    expired = outcome(cluster, "expired")
    assert (
        prefetch(cluster, "orphan", prompt_ids(300, salt=3000)).json()["num_blocks_reserved"] == 19
    )
    assert metrics_of(d_url(cluster))["pdworker_prefetch_reserved_blocks"] == 19
    wait_d_idle(cluster, timeout_s=TTL_S + 20)
    assert outcome(cluster, "expired") == expired + 1


def test_a_prompt_d_tokenized_otherwise_is_not_used(cluster: Cluster) -> None:
    mismatched = outcome(cluster, "mismatched")
    assert prefetch(cluster, "mm-1", prompt_ids(200, salt=4000)).status_code == 202
    # The router's own prefetch of mm-1 is refused (D holds one); the decode brings P's
    # tokens of another prompt: D drops the reservation and loads the usual way.
    body = greedy(prompt_ids(200, salt=4001))
    pd = complete(client(cluster.router_url), False, **body, extra_headers={"X-Request-Id": "mm-1"})
    assert pd == complete(client(cluster.mixed_urls[0]), False, **body)
    assert outcome(cluster, "mismatched") == mismatched + 1
    assert timeline(cluster, "mm-1")["decode"]["num_blocks_loaded_ahead"] is None
    assert wait_d_idle(cluster)["pdworker_kv_blocks_used"] == 0


def stopped(c: Cluster) -> list[int]:
    """Both P stopped (SIGSTOP): a prefill sent now waits, D's prefetch follows in vain."""
    pids = [c.child(f"prefill-{i}").proc.pid for i in range(2)]
    freeze(pids)
    return pids


def test_a_client_gone_while_d_follows_releases_the_reservation(cluster: Cluster) -> None:
    cancelled = outcome(cluster, "cancelled")
    body = json.dumps({**greedy(prompt_ids(LONG, salt=5000)), "stream": True}).encode()
    host, port = urlsplit(cluster.router_url).hostname, urlsplit(cluster.router_url).port
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nX-Request-Id: gone\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    pids = stopped(cluster)
    try:
        # A raw socket: the answer's head waits for P's first token, which never comes.
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(head.encode() + body)
            # Both gauges: D counts a reservation's blocks before it awaits their allocation
            # (so that concurrent ones see them), and a scrape may land in between.
            wait_until(lambda: metrics_of(d_url(cluster)), 20, "D reserved the prompt",
                       done=lambda m: (m["pdworker_prefetch_reserved_blocks"],
                                       m["pdworker_kv_blocks_used"]) == (94, 94))  # fmt: skip
        # the client left before P answered
        wait_until(lambda: outcome(cluster, "cancelled"), 20, "the reservation released",
                   done=lambda n: n == cancelled + 1)  # fmt: skip
        assert wait_d_idle(cluster)["pdworker_kv_blocks_used"] == 0
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    wait_until(lambda: timeline(cluster, "gone")["status"], 20, "the request ended",
               done=lambda status: status == 499)  # fmt: skip
    wait_until(lambda: httpx.get(f"{cluster.router_url}/health").json()["num_prefill_healthy"],
               30, "both P healthy again", done=lambda n: n == 2)  # fmt: skip


ROUTER_ADOPTED = 'pdrouter_prefetch_total{outcome="adopted"}'
ROUTER_RELEASED = 'pdrouter_prefetch_total{outcome="released"}'


def _choices(base_url: str, body: dict, request_id: str) -> list[str]:
    resp = client(base_url).completions.create(**body, extra_headers={"X-Request-Id": request_id})
    return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]


def test_a_group_adopts_its_requests_prefetch(cluster: Cluster) -> None:
    """n=3 over one prompt: the group's one decode adopts the prefetch the router sent
    beside its one prefill. Both P are held (SIGSTOP) until D has reserved the prompt's
    blocks, so the prefetch cannot come after the decode; then D follows P's chunk writes."""
    body = {"model": MODEL, "prompt": prompt_ids(LONG, salt=7000), "n": 3, "max_tokens": 4,
            "temperature": 0.8, "seed": 21}  # fmt: skip
    expected = _choices(cluster.mixed_urls[0], body, "group-mixed")
    adopted = outcome(cluster, "adopted")
    router_before = metrics_of(cluster.router_url)
    result: dict = {}
    sender = threading.Thread(
        target=lambda: result.update(answer=_choices(cluster.router_url, body, "group-ahead"))
    )
    pids = stopped(cluster)
    try:
        sender.start()
        wait_until(lambda: metrics_of(d_url(cluster)), 20, "D reserved the prompt",
                   done=lambda m: m["pdworker_prefetch_reserved_blocks"] == 94)  # fmt: skip
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    sender.join(120)
    assert result["answer"] == expected and len(set(expected)) == 3
    assert outcome(cluster, "adopted") == adopted + 1
    assert timeline(cluster, "group-ahead")["decode"]["num_blocks_loaded_ahead"] > 0
    # The router saw the group's decode adopt it (counted at the request's end): no release.
    wait_until(lambda: timeline(cluster, "group-ahead")["status"], 10, "the request's end",
               done=lambda status: status == 200)  # fmt: skip
    router = metrics_of(cluster.router_url)
    assert [router[k] - router_before[k] for k in (ROUTER_ADOPTED, ROUTER_RELEASED)] == [1, 0]
    assert wait_d_idle(cluster)["pdworker_kv_blocks_used"] == 0
    wait_until(lambda: httpx.get(f"{cluster.router_url}/health").json()["num_prefill_healthy"],
               30, "both P healthy again", done=lambda n: n == 2)  # fmt: skip


def test_a_batch_or_an_echoed_request_sends_no_prefetch(cluster: Cluster) -> None:
    """Their sub-requests decode under ids of their own: a reservation would wait unadopted
    until the request ends, so none is made."""
    prompts = [prompt_ids(200, salt=7100), prompt_ids(200, salt=7101)]
    bodies = {"batch": {"prompt": prompts}, "echo": {"prompt": prompts[0], "echo": True, "n": 2}}
    for name, body in bodies.items():
        answer = client(cluster.router_url).completions.create(
            model=MODEL, max_tokens=3, **body, extra_headers={"X-Request-Id": f"no-pf-{name}"}
        )
        assert len(answer.choices) == 2
        events = [e["event"] for e in timeline(cluster, f"no-pf-{name}")["events"]]
        assert events[-1] == "end" and "prefetch_sent" not in events, events
    assert wait_d_idle(cluster)["pdworker_prefetch_reserved_blocks"] == 0


def _stopped_mid_write(cluster: Cluster, body: dict, request_id: str) -> tuple[int, dict, object]:
    """Send body and stop (SIGSTOP) the P it went to once its first chunks are in the pool and
    its writes are not all done: (that P's index, the client's result holder, the sender
    thread). (-1, ...) when P had written every block by the time it was stopped: the race
    this test needs did not happen (it was resumed and the request ended)."""
    fingerprint = httpx.get(f"{cluster.router_url}/health").json()["fingerprint"]
    keys = {shard_key(k, 0, 2, 2) for k in block_keys(fingerprint, body["prompt"], BLOCK_SIZE)}
    result: dict = {}

    def run() -> None:
        api = client(cluster.router_url)
        result["answer"] = complete(api, True, **body, extra_headers={"X-Request-Id": request_id})

    def written() -> int:  # of the prompt's keys, those the pool holds (P writes chunk by chunk)
        text = httpx.get(f"{cluster.master_admin_url}/get_all_keys", timeout=10).text
        return len(keys & {line.strip() for line in text.splitlines()})

    sender = threading.Thread(target=run)
    sender.start()
    wait_until(written, 30, "P's first chunks written", done=lambda n: n >= 8, interval_s=0.002)
    sent = [e["url"] for e in timeline(cluster, request_id)["events"]
            if e["event"] == "prefill_sent"]  # fmt: skip
    assert len(sent) == 1
    victim = cluster.prefill_urls.index(sent[0])
    proc = cluster.child(f"prefill-{victim}").proc
    proc.freeze()  # frozen: what the pool holds now is what P leaves behind
    try:
        if written() < len(keys):
            return victim, result, sender
    except BaseException:
        proc.signal(signal.SIGCONT)
        raise
    proc.signal(signal.SIGCONT)
    sender.join(120)
    return -1, result, sender


def test_a_prefill_killed_mid_chunk_is_retried_and_nothing_leaks(cluster: Cluster) -> None:
    before = metrics_of(d_url(cluster))
    for salt in (6000, 6001, 6002):  # a new prompt while P outran the stop (load decides)
        body = greedy(prompt_ids(2000, salt=salt), max_tokens=4)
        expected = complete(client(cluster.mixed_urls[0]), False, **body)
        request_id = f"killed-{salt}"
        victim, result, sender = _stopped_mid_write(cluster, body, request_id)
        if victim >= 0:
            break
        before = metrics_of(d_url(cluster))
    assert victim >= 0, "P wrote every block before it could be stopped, three times"
    cluster.child(f"prefill-{victim}").proc.kill()
    sender.join(120)  # type: ignore[attr-defined]
    assert result["answer"] == expected
    t = timeline(cluster, request_id)
    assert [e["event"] for e in t["events"]].count("prefill_sent") == 2  # retried
    assert t["decode"]["num_blocks_loaded_ahead"] > 0
    after = wait_d_idle(cluster)
    assert after["pdworker_kv_blocks_used"] == 0
    assert after['pdworker_prefetch_total{outcome="adopted"}'] == (
        before['pdworker_prefetch_total{outcome="adopted"}'] + 1
    )
    reports: list[str] = []
    assert cluster.check(report=reports.append) is None  # restarts the killed P
    assert reports and reports[0].startswith(f"prefill-{victim} died")
