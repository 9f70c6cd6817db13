"""An urgent request through a cluster full of low-priority streams, across real processes
(master + pool owner + 1 P + 1 D + router): the router's --max-in-flight 2 held by two low
streams and D's two engine seats (--max-num-seqs 2) taken by them.

    a third low request          429 at once (the limit is full, no queue)
    the urgent one (X-Priority)  admitted in the router's --urgent-reserve; the priority
                                 spliced into the body reaches D, whose engine preempts the
                                 newest low stream for it; it ends first
    the low streams              end intact: token for token what each streams unloaded
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.cluster_fixture import QUIET_ENV, THROUGH_P, started_cluster
from tests.metrics_scrape import metrics_of

LOW_TOKENS, HIGH_TOKENS = 400, 8
PREEMPTIONS = "pdworker_num_preemptions_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path) -> Iterator[Cluster]:
    spec = ClusterSpec(
        model="tiny",
        num_prefill=1,
        num_decode=1,
        pool_size="64MiB",
        worker_args=("--block-size=16", "--num-kv-blocks=96", "--max-model-len=512",
                     "--max-num-seqs=2", f"--model-cache-dir={tiny_cache_dir}"),
        router_args=(*THROUGH_P, "--health-interval-s=0.5", "--max-in-flight=2",
                     "--urgent-reserve=1"),
        env=QUIET_ENV,
        log_dir=str(tmp_path_factory.mktemp("priority-logs")),
        startup_timeout_s=240.0,
    )  # fmt: skip
    yield from started_cluster(spec)


class Stream:
    """One streamed completion: its text, and events for its first token and its end."""

    def __init__(self, url: str, body: dict, headers: dict[str, str] | None = None) -> None:
        self.url, self.body, self.headers = url, body, headers or {}
        self.text = ""
        self.status: int | None = None
        self.started = threading.Event()
        self.ended = threading.Event()

    def run(self) -> Stream:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body,
                              headers=self.headers, timeout=120) as resp:  # fmt: skip
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.text += json.loads(line[6:])["choices"][0]["text"]
                        self.started.set()
        finally:
            self.started.set()
            self.ended.set()
        return self


def body(prompt: str, max_tokens: int, priority: int | None = None) -> dict:
    out = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": True, "stream": True}  # fmt: skip
    if priority is not None:
        out["priority"] = priority
    return out


def test_an_urgent_request_passes_low_streams_that_end_intact(cluster: Cluster) -> None:
    url, d_url = cluster.router_url, cluster.decode_urls[0]
    lows = [body(f"low stream {i}: once upon a time", LOW_TOKENS, priority=5) for i in (1, 2)]
    high = body("urgent: the answer is", HIGH_TOKENS)  # its priority in the header
    urgent = {"X-Priority": "-1"}
    unloaded = [Stream(url, b).run().text for b in lows]
    unloaded_high = Stream(url, high, urgent).run().text
    assert all(unloaded) and unloaded_high
    before = metrics_of(d_url)[PREEMPTIONS]

    streams = [Stream(url, b) for b in lows]
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(s.run) for s in streams]
        for s in streams:
            assert s.started.wait(60), "a low stream never started"
        refused = httpx.post(f"{url}/v1/completions", json={**lows[0], "stream": False})
        assert (refused.status_code, refused.json()["error"]["code"]) == (429, "overloaded")
        urgent_stream = Stream(url, high, urgent).run()
        still_streaming = [not s.ended.is_set() for s in streams]
        for f in futures:
            f.result()
    assert (urgent_stream.status, urgent_stream.text) == (200, unloaded_high)
    assert still_streaming == [True, True]  # it passed both low streams
    assert [(s.status, s.text) for s in streams] == [(200, text) for text in unloaded]
    # D's engine preempted one low stream (its newest) for the urgent request: its priority
    # came from the header through the router's body to D
    assert metrics_of(d_url)[PREEMPTIONS] - before == 1
