"""One classification of upstream failures for both stages (pdrouter.router.orchestrator.failures):
the same failure on P or on D gives the client the same status, marks the instance down or not
alike, and counts for its breaker alike. Real sockets: scripted workers, a worker that resets
its connections, a worker that is gone."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from pdrouter.common.proc import find_free_port
from pdrouter.router.orchestrator.failures import answer_outcome
from pdrouter.router.selection.breaker import BreakerConfig
from tests.pdrouter.router.scripted_workers import BLOCK_SIZE, FINGERPRINT
from tests.pdrouter.router.test_metrics_flow import BODY, _metric, cluster
from tests.pdrouter.router.worker_health import worker_health

STAGES = ("prefill", "decode")


class ResettingWorker:
    """Answers /health like a worker; resets (RST) the connection of every other request."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.num_reset = 0
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if head.startswith(b"GET /health "):
                    health = worker_health(FINGERPRINT, role=self.role, block_size=BLOCK_SIZE)
                    body = health.model_dump_json().encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
                    await writer.drain()
                    continue
                self.num_reset += 1
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()


@contextlib.asynccontextmanager
async def _one_each(stage: str, bad: Any, **cfg: Any) -> AsyncIterator[Any]:
    """A cluster of one P and one D whose `stage` worker is replaced by `bad`."""
    cfg.setdefault("breaker", BreakerConfig(failure_threshold=100))
    async with cluster(num_p=1, num_d=1, **cfg) as c:
        if bad is not None:
            await bad.start()
            role_list = c.service.registry.of_role(stage)
            role_list[0].url = bad.url
        try:
            yield c
        finally:
            if bad is not None:
                await bad.stop()


async def _ask(c: Any) -> httpx.Response:
    return await c.client.post("/v1/chat/completions", json=BODY)


@pytest.mark.parametrize("stage", STAGES)
async def test_a_reset_connection_is_a_502_and_marks_the_instance_down(stage: str) -> None:
    async with _one_each(stage, ResettingWorker(stage)) as c:
        inst = c.service.registry.of_role(stage)[0]
        resp = await _ask(c)
        assert resp.status_code == 502, resp.text
        message = resp.json()["error"]["message"]
        assert message.startswith(f"{stage} failed on every instance tried ("), message
        assert "ReadError" in message
        assert not inst.healthy
        metrics = (await c.client.get("/metrics")).text
        kind = f'kind="ReadError",stage="{stage}"'
        assert _metric(metrics, "pdrouter_stage_failures_total", kind) >= 1


@pytest.mark.parametrize("stage", STAGES)
async def test_a_gone_instance_is_a_503_with_retry_after(stage: str) -> None:
    async with _one_each(stage, None) as c:
        worker = (c.ps if stage == "prefill" else c.ds)[0]
        await worker.stop()
        resp = await _ask(c)
        assert (resp.status_code, resp.headers["Retry-After"]) == (503, "1"), resp.text
        message = resp.json()["error"]["message"]
        assert message.startswith(f"no {stage} instance reachable ("), message


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(
    ("answer", "status", "prefix"),
    [
        (503, 503, "no {stage} instance available ("),
        (500, 502, "{stage} failed on every instance tried ("),
        ("malformed", 502, "{stage} failed on every instance tried ("),
    ],
)
async def test_an_answer_that_fails_gives_the_same_status_on_both_stages(
    stage: str, answer: int | str, status: int, prefix: str
) -> None:
    async with _one_each(stage, None) as c:
        worker = (c.ps if stage == "prefill" else c.ds)[0]
        for _ in range(3):  # every attempt fails alike
            if answer == "malformed":
                worker.faults.append("malformed")
            else:
                worker.statuses.append(answer)  # type: ignore[arg-type]
        resp = await _ask(c)
        assert resp.status_code == status, resp.text
        message = resp.json()["error"]["message"]
        assert message.startswith(prefix.format(stage=stage)), message
        assert ("Retry-After" in resp.headers) == (status == 503)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("answer", [503, 500, "malformed", "reset"])
async def test_a_failed_attempt_moves_to_the_other_instance(stage: str, answer: Any) -> None:
    """Two instances of the failing stage: whatever the first one's failure, the request
    succeeds on the second."""
    counts = {"num_p": 2, "num_d": 1} if stage == "prefill" else {"num_p": 1, "num_d": 2}
    resetting = ResettingWorker(stage) if answer == "reset" else None
    async with cluster(**counts) as c:
        workers = c.ps if stage == "prefill" else c.ds
        insts = c.service.registry.of_role(stage)
        if resetting is not None:
            await resetting.start()
            insts[0].url = resetting.url
        elif answer == "malformed":
            workers[0].faults.append("malformed")
        else:
            workers[0].statuses.append(answer)
        try:
            # Round robin starts at the first instance: the failing one is tried first.
            resp = await _ask(c)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == " t0 t1 t2 t3"
            assert len(workers[1].request_ids) == 1
        finally:
            if resetting is not None:
                await resetting.stop()


async def test_decode_missing_kv_under_the_fail_policy_is_final() -> None:
    """D's 502 naming missing keys (policy `fail`) is the request's answer: the pool is
    shared, another D would miss the same keys, so it is not retried."""
    async with cluster(num_p=1, num_d=2) as c:
        c.ds[0].faults.append("error_body_502_missing")
        resp = await _ask(c)
        assert resp.status_code == 502
        message = resp.json()["error"]["message"]
        assert "missing keys: k/1:partial:2" in message
        assert c.ds[1].request_ids == []


