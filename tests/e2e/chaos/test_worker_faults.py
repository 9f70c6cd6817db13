"""Workers failing under a live request: a P killed in the middle of its prefill, a D killed or
frozen (SIGSTOP) in the middle of its stream. The client's answer must be the undisturbed one,
token for token, within a bound; afterwards nothing is held anywhere."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from pdrouter.common.proc import wait_for_http
from pdrouter.launch.cluster import Cluster
from tests.e2e.chaos.conftest import (
    DECODE_TIMEOUT_S,
    MODEL,
    assert_nothing_held,
    instance_state,
    restart_dead,
)
from tests.e2e.cluster_fixture import timeline
from tests.e2e.pd.clients import Answer, client, complete, prompt_ids
from tests.metrics_scrape import metrics_of
from tests.sse import DONE, iter_sse_data
from tests.wait import wait_until

pytestmark = pytest.mark.slow

LONG_PROMPT_TOKENS = 1900  # prefill of ~60 chunked steps: long enough to be killed midway


def _busy(url: str) -> bool:
    m = metrics_of(url)
    return m["pdworker_num_requests_running"] + m["pdworker_num_requests_waiting"] > 0


def _stream(c: Cluster, body: dict, on_chunk) -> Answer:
    """A streamed completion through the router; on_chunk(i) runs after chunk i arrives."""
    texts, finish, usage = [], None, None
    with client(c.router_url).completions.create(
        stream=True, stream_options={"include_usage": True}, **body
    ) as stream:
        for i, chunk in enumerate(stream):
            for choice in chunk.choices:
                texts.append(choice.text)
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
            on_chunk(i)
    assert usage is not None
    return Answer("".join(texts), finish, usage.prompt_tokens, usage.completion_tokens)


def test_prefill_killed_during_its_prefill_is_retried_on_the_other_p(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": prompt_ids(LONG_PROMPT_TOKENS, salt=1), "max_tokens": 6,
            "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    retries_before = metrics_of(cluster.router_url).get(
        'pdrouter_retries_total{stage="prefill"}', 0
    )
    answers: list[Answer] = []
    worker = threading.Thread(
        target=lambda: answers.append(complete(client(cluster.router_url), False, **body))
    )
    worker.start()
    try:
        victim: list[int] = []

        def in_prefill() -> bool:
            victim[:] = [i for i, url in enumerate(cluster.prefill_urls) if _busy(url)]
            return bool(victim)

        wait_until(in_prefill, 10.0, "a prefill worker computing the long prompt", interval_s=0.0)
        cluster.child(f"prefill-{victim[0]}").proc.kill()
    finally:
        worker.join(timeout=60)
    assert not worker.is_alive(), "the request hung after its P was killed"
    m = metrics_of(cluster.router_url)
    assert m['pdrouter_retries_total{stage="prefill"}'] == retries_before + 1
    # The reference answer after the fact: asked first, the prompt would be in the pool and
    # the killed request's prefill a pool read too short to be caught.
    assert answers == [complete(client(cluster.router_url), False, **body)]
    dead_url = cluster.prefill_urls[victim[0]]
    assert not instance_state(cluster, dead_url)["healthy"]
    restart_dead(cluster, f"prefill-{victim[0]}")
    assert_nothing_held(cluster)


def _halt_decode_mid_stream(c: Cluster, request_id: str, kill: bool) -> list[int]:
    """With every D stopped (SIGSTOP), halt the one streaming request_id if it has not sent
    its final event yet: killed (kill) or left stopped; [its index], or [] when it had already
    finished (D outran the client: nothing to halt mid-stream). The others go on."""
    procs = [c.child(f"decode-{i}").proc for i in range(len(c.decode_urls))]
    for proc in procs:
        proc.freeze()
    victim = -1
    try:
        t = timeline(c, request_id)
        sent = [e["url"] for e in t["events"] if e["event"] == "decode_sent"]
        assert len(sent) == 1, t
        if t["decode"] is None:  # D's final event is not in: the stream goes on on D
            victim = c.decode_urls.index(sent[0])
            if kill:
                procs[victim].kill()
    finally:
        for k, proc in enumerate(procs):
            if k != victim or kill:
                proc.signal(signal.SIGCONT)
    return [victim] if victim >= 0 else []


def _halted_stream(c: Cluster, salts: tuple[int, ...], kill: bool) -> tuple[Answer, Answer, int]:
    """(the undisturbed answer, the answer of the same request whose D was halted after the
    client's second chunk, that D's index); a new prompt while D outran the client (load
    decides). A D left stopped stays stopped: the caller resumes it."""
    for salt in salts:
        body = {"model": MODEL, "prompt": prompt_ids(40, salt=salt), "max_tokens": 300,
                "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
        undisturbed = _stream(c, body, lambda i: None)
        assert undisturbed.completion_tokens == 300
        request_id = f"halted-{salt}"
        victim: list[int] = []

        def halt_after_second_chunk(
            i: int, request_id: str = request_id, victim: list[int] = victim
        ) -> None:
            if i == 1:
                victim.extend(_halt_decode_mid_stream(c, request_id, kill))

        try:
            answer = _stream(c, {**body, "extra_headers": {"X-Request-Id": request_id}},
                             halt_after_second_chunk)  # fmt: skip
        except BaseException:
            for k in victim if not kill else ():
                c.child(f"decode-{k}").proc.signal(signal.SIGCONT)
            raise
        if victim:
            return undisturbed, answer, victim[0]
    raise AssertionError(f"D finished every stream before the client's second chunk: {salts}")


def test_decode_killed_mid_stream_completes_token_for_token(cluster: Cluster) -> None:
    failovers_key = 'pdrouter_failovers_total{stage="decode"}'
    failovers_before = metrics_of(cluster.router_url).get(failovers_key, 0)
    undisturbed, answer, victim = _halted_stream(cluster, (2, 12, 22), kill=True)
    assert answer == undisturbed
    # The stream moved once, mid-stream (a failover, not a retry before any output).
    assert metrics_of(cluster.router_url)[failovers_key] == failovers_before + 1
    restart_dead(cluster, f"decode-{victim}")
    assert_nothing_held(cluster)


def test_frozen_decode_mid_stream_is_left_for_another_and_frees_its_blocks(
    cluster: Cluster,
) -> None:
    """SIGSTOP: the D neither answers nor closes. When its health checks fail (or at the
    router's event bound, whichever comes first) the stream resumes elsewhere; when the D wakes
    up, its request is gone and so are its blocks."""
    left_keys = [f'pdrouter_stage_failures_total{{kind="{kind}",stage="decode"}}'
                 for kind in ("ReadTimeout", "InstanceDown")]  # fmt: skip

    def times_left() -> float:
        metrics = metrics_of(cluster.router_url)
        return sum(metrics.get(key, 0) for key in left_keys)

    left_before = times_left()
    undisturbed, answer, frozen = _halted_stream(cluster, (3, 13, 23), kill=False)
    frozen_url = cluster.decode_urls[frozen]
    try:
        # While frozen, health checks time out: the router stops sending it work.
        wait_until(lambda: not instance_state(cluster, frozen_url)["healthy"], 5.0, "down")
    finally:
        cluster.child(f"decode-{frozen}").proc.signal(signal.SIGCONT)
    assert answer == undisturbed
    assert times_left() == left_before + 1  # the frozen D was left once
    wait_until(lambda: instance_state(cluster, frozen_url)["healthy"], 10.0, "healthy again")
    assert_nothing_held(cluster)


def test_frozen_decode_before_its_first_byte_moves_requests_to_the_other(
    cluster: Cluster,
) -> None:
    """Requests sent right after a D freezes: those it accepted are given up (its health
    checks fail, or the first event's bound passes) and go to the other D (its blocks are in
    the pool: nothing recomputed); none hangs."""
    bodies = [
        {
            "model": MODEL,
            "prompt": prompt_ids(33, salt=10 + i),
            "max_tokens": 5,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        for i in range(4)
    ]
    expected = [complete(client(cluster.router_url), False, **b) for b in bodies]
    recomputed_key = "pdrouter_recomputed_prompt_tokens_total"
    recomputed_before = metrics_of(cluster.router_url).get(recomputed_key, 0)
    frozen = cluster.child("decode-0").proc
    frozen.freeze()
    try:
        answers: list[Answer | None] = [None] * len(bodies)

        def send(i: int) -> None:
            answers[i] = complete(client(cluster.router_url), False, **bodies[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=4 * DECODE_TIMEOUT_S + 30)
        assert not any(t.is_alive() for t in threads), "a request hung on the frozen D"
    finally:
        frozen.signal(signal.SIGCONT)
    assert answers == expected
    assert metrics_of(cluster.router_url).get(recomputed_key, 0) == recomputed_before
    url = cluster.decode_urls[0]
    wait_until(lambda: instance_state(cluster, url)["healthy"], 10.0, f"{url} healthy again")
    assert_nothing_held(cluster)
    assert httpx.get(f"{cluster.router_url}/health", timeout=5).json()["num_decode_healthy"] == 2


def test_every_decode_dead_mid_stream_ends_the_stream_with_an_error_then_503(
    cluster: Cluster,
) -> None:
    """No D left: the stream already sent (200) ends with an error event naming the decode
    stage and [DONE], at once; the next request is refused with 503 + Retry-After before any
    P works on it. Both D restarted, the cluster serves again."""
    body = {"model": MODEL, "prompt": prompt_ids(40, salt=4), "max_tokens": 300,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    events: list[str] = []
    with httpx.stream(
        "POST", f"{cluster.router_url}/v1/completions", json=body, timeout=60
    ) as resp:
        assert resp.status_code == 200
        for data in iter_sse_data(resp):
            events.append(data)
            if len(events) == 2:
                for i in range(len(cluster.decode_urls)):
                    cluster.child(f"decode-{i}").proc.kill()
    assert events[-1] == DONE
    error = json.loads(events[-2])["error"]
    assert error["message"].startswith("decode failed on every instance tried ("), error
    assert all("error" not in json.loads(e) for e in events[:-2])

    served_key = 'pdworker_requests_total{endpoint="prefill",status="success"}'
    served = [metrics_of(u).get(served_key, 0) for u in cluster.prefill_urls]
    resp = httpx.post(
        f"{cluster.router_url}/v1/completions", json={**body, "stream": False}, timeout=30
    )
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["message"].startswith("no decode instance reachable (")
    assert [metrics_of(u).get(served_key, 0) for u in cluster.prefill_urls] == served

    reports: list[str] = []
    assert cluster.check(report=reports.append) is None
    assert sorted(r.split(";")[0] for r in reports) == [
        "decode-0 died (exit code -9)",
        "decode-1 died (exit code -9)",
    ]
    for i, url in enumerate(cluster.decode_urls):
        wait_for_http(f"{url}/health", 120.0, proc=cluster.child(f"decode-{i}").proc)
        wait_until(lambda u=url: instance_state(cluster, u)["healthy"], 10.0, f"{url} back")
    again = {k: v for k, v in body.items() if k not in ("stream", "ignore_eos")}
    answer = complete(client(cluster.router_url), False, **{**again, "max_tokens": 4},
                      extra_body={"ignore_eos": True})  # fmt: skip
    assert (answer.completion_tokens, answer.finish_reason) == (4, "length")
    assert_nothing_held(cluster)
