"""Failures around the router: a dead P, no reachable D, a D dying mid-stream, a worker killed
and restarted by the launcher, and a cluster whose fingerprints disagree."""

from __future__ import annotations

import sys
import threading
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http
from pdrouter.router.config import RouterConfig
from pdrouter.router.orchestrator import HopTimeouts, OrchestratorConfig
from tests.e2e.pd.clients import client, complete, prompt_ids
from tests.e2e.pd.conftest import MODEL, PDCluster, metrics_of, wait_blocks_free
from tests.json_reply import reply_json
from tests.pdrouter.router.in_process_router import in_process_router
from tests.wait import wait_until

pytestmark = pytest.mark.slow


def _in_process_router(
    pd_cluster: PDCluster, prefill_urls: list[str], decode_urls: list[str]
) -> AsyncIterator[httpx.AsyncClient]:
    """A router app in this process whose instances were never health-checked: it learns
    that one is dead only by calling it, which is the path under test. It sends the
    cluster's internal secret, as the launched router does."""
    cfg = RouterConfig(
        prefill_urls=tuple(prefill_urls),
        decode_urls=tuple(decode_urls),
        orchestrator=OrchestratorConfig(timeouts=HopTimeouts(connect_s=1.0, prefill_s=60.0)),
        internal_secret=pd_cluster.cluster.internal_secret,
    )
    return in_process_router(cfg)


async def test_a_dead_prefill_is_skipped_for_the_live_one(pd_cluster: PDCluster) -> None:
    dead = f"http://127.0.0.1:{find_free_port()}"
    live = pd_cluster.cluster.prefill_urls[0]
    body = {"model": MODEL, "prompt": prompt_ids(40, salt=81), "max_tokens": 5, "temperature": 0}
    expected = complete(client(pd_cluster.mixed_url), False, **body)
    decodes = pd_cluster.cluster.decode_urls
    async for router in _in_process_router(pd_cluster, [dead, live], decodes[:1]):
        for _ in range(3):
            resp = await router.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == expected.text
        metrics = (await router.get("/metrics")).text
        assert 'pdrouter_retries_total{stage="prefill"} 1.0' in metrics
        health = (await router.get("/health")).json()
        dead_state = next(i for i in health["instances"] if i["url"] == dead)
        assert not dead_state["healthy"] and "ConnectError" in dead_state["last_error"]


async def test_no_reachable_decode_is_503_before_any_prefill(pd_cluster: PDCluster) -> None:
    p_url = pd_cluster.cluster.prefill_urls[0]
    key = 'pdworker_requests_total{endpoint="prefill",status="success"}'
    before = metrics_of(p_url).get(key, 0)
    dead = f"http://127.0.0.1:{find_free_port()}"
    async for router in _in_process_router(pd_cluster, [p_url], [dead]):
        resp = await router.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert resp.status_code == 503
        assert resp.json()["error"]["message"].startswith(f"no decode instance reachable ({dead}")
    assert metrics_of(p_url).get(key, 0) == before  # P was never asked to work


def _running_decode(pd_cluster: PDCluster, timeout_s: float = 10.0) -> int:
    """Index of the decode worker running a request now."""

    def running() -> int | None:
        for i, url in enumerate(pd_cluster.cluster.decode_urls):
            if metrics_of(url)["pdworker_num_requests_running"] > 0:
                return i
        return None

    return wait_until(
        running, timeout_s, "a decode worker running the request", done=lambda i: i is not None
    )


def _restart(pd_cluster: PDCluster, name: str) -> list[str]:
    """One supervision pass (restarts name), then wait for its /health."""
    reports: list[str] = []
    assert pd_cluster.cluster.check(report=reports.append) is None
    child = pd_cluster.cluster.child(name)
    wait_for_http(child.health_url, 120.0, proc=child.proc)
    return reports