@pytest.mark.parametrize("stage", STAGES)
async def test_a_client_error_passes_through_and_is_no_breaker_failure(stage: str) -> None:
    async with _one_each(stage, None, breaker=BreakerConfig(failure_threshold=1)) as c:
        worker = (c.ps if stage == "prefill" else c.ds)[0]
        worker.statuses.append(400)
        resp = await _ask(c)
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == "scripted 400"
        assert c.service.breakers.state(worker.url).value == "closed"
        assert (await _ask(c)).status_code == 200


async def test_a_malformed_prefill_answer_is_one_breaker_failure_never_a_success() -> None:
    """N malformed 200s open P's breaker; the half-open probe that gets one reopens it."""
    cfg = BreakerConfig(failure_threshold=3, cooldown_s=0.2)
    async with cluster(num_p=1, num_d=1, breaker=cfg) as c:
        p = c.ps[0]
        breakers = c.service.breakers
        p.faults.extend(["malformed"] * 3)
        for i in range(3):
            assert (await _ask(c)).status_code == 502
            assert breakers.get(p.url).consecutive_failures == i + 1
        assert breakers.state(p.url).value == "open"
        refused = await _ask(c)  # the breaker skips the only P
        assert refused.status_code == 503, refused.text
        assert len(p.request_ids) == 3
        # After the cooldown one probe goes through; it gets a malformed answer too.
        await asyncio.sleep(cfg.cooldown_s)  # the cooldown is the behaviour tested
        p.faults.append("malformed")
        assert (await _ask(c)).status_code == 502
        assert len(p.request_ids) == 4
        assert breakers.state(p.url).value == "open"
        assert breakers.get(p.url).times_opened == 2


def test_worker_answers_keep_4xx_and_name_the_stage_on_5xx() -> None:
    body = {"error": {"message": "prompt too long", "type": "invalid_request_error",
                      "param": "messages", "code": "context_length_exceeded"}}  # fmt: skip
    err = answer_outcome("prefill", "http://p", httpx.Response(400, json=body)).final
    assert err is not None
    assert (err.status, err.message, err.param) == (400, "prompt too long", "messages")
    body = {"error": {"message": "2 of 3 KV blocks could not be read", "type": "server_error",
                      "missing_keys": ["k1", "k2"]}}  # fmt: skip
    err = answer_outcome("decode", "http://d", httpx.Response(502, json=body)).final
    assert err is not None and err.status == 502
    assert err.message == (
        "decode instance http://d failed: 2 of 3 KV blocks could not be read (missing keys: k1, k2)"
    )
    busy = httpx.Response(503, text="busy", headers={"Retry-After": "2"})
    for stage in ("prefill", "decode"):
        failure = answer_outcome(stage, "http://d", busy)
        assert (failure.kind, failure.reason, failure.metric) == ("unavailable", "HTTP 503: busy",
                                                                  "http_503")  # fmt: skip
        assert (failure.breaker, failure.marks_down, failure.reached) == (True, False, True)
        assert failure.final is None


@pytest.mark.parametrize(
    ("status", "body", "verdict", "final_status"),
    [
        (400, {}, False, 400),  # the client's fault: the instance worked
        (404, {}, False, 404),
        (429, {}, False, 429),
        (401, {}, None, 502),  # the worker refused the router: says nothing of the instance
        (502, {"missing_keys": ["k1"]}, True, 502),
        (500, {}, True, None),
        (503, {}, True, None),
    ],
)
def test_each_worker_answer_gives_its_breaker_verdict(
    status: int, body: dict[str, Any], verdict: bool | None, final_status: int | None
) -> None:
    error = {"error": {"message": "m", "type": "server_error", **body}}
    failure = answer_outcome("decode", "http://d", httpx.Response(status, json=error))
    assert failure.breaker is verdict
    assert (failure.final.status if failure.final else None) == final_status


@pytest.mark.parametrize("stage", STAGES)
async def test_a_worker_refusing_the_router_gives_its_breaker_no_verdict(stage: str) -> None:
    """A 401 (the worker wants another --internal-secret) is final (502 naming the flag) and
    leaves the breaker as it was: no failure, and no success either. Its half-open trial slot
    is given back (release_trial), so the next call is let through."""
    cfg = BreakerConfig(failure_threshold=2, cooldown_s=0.0, half_open_calls=1)
    async with _one_each(stage, None, breaker=cfg) as c:
        worker = (c.ps if stage == "prefill" else c.ds)[0]
        breaker = c.service.breakers.get(worker.url)
        breaker.record_failure()  # one failure: a success would reset the count to 0
        worker.statuses.append(401)
        resp = await _ask(c)
        assert resp.status_code == 502, resp.text
        assert "--internal-secret" in resp.json()["error"]["message"]
        assert (breaker.state.value, breaker.consecutive_failures) == ("closed", 1)
        assert breaker.trials_in_flight == 0
        # Half-open with one trial slot: the 401 takes it and gives it back, no verdict.
        breaker.record_failure()
        assert breaker.state.value == "open"
        worker.statuses.append(401)
        assert (await _ask(c)).status_code == 502
        assert (breaker.state.value, breaker.consecutive_failures, breaker.trials_in_flight) == (
            "half_open", 2, 0)  # fmt: skip
        assert (await _ask(c)).status_code == 200  # the slot was free: a success closes it
        assert (breaker.state.value, breaker.consecutive_failures) == ("closed", 0)
