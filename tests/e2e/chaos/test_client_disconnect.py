"""A client that walks away at each stage: while P computes, after P's first token while D has
not answered yet, and in the middle of D's stream (streamed and not). The router must drop the
request at once (not after a hop timeout), the worker holding it must abort it, and no KV block
may stay allocated anywhere."""

from __future__ import annotations

import signal

import pytest

from pdrouter.launch.cluster import Cluster
from tests.e2e.chaos.conftest import MODEL, assert_nothing_held, instance_state
from tests.e2e.chaos.raw_client import RawRequest
from tests.e2e.pd.clients import prompt_ids
from tests.metrics_scrape import metrics_of
from tests.wait import wait_until

pytestmark = pytest.mark.slow

ABORTED = 'pdworker_requests_total{endpoint="%s",status="aborted"}'
DECODE_TIMEOUTS = 'pdrouter_stage_failures_total{kind="ReadTimeout",stage="decode"}'
R499 = 'pdrouter_requests_total{endpoint="completions",status="499"}'
PREFILL_ATTEMPTS = 3


def _sum(urls: list[str], key: str) -> float:
    return sum(metrics_of(url).get(key, 0) for url in urls)


def _busy(url: str) -> bool:
    m = metrics_of(url)
    return m["pdworker_num_requests_running"] + m["pdworker_num_requests_waiting"] > 0


def _decode_work(c: Cluster) -> float:
    """Decode streams ended plus pool blocks loaded, over every D: grows with any decode call."""
    total = 0.0
    for url in c.decode_urls:
        for key, value in metrics_of(url).items():
            if key.startswith('pdworker_requests_total{endpoint="decode"'):
                total += value
            if key == "pdworker_pool_blocks_loaded_total":
                total += value
    return total


def _router_holds(c: Cluster) -> float:
    return metrics_of(c.router_url)["pdrouter_requests_in_progress"]


def _completions(c: Cluster) -> str:
    return f"{c.router_url}/v1/completions"


def _p_computing(c: Cluster, req: RawRequest) -> str | None:
    """ "computing" while a P holds a request, "answered" once the client's answer began (its
    first token or an error), else None."""
    if any(_busy(u) for u in c.prefill_urls):
        return "computing"
    return "answered" if req.peek() else None


def _leave_once_p_computes(c: Cluster, salt: int) -> tuple[str, bytes]:
    """Send a 1900-token prompt (~60 prefill steps of 32 tokens) and walk away once a P is
    seen computing it, or once the answer began: (what was seen, the answer's bytes so far)."""
    body = {"model": MODEL, "prompt": prompt_ids(1900, salt=salt), "max_tokens": 50,
            "temperature": 0, "stream": True}  # fmt: skip
    req = RawRequest(_completions(c), body)
    try:
        seen = wait_until(lambda: _p_computing(c, req), 10.0,
                          "P computing or the answer's first bytes", interval_s=0.0)  # fmt: skip
        return seen, req.peek()
    finally:
        req.close()


def test_disconnect_while_prefill_computes_aborts_it_on_p(cluster: Cluster) -> None:
    # On a loaded machine a prefill can end between two polls of P's /metrics: the answer then
    # begins, that attempt proves nothing, and the next one tries again with a new prompt (the
    # race must be seen to happen).
    for attempt in range(PREFILL_ATTEMPTS):
        p_aborted = _sum(cluster.prefill_urls, ABORTED % "prefill")
        d_work = _decode_work(cluster)
        r499_before = metrics_of(cluster.router_url).get(R499, 0)
        seen, answer = _leave_once_p_computes(cluster, salt=20 + 1000 * attempt)
        wait_until(lambda: _router_holds(cluster) == 0, 5.0, "the router to drop the request")
        if seen == "computing":
            break
        assert answer.startswith(b"HTTP/1.1 200"), answer[:500]  # P finished first: again
        assert_nothing_held(cluster)
    else:
        raise AssertionError(f"P was never seen computing in {PREFILL_ATTEMPTS} attempts")
    wait_until(
        lambda: _sum(cluster.prefill_urls, ABORTED % "prefill") == p_aborted + 1,
        5.0,
        "P to abort the prefill",
    )
    assert _decode_work(cluster) == d_work, "D was called for a request whose client had left"
    assert metrics_of(cluster.router_url)[R499] == r499_before + 1
    assert_nothing_held(cluster)


