"""The router's body bound follows the served context length, over real sockets against
scripted workers that report max_model_len = MAX_MODEL_LEN on /health."""

from __future__ import annotations

from pdrouter.common.body_limit import ENVELOPE_BYTES, ROUTER_BYTES_PER_TOKEN
from tests.pdrouter.router.scripted_workers import MAX_MODEL_LEN
from tests.pdrouter.router.test_metrics_flow import BODY, _metric, cluster

LIMIT_BYTES = MAX_MODEL_LEN * ROUTER_BYTES_PER_TOKEN + ENVELOPE_BYTES


async def test_a_prompt_that_cannot_fit_is_400_before_any_worker_and_serving_goes_on() -> None:
    async with cluster() as c:
        big = {**BODY, "messages": [{"role": "user", "content": "x" * LIMIT_BYTES}]}
        resp = await c.client.post("/v1/chat/completions", json=big)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["type"], error["code"]) == (
            "invalid_request_error",
            "context_length_exceeded",
        )
        assert error["message"].startswith(
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens"
        )
        assert (
            f"({LIMIT_BYTES} bytes at {ROUTER_BYTES_PER_TOKEN} bytes per token" in error["message"]
        )
        assert c.ps[0].request_ids == [] and c.ds[0].request_ids == []
        # Just under the bound it goes through (the scripted P does not count tokens).
        pad = LIMIT_BYTES - len(str(BODY)) - 200
        fits = {**BODY, "messages": [{"role": "user", "content": "x" * pad}]}
        resp = await c.client.post("/v1/chat/completions", json=fits)
        assert resp.status_code == 200, resp.text
        text = (await c.client.get("/metrics")).text
        assert _metric(text, "pdrouter_requests_total", 'endpoint="chat",status="400"') == 1


async def test_v1_models_and_instances_report_the_context_length() -> None:
    async with cluster() as c:
        models = (await c.client.get("/v1/models")).json()
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", MAX_MODEL_LEN)]
        listed = (await c.client.get("/instances")).json()["instances"]
        assert [inst["max_model_len"] for inst in listed] == [MAX_MODEL_LEN, MAX_MODEL_LEN]


async def test_an_explicit_max_body_bytes_still_answers_413() -> None:
    async with cluster(max_body_bytes=LIMIT_BYTES * 4) as c:
        big = {**BODY, "messages": [{"role": "user", "content": "x" * (LIMIT_BYTES * 4)}]}
        resp = await c.client.post("/v1/chat/completions", json=big)
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["code"] == "request_too_large"