def test_decode_dying_mid_stream_resumes_on_the_other_without_repeats(
    pd_cluster: PDCluster,
) -> None:
    body = {"model": MODEL, "prompt": prompt_ids(30, salt=82), "max_tokens": 300,
            "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    expected = complete(client(pd_cluster.mixed_url), False, **body)
    retries_key = 'pdrouter_retries_total{stage="decode"}'
    retries_before = metrics_of(pd_cluster.router_url).get(retries_key, 0)
    texts: list[str] = []
    with client(pd_cluster.router_url).completions.create(stream=True, **body) as stream:
        chunks = iter(stream)
        texts.append(next(chunks).choices[0].text)
        texts.append(next(chunks).choices[0].text)
        victim = _running_decode(pd_cluster)
        pd_cluster.cluster.child(f"decode-{victim}").proc.kill()
        for chunk in chunks:
            texts.extend(choice.text for choice in chunk.choices)
    assert "".join(texts) == expected.text
    # The stream really moved: one decode hop was retried on the other D.
    assert metrics_of(pd_cluster.router_url)[retries_key] == retries_before + 1
    reports = _restart(pd_cluster, f"decode-{victim}")
    assert reports == [
        f"decode-{victim} died (exit code -9); restarting (1/3); log: "
        f"{pd_cluster.cluster.child(f'decode-{victim}').log_path}"
    ]
    other = pd_cluster.cluster.decode_urls[1 - victim]
    assert wait_blocks_free(other) == 0


def test_killed_prefill_is_routed_around_then_restarted(pd_cluster: PDCluster) -> None:
    c = pd_cluster.cluster
    c.child("prefill-1").proc.kill()
    mixed = client(pd_cluster.mixed_url)
    for i in range(4):
        body = {"model": MODEL, "prompt": prompt_ids(25, salt=90 + i), "max_tokens": 4,
                "temperature": 0}  # fmt: skip
        assert complete(client(pd_cluster.router_url), True, **body) == complete(
            mixed, False, **body
        )
    _restart(pd_cluster, "prefill-1")
    wait_until(
        lambda: httpx.get(f"{c.router_url}/health").json()["num_prefill_healthy"],
        10,
        "the router to take the restarted P back",
        done=lambda n: n == 2,
    )


def test_router_refuses_prefill_and_decode_of_different_fingerprints(
    pd_cluster: PDCluster, tmp_path
) -> None:
    port = find_free_port()
    other = ManagedProcess(
        "mixed-bs8",
        [sys.executable, "-m", "workers.cli", "serve", "--role", "mixed", "--model", MODEL,
         "--port", str(port), "--block-size", "8", "--num-kv-blocks", "32",
         "--model-cache-dir", str(pd_cluster.cache_dir)],
        env={"OMP_NUM_THREADS": "1"},
        log_path=tmp_path / "mixed-bs8.log",
    )  # fmt: skip
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", 120.0, proc=other)
        p_url = pd_cluster.cluster.prefill_urls[0]
        router = ManagedProcess(
            "router-mismatch",
            [sys.executable, "-m", "pdrouter.cli", "serve", "--port", str(find_free_port()),
             "--prefill", p_url, "--decode", f"http://127.0.0.1:{port}",
             "--startup-wait-s", "10"],
            log_path=tmp_path / "router.log",
        )  # fmt: skip
        try:
            router.popen.wait(timeout=30)
        finally:
            router.stop()
        assert router.returncode == 2
        log = router.log_tail()
        fp_p = httpx.get(f"{p_url}/health").json()["fingerprint"]
        fp_d = httpx.get(f"http://127.0.0.1:{port}/health").json()["fingerprint"]
        assert f"pdrouter: refusing to start: prefill {p_url} has fingerprint {fp_p}" in log
        assert f"decode http://127.0.0.1:{port} has {fp_d} (block size 8" in log
    finally:
        other.stop()


class _GarbageHandler(BaseHTTPRequestHandler):
    """Fault injection no real worker produces: 200 with a body that is not a PrefillResult."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        reply_json(self, b'{"unexpected": true}')

    def log_message(self, *args: object) -> None:
        pass


async def test_a_malformed_prefill_answer_is_retried_on_another_p(pd_cluster: PDCluster) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", find_free_port()), _GarbageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        garbage = f"http://127.0.0.1:{server.server_address[1]}"
        body = {"model": MODEL, "prompt": prompt_ids(19, salt=83), "max_tokens": 4,
                "temperature": 0}  # fmt: skip
        expected = complete(client(pd_cluster.mixed_url), False, **body)
        live = pd_cluster.cluster.prefill_urls[0]
        decodes = pd_cluster.cluster.decode_urls
        async for router in _in_process_router(pd_cluster, [garbage, live], decodes):
            resp = await router.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == expected.text
            metrics = (await router.get("/metrics")).text
            assert 'pdrouter_retries_total{stage="prefill"} 1.0' in metrics
        async for router in _in_process_router(pd_cluster, [garbage], decodes):
            resp = await router.post("/v1/completions", json=body)
            assert resp.status_code == 502
            message = resp.json()["error"]["message"]
            assert message.startswith(
                f"prefill failed on every instance tried ({garbage}: malformed prefill result"
            )
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_group_whose_decode_dies_mid_stream_resumes_its_sequences(
    pd_cluster: PDCluster,
) -> None:
    """n=3 decoded as one group on one D, killed mid-stream: the other D resumes the three
    sequences from the tokens the client has of each; every choice equals the mixed one."""
    body = {"model": MODEL, "prompt": prompt_ids(27, salt=83), "max_tokens": 300, "n": 3,
            "temperature": 0.8, "seed": 17, "extra_body": {"ignore_eos": True}}  # fmt: skip
    expected = client(pd_cluster.mixed_url).completions.create(**body)
    retries_key = 'pdrouter_retries_total{stage="decode"}'
    retries_before = metrics_of(pd_cluster.router_url).get(retries_key, 0)
    texts = {0: "", 1: "", 2: ""}
    with client(pd_cluster.router_url).completions.create(stream=True, **body) as stream:
        chunks = iter(stream)
        for _ in range(9):  # the three first tokens and some of D's
            for choice in next(chunks).choices:
                texts[choice.index] += choice.text
        victim = _running_decode(pd_cluster)
        pd_cluster.cluster.child(f"decode-{victim}").proc.kill()
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
    assert texts == {c.index: c.text for c in expected.choices}
    assert metrics_of(pd_cluster.router_url)[retries_key] == retries_before + 1
    _restart(pd_cluster, f"decode-{victim}")
    for url in pd_cluster.cluster.decode_urls:
        assert wait_blocks_free(url) == 0