def test_disconnect_between_p_and_d_releases_the_request_without_waiting_for_d(
    cluster: Cluster,
) -> None:
    """Both D frozen: the router has P's first token and waits on D. The client leaves; the
    router must let go at once (no decode timeout recorded), and the D, once thawed, must
    drop the request it finds abandoned."""
    body = {"model": MODEL, "prompt": prompt_ids(40, salt=21), "max_tokens": 50,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    timeouts_before = metrics_of(cluster.router_url).get(DECODE_TIMEOUTS, 0)
    decodes = [cluster.child(f"decode-{i}").proc for i in range(len(cluster.decode_urls))]
    for proc in decodes:
        proc.freeze()
    try:
        req = RawRequest(_completions(cluster), body)
        try:
            req.read_until(b"data: ", 1, timeout_s=10.0)  # P's first token reached the client

            def waiting_on_d() -> bool:
                m = metrics_of(cluster.router_url)
                return any(
                    m.get(f'pdrouter_instance_in_flight{{role="decode",url="{u}"}}', 0) == 1
                    for u in cluster.decode_urls
                )

            wait_until(waiting_on_d, 2.0, "the router to call a D")
        finally:
            req.close()
        wait_until(lambda: _router_holds(cluster) == 0, 2.0, "the router to drop the request")
        assert metrics_of(cluster.router_url).get(DECODE_TIMEOUTS, 0) == timeouts_before
    finally:
        for proc in decodes:
            proc.signal(signal.SIGCONT)
    for url in cluster.decode_urls:
        wait_until(lambda u=url: instance_state(cluster, u)["healthy"], 10.0, f"{url} healthy")
    assert_nothing_held(cluster)


def test_disconnect_mid_decode_stream_aborts_it_on_d(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": prompt_ids(40, salt=22), "max_tokens": 400,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    d_aborted = _sum(cluster.decode_urls, ABORTED % "decode")
    req = RawRequest(_completions(cluster), body)
    try:
        req.read_until(b"data: ", 4, timeout_s=20.0)  # P's token and some of D's
        assert any(_busy(u) for u in cluster.decode_urls)
    finally:
        req.close()
    wait_until(lambda: _router_holds(cluster) == 0, 5.0, "the router to drop the request")
    wait_until(
        lambda: _sum(cluster.decode_urls, ABORTED % "decode") == d_aborted + 1,
        5.0,
        "D to abort the stream",
    )
    assert_nothing_held(cluster)


def test_disconnect_mid_decode_of_a_non_streamed_request_aborts_it_on_d(
    cluster: Cluster,
) -> None:
    body = {"model": MODEL, "prompt": prompt_ids(40, salt=23), "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    d_aborted = _sum(cluster.decode_urls, ABORTED % "decode")
    r499_before = metrics_of(cluster.router_url).get(R499, 0)
    req = RawRequest(_completions(cluster), body)
    try:
        wait_until(
            lambda: any(_busy(u) for u in cluster.decode_urls), 20.0, "D decoding", interval_s=0.0
        )
    finally:
        req.close()
    wait_until(lambda: _router_holds(cluster) == 0, 5.0, "the router to drop the request")
    wait_until(
        lambda: _sum(cluster.decode_urls, ABORTED % "decode") == d_aborted + 1,
        5.0,
        "D to abort the request",
    )
    assert metrics_of(cluster.router_url)[R499] == r499_before + 1
    assert_nothing_held(cluster)
