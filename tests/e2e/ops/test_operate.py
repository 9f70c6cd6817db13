"""The operator's view across real processes: master + pool owner + 1 P + 1 D + router
(`pdrouter.launch.cluster.Cluster`), every server exporting its spans over OTLP/HTTP to a
collector this module runs on a loopback port (tests/otlp_collector.py), the router serving
an API keys file.

    one trace    the client's traceparent continued by the router, P's and D's spans under
                 the router's attempt spans, attributes exact
    dashboard    every metric examples/grafana/pdrouter.json queries is one the router or a
                 worker exports (read from their /metrics)
    keys file    reloaded on SIGHUP; a key past its limit gets its 429
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdrouter.common.tracing import span_id
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.cluster_fixture import QUIET_ENV, THROUGH_P, started_cluster
from tests.otlp_collector import Collector, Span
from tests.wait import wait_until

DASHBOARD = Path(__file__).parents[3] / "examples" / "grafana" / "pdrouter.json"
KEY = "sk-ops-team"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def keys_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ops-keys") / "keys.json"
    path.write_text(json.dumps({"keys": [{"id": "ops-team", "key": KEY, "priority": 1}]}))
    return path


@pytest.fixture(scope="module")
def ops_cluster(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_cache_dir: Path,
    collector: Collector,
    keys_path: Path,
) -> Iterator[Cluster]:
    spec = ClusterSpec(
        model="tiny",
        num_prefill=1,
        num_decode=1,
        pool_size="64MiB",
        worker_args=("--block-size=16", "--num-kv-blocks=64", "--max-model-len=256",
                     f"--model-cache-dir={tiny_cache_dir}", f"--otlp-endpoint={collector.url}"),
        router_args=(*THROUGH_P, "--health-interval-s=0.5", f"--api-keys-file={keys_path}",
                     "--api-keys-reload-s=3600", f"--otlp-endpoint={collector.url}"),
        env=(*QUIET_ENV, ("OTEL_BSP_SCHEDULE_DELAY", "50")),
        log_dir=str(tmp_path_factory.mktemp("ops-logs")),
        startup_timeout_s=240.0,
    )  # fmt: skip
    yield from started_cluster(spec)


TREE = {  # (service, span, parent span): the client's span is the root's parent
    ("pdrouter-router", "router.request", CLIENT_SPAN),
    ("pdrouter-router", "router.admission", "router.request"),
    ("pdrouter-router", "router.prefetch", "router.request"),
    ("pdrouter-router", "router.prefill.attempt", "router.request"),
    ("pdrouter-router", "router.decode.attempt", "router.request"),
    ("pdworker-prefill", "pdworker.prefill", "router.prefill.attempt"),
    ("pdworker-prefill", "pdworker.prefix_lookup", "pdworker.prefill"),
    ("pdworker-prefill", "pdworker.prefix_load", "pdworker.prefill"),
    ("pdworker-prefill", "pdworker.queue", "pdworker.prefill"),
    ("pdworker-prefill", "pdworker.compute", "pdworker.prefill"),
    ("pdworker-prefill", "pdworker.pool_write", "pdworker.prefill"),
    ("pdworker-decode", "pdworker.prefetch", "router.prefetch"),
    ("pdworker-decode", "pdworker.decode", "router.decode.attempt"),
    ("pdworker-decode", "pdworker.kv_reservation", "pdworker.decode"),
    ("pdworker-decode", "pdworker.pool_read", "pdworker.decode"),
    ("pdworker-decode", "pdworker.decode_steps", "pdworker.decode"),
}


def _tree(spans: list[Span]) -> set[tuple[str, str, str]]:
    """(service, name, parent's name) of every span."""
    names = {s.span_id: s.name for s in spans}
    return {(s.service, s.name, names.get(s.parent_id, s.parent_id)) for s in spans}


def test_one_trace_runs_from_the_client_through_router_p_and_d(
    ops_cluster: Cluster, collector: Collector
) -> None:
    client = openai.OpenAI(base_url=f"{ops_cluster.router_url}/v1", api_key=KEY, max_retries=0)
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
    r = client.completions.create(
        model="tiny", prompt="one trace per request", max_tokens=5, temperature=0,
        extra_headers={"traceparent": traceparent},
    )  # fmt: skip
    spans = wait_until(lambda: collector.of_trace(TRACE_ID), 30, "spans of router, P and D",
                       done=lambda spans: len(spans) >= len(TREE))  # fmt: skip
    assert _tree(spans) == TREE and len(spans) == len(TREE)
    by_name = {s.name: s for s in spans}
    request_id = r.id.removeprefix("cmpl-")
    root = by_name["router.request"]
    assert root.span_id == f"{span_id(int(TRACE_ID, 16), 'router.request'):016x}"
    num_prompt = r.usage.prompt_tokens
    assert {k: root.attributes[k] for k in (
        "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "pd.priority",
        "pd.api_key_id", "http.response.status_code", "pd.prefill.worker",
        "pd.decode.worker")} == {
        "gen_ai.usage.input_tokens": num_prompt, "gen_ai.usage.output_tokens": 5,
        "pd.priority": 1, "pd.api_key_id": "ops-team",
        "http.response.status_code": 200, "pd.prefill.worker": ops_cluster.prefill_urls[0],
        "pd.decode.worker": ops_cluster.decode_urls[0],
    }  # fmt: skip
    prefill = by_name["pdworker.prefill"]
    assert prefill.attributes["pd.request_id"] == root.attributes["pd.request_id"]
    assert prefill.attributes["gen_ai.usage.input_tokens"] == num_prompt
    assert prefill.attributes["pd.prompt_tokens.computed"] == num_prompt  # a cold cache
    num_blocks = -(-num_prompt // 16)  # the partial block too
    assert prefill.attributes["pd.handoff.blocks_written"] == num_blocks
    decode = by_name["pdworker.decode"]
    assert decode.attributes["pd.handoff.blocks_loaded"] == num_blocks
    assert request_id == root.attributes["pd.request_id"]  # the OpenAI id's
    # P's work nests in the router's attempt; D's starts within its own (and ends once the
    # router has read D's body to its end, after the client's answer).
    attempt = by_name["router.prefill.attempt"]
    assert attempt.start_ns <= prefill.start_ns and prefill.end_ns <= attempt.end_ns + 5_000_000
    decode_attempt = by_name["router.decode.attempt"]
    assert decode_attempt.start_ns <= decode.start_ns + 5_000_000


def _exported_names(base_url: str, admin_key: str) -> set[str]:
    """Every series name base_url/metrics can show: its samples' names, and for families
    without samples yet, the names their type gives (name_total, name_bucket, ...). With a
    keys file every /metrics needs the admin key (docs/security.md)."""
    headers = {"Authorization": f"Bearer {admin_key}"}
    resp = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    text = resp.text
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


def test_every_dashboard_query_names_a_metric_the_servers_export(ops_cluster: Cluster) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {m for e in exprs for m in re.findall(r"\b(?:pdrouter|pdworker)_[a-z0-9_]+", e)}
    assert len(exprs) >= 30 and len(queried) >= 25
    exported = set().union(*(_exported_names(url, ops_cluster.admin_key) for url in (
        ops_cluster.router_url, *ops_cluster.prefill_urls, *ops_cluster.decode_urls)))  # fmt: skip
    assert sorted(queried - exported) == []


def test_the_keys_file_is_reloaded_on_sighup(ops_cluster: Cluster, keys_path: Path) -> None:
    new_key = "sk-ops-new"
    client = openai.OpenAI(base_url=f"{ops_cluster.router_url}/v1", api_key=new_key,
                           max_retries=0)  # fmt: skip
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=1)
    keys_path.write_text(json.dumps({"keys": [
        {"id": "ops-team", "key": KEY, "priority": 1},
        {"id": "ops-new", "key": new_key, "requests_per_minute": 1},
    ]}))  # fmt: skip
    router = ops_cluster.child("router").proc
    assert router is not None
    os.kill(router.pid, signal.SIGHUP)

    def answered() -> float | None:
        """When the accepted call was sent (None: refused, the old keys still in force)."""
        sent_s = time.monotonic()
        try:
            client.completions.create(model="tiny", prompt="hi", max_tokens=1)
        except openai.AuthenticationError:
            return None
        return sent_s

    sent_s = wait_until(answered, 30, "the new key accepted after SIGHUP")
    with pytest.raises(openai.RateLimitError) as info:  # its one request per minute is used
        client.completions.create(model="tiny", prompt="hi", max_tokens=1)
    took_s = time.monotonic() - sent_s
    # The wait left is 60 s less the time since the accepted call was charged, rounded up.
    assert math.ceil(60 - took_s) <= int(info.value.response.headers["Retry-After"]) <= 60
    assert info.value.body["param"] == "requests_per_minute"  # type: ignore[index]
