"""Conditional disaggregation through the router, against scripted P and D over loopback
HTTP: P's LocalPrefill sends D the prompt with no KV handle and no first token; D's first
event is the client's first token; usage, metrics and the timeline say which path and why;
a retry and a failover go to another D the same way."""

from __future__ import annotations

import json

from pdrouter.router.orchestrator import OrchestratorConfig
from tests.pdrouter.router.scripted_workers import FIRST_TOKEN, NUM_UNCACHED, PROMPT_IDS
from tests.pdrouter.router.test_metrics_flow import BODY, STREAM_BODY, _metric, _sse_texts, cluster
from tests.sse import DONE, sse_data

THRESHOLD = NUM_UNCACHED + 1  # P's caches miss NUM_UNCACHED tokens: below it, local
LOCAL = OrchestratorConfig(retry_backoff_s=0.001, local_prefill_below_tokens=THRESHOLD)
USAGE_BODY = {**STREAM_BODY, "stream_options": {"include_usage": True}}
DECISIONS = "pdrouter_disaggregation_decisions_total"


async def test_a_short_uncached_suffix_is_prefilled_on_decode_streamed() -> None:
    async with cluster(orchestrator=LOCAL) as c:
        c.ps[0].leaves_short_prompts = True
        resp = await c.client.post("/v1/chat/completions", json=USAGE_BODY,
                                   headers={"X-Request-Id": "req-local-1"})  # fmt: skip
        assert resp.status_code == 200
        data = sse_data(resp)
        assert data[-1] == DONE
        first = json.loads(data[0])
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": " t0"}
        assert "".join(_sse_texts(resp)) == " t0 t1 t2 t3"
        usage = json.loads(data[-2])["usage"]
        assert usage["prompt_tokens"] == len(PROMPT_IDS) and usage["completion_tokens"] == 4
        assert usage["prompt_tokens_details"] == {"cached_tokens": 4}
        # D got the prompt with nothing of P's: no handle, no first token.
        assert c.ds[0].output_ids_seen == [[]]

        text = (await c.client.get("/metrics")).text
        assert _metric(text, DECISIONS, 'path="local",reason="uncached_below_threshold"') == 1
        assert f'{DECISIONS}{{path="pd"' not in text
        by_source = "pdrouter_prompt_tokens_by_source_total"
        assert _metric(text, by_source, 'source="device"') == 0
        assert _metric(text, by_source, 'source="pool"') == 4
        assert _metric(text, by_source, 'source="computed"') == 2
        assert _metric(text, "pdrouter_time_to_first_token_seconds_count") == 1
        assert _metric(text, "pdrouter_inter_token_latency_seconds_count") == 3
        assert _metric(text, "pdrouter_first_to_second_token_seconds_count") == 1
        # No handoff: nothing through the pool, no put, no handoff left after P.
        assert _metric(text, "pdrouter_handoff_after_first_token_seconds_count") == 0
        assert _metric(text, "pdrouter_handoff_put_seconds_count") == 0
        assert _metric(text, "pdrouter_pool_bytes_written_total") == 0
        assert _metric(text, "pdrouter_recomputed_prompt_tokens_total") == 0

        timeline = (await c.client.get("/debug/requests/req-local-1")).json()
        events = timeline["events"]
        assert [e["event"] for e in events] == [
            "router_accept", "prefill_sent", "prefill_done", "disaggregation", "decode_sent",
            "first_decode_token", "first_token_sent", "second_token_sent", "end",
        ]  # fmt: skip
        decision = {k: v for k, v in events[3].items() if k != "at_ms"}
        assert decision == {
            "event": "disaggregation", "path": "local", "reason": "uncached_below_threshold",
            "uncached_tokens": NUM_UNCACHED, "threshold_tokens": THRESHOLD,
        }  # fmt: skip
        assert timeline["prefill"] is None  # P computed nothing
        assert "handoff_after_first_token_ms" not in events[5]


async def test_a_short_uncached_suffix_is_prefilled_on_decode_not_streamed() -> None:
    async with cluster(orchestrator=LOCAL) as c:
        c.ps[0].leaves_short_prompts = True
        resp = await c.client.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                             "max_tokens": 4})  # fmt: skip
        assert resp.status_code == 200
        answer = resp.json()
        assert answer["choices"][0]["text"] == " t0 t1 t2 t3"
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 4
        assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_time_to_first_token_seconds_count") == 1
        assert _metric(text, "pdrouter_first_to_second_token_seconds_count") == 0  # streams only


async def test_the_threshold_is_sent_and_a_long_suffix_goes_through_p() -> None:
    async with cluster(
        orchestrator=OrchestratorConfig(local_prefill_below_tokens=NUM_UNCACHED)
    ) as c:
        c.ps[0].leaves_short_prompts = True  # 2 uncached tokens are not below 2: PD
        resp = await c.client.post("/v1/chat/completions", json=BODY)
        assert resp.json()["choices"][0]["message"]["content"] == " t0 t1 t2 t3"
        assert c.ds[0].output_ids_seen == [[FIRST_TOKEN]]
        text = (await c.client.get("/metrics")).text
        labels = 'path="pd",reason="uncached_at_or_above_threshold"'
        assert _metric(text, DECISIONS, labels) == 1
        assert _metric(text, "pdrouter_handoff_after_first_token_seconds_count") == 1


async def test_a_zero_threshold_is_pd_for_every_request() -> None:
    async with cluster(orchestrator=OrchestratorConfig(local_prefill_below_tokens=0)) as c:
        c.ps[0].leaves_short_prompts = True
        for _ in range(2):
            assert (await c.client.post("/v1/chat/completions", json=BODY)).status_code == 200
        assert c.ds[0].output_ids_seen == [[FIRST_TOKEN], [FIRST_TOKEN]]
        text = (await c.client.get("/metrics")).text
        assert _metric(text, DECISIONS, 'path="pd",reason="disabled"') == 2


async def test_a_local_prefill_whose_decode_fails_first_is_retried_the_same_way() -> None:
    async with cluster(num_d=2, orchestrator=LOCAL) as c:
        c.ps[0].leaves_short_prompts = True
        d0, d1 = c.ds
        d0.statuses = [500]  # the first D picked fails before any event
        resp = await c.client.post("/v1/chat/completions", json=STREAM_BODY)
        assert "".join(_sse_texts(resp)) == " t0 t1 t2 t3"
        assert (d0.output_ids_seen, d1.output_ids_seen) == ([[]], [[]])
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_retries_total", 'stage="decode"') == 1
        assert "pdrouter_failovers_total{" not in text


async def test_a_local_prefill_whose_decode_dies_mid_stream_resumes_after_the_sent_tokens() -> None:
    async with cluster(num_d=2, orchestrator=LOCAL) as c:
        c.ps[0].leaves_short_prompts = True
        d0, d1 = c.ds
        d0.cut_after = 2  # the first D picked dies after t0 and t1
        resp = await c.client.post("/v1/chat/completions", json=USAGE_BODY)
        assert "".join(_sse_texts(resp)) == " t0 t1 t2 t3"
        assert d0.output_ids_seen == [[]]
        assert d1.output_ids_seen == [[FIRST_TOKEN, FIRST_TOKEN + 1]]
        assert json.loads(sse_data(resp)[-2])["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 4
        }
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_failovers_total", 'stage="decode"') == 1
        assert _metric(text, DECISIONS, 'path="local",reason="uncached_below_threshold"') == 1
