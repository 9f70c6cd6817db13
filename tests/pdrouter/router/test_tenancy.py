"""API keys file, per-key limits and the priority admission queue, without processes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.selection.admission import (
    Admission,
    AdmissionConfig,
    estimate_prompt_tokens,
    max_output_tokens,
)
from pdrouter.router.tenancy.gate import Tenancy, TenancyConfig
from pdrouter.router.tenancy.key_metrics import KeyMetrics
from pdrouter.router.tenancy.keys_file import KeysFile, parse_keys
from pdrouter.router.tenancy.limits import KeyLimits
from pdrouter.router.tenancy.queue import AdmissionQueue
from pdrouter.wire.choices import plan_choices
from pdrouter.wire.errors import APIError
from pdrouter.wire.openai import CompletionRequest, parse_request


def keys_json(*entries: dict) -> str:
    return json.dumps({"keys": list(entries)})


A = {"id": "team-a", "key": "sk-a", "requests_per_minute": 2, "tokens_per_minute": 100,
     "max_concurrent": 3, "priority": 4}  # fmt: skip


def key_a():
    (key,) = parse_keys(keys_json(A), "k.json").values()
    return key


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", 'expected {"keys": [...]}'),
        ("{", "not valid JSON"),
        (keys_json({"id": "x"}), 'needs a non-empty "id" and "key"'),
        (keys_json({"id": "x", "key": "k", "rpm": 1}), "unknown fields ['rpm']"),
        (keys_json({"id": "x", "key": "k", "max_concurrent": 0}), "max_concurrent must be"),
        (keys_json({"id": "x", "key": "k"}, {"id": "x", "key": "j"}), "repeats an id"),
        (keys_json({"id": "x", "key": "k", "priority": "high"}), "priority must be"),
        (
            keys_json({"id": "x", "key": "k", "priority": 2, "max_priority": 3}),
            "max_priority must be an integer at most priority (2)",
        ),
    ],
)
def test_a_bad_keys_file_is_refused_naming_the_entry(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^k\.json") as info:
        parse_keys(text, "k.json")
    assert message in str(info.value)


def test_keys_match_by_bearer_and_reload_keeps_the_old_keys_on_a_broken_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.json"
    path.write_text(keys_json(A))
    keys = KeysFile(str(path))
    assert keys.match("Bearer sk-a").key_id == "team-a"  # type: ignore[union-attr]
    assert (keys.match("Bearer sk-b"), keys.match(None), keys.match("sk-a")) == (None,) * 3
    assert "sk-a" not in repr(keys.match("Bearer sk-a"))  # the secret never printed
    path.write_text(keys_json({"id": "b", "key": "sk-b"}) + " ")
    assert keys.changed() and keys.reload()
    assert (keys.match("Bearer sk-a"), keys.match("Bearer sk-b").key_id) == (None, "b")  # type: ignore[union-attr]
    path.write_text("{broken")
    assert keys.changed() and not keys.reload()
    assert not keys.changed()  # logged once, not at every poll
    assert keys.match("Bearer sk-b").key_id == "b"  # type: ignore[union-attr]


def test_requests_per_minute_refuse_with_the_wait_until_a_request_fits() -> None:
    limits, key = KeyLimits(), key_a()
    for _ in range(2):
        limits.settle(limits.admit(key, 1, now_s=0.0), 1, now_s=0.0)
    with pytest.raises(APIError) as info:
        limits.admit(key, 1, now_s=0.0)
    err = info.value
    assert (err.status, err.retry_after_s, err.param, err.code) == (
        429, 30, "requests_per_minute", "rate_limit_exceeded")  # fmt: skip
    assert err.body()["error"]["type"] == "rate_limit_error"
    assert "'team-a'" in err.message and "2 requests per minute" in err.message
    limits.admit(key, 1, now_s=30.0)  # a minute's share refilled: one more request


def test_tokens_are_charged_as_estimated_and_settled_as_used() -> None:
    limits, key = KeyLimits(), key_a()
    ticket = limits.admit(key, 80, now_s=0.0)
    with pytest.raises(APIError) as info:
        limits.admit(key, 30, now_s=0.0)  # 20 left
    assert (info.value.param, info.value.retry_after_s) == (
        "tokens_per_minute",
        6,
    )  # 10 more at 100/min
    limits.settle(ticket, 50, now_s=0.0)  # used 50 of the 80 charged: 30 back
    state = limits.id_to_state["team-a"]
    assert (state.tokens.level, state.in_flight) == (50.0, 0)  # type: ignore[union-attr]
    limits.settle(ticket, 50, now_s=0.0)  # a second settle changes nothing
    assert (state.tokens.level, state.in_flight) == (50.0, 0)  # type: ignore[union-attr]


def test_a_request_past_the_buckets_capacity_is_a_400_and_is_charged_whole() -> None:
    limits, key = KeyLimits(), key_a()  # 100 tokens per minute
    with pytest.raises(APIError) as info:
        limits.admit(key, 101, now_s=0.0)  # could never pass: not a 429 to retry
    err = info.value
    assert (err.status, err.param, err.code, err.retry_after_s) == (
        400, "max_tokens", "request_too_large", None)  # fmt: skip
    assert "may use 101 tokens" in err.message and "in a minute (100, tokens_per_minute)" in (
        err.message
    )
    ticket = limits.admit(key, 100, now_s=0.0)  # the whole bound charged, not a share
    assert ticket.num_tokens_charged == 100
    assert limits.id_to_state["team-a"].tokens.level == 0.0  # type: ignore[union-attr]


def test_concurrent_requests_are_capped() -> None:
    limits = KeyLimits()
    (key,) = parse_keys(keys_json({"id": "c", "key": "k", "max_concurrent": 2}), "f").values()
    tickets = [limits.admit(key, 10, now_s=0.0) for _ in range(2)]
    with pytest.raises(APIError) as info:
        limits.admit(key, 10, now_s=0.0)
    assert (info.value.param, info.value.retry_after_s) == ("max_concurrent", 1)
    limits.settle(tickets[0], 10, now_s=0.0)
    limits.admit(key, 10, now_s=0.0)


async def _held(max_queued: int, max_wait_s: float) -> tuple[Admission, AdmissionQueue]:
    """A queue in front of one --max-in-flight slot, the slot already held."""
    admission = Admission(AdmissionConfig(max_in_flight=1))
    queue = AdmissionQueue(admission, max_queued, max_wait_s)
    await queue.enter(0)
    return admission, queue


async def _turns() -> None:
    """A few turns of the loop: enough for a woken waiter to resume."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_the_queue_serves_the_most_urgent_first_then_arrival_order() -> None:
    admission, queue = await _held(4, 10)  # holds the one slot
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await queue.enter(priority)
        order.append(name)

    tasks = []
    for name, priority in (("low", 5), ("mid1", 0), ("high", -1), ("mid2", 0)):
        tasks.append(asyncio.ensure_future(wait(name, priority)))
        await asyncio.sleep(0)
    assert queue.num_waiting == 4
    for expected in (["high"], ["high", "mid1"], ["high", "mid1", "mid2"]):
        queue.leave()
        await _turns()
        assert order == expected
        assert admission.num_in_flight == 1  # the slot passed on, never given back
    queue.leave()
    await asyncio.gather(*tasks)
    assert order == ["high", "mid1", "mid2", "low"]
    queue.leave()
    assert (admission.num_in_flight, queue.num_waiting) == (0, 0)


async def test_a_full_queue_and_a_long_wait_answer_429() -> None:
    admission, queue = await _held(1, 0.05)
    waiter = asyncio.ensure_future(queue.enter(0))
    await asyncio.sleep(0)
    with pytest.raises(APIError, match="--max-in-flight 1"):
        await queue.enter(-5)  # the queue is full: refused at once
    with pytest.raises(APIError, match=r"waited 0\.05 s in the admission queue") as info:
        await waiter
    assert (info.value.status, info.value.retry_after_s) == (429, 1)
    queue.leave()
    assert (admission.num_in_flight, queue.num_waiting) == (0, 0)


async def test_a_waiter_cancelled_leaves_no_slot_behind() -> None:
    admission, queue = await _held(2, 10)
    waiter = asyncio.ensure_future(queue.enter(0))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    queue.leave()  # nobody waits any more: the slot goes back
    assert (admission.num_in_flight, queue.num_waiting) == (0, 0)


@pytest.mark.parametrize(("n", "best_of"), [(1, None), (3, None), (2, 4)])
def test_a_request_is_charged_its_prompt_once_and_every_sequences_budget(
    tmp_path: Path, n: int, best_of: int | None
) -> None:
    """tokens_per_minute: n (or best_of) sequences spend the prompt once and each its own
    max_tokens, charged so at admission and settled by the answer's usage."""
    path = tmp_path / "keys.json"
    path.write_text(keys_json({"id": "t", "key": "sk-t", "tokens_per_minute": 10_000}))
    registry = CollectorRegistry()
    tenancy = Tenancy(TenancyConfig(api_keys_file=str(path)), Admission(AdmissionConfig()),
                      KeyMetrics(registry))  # fmt: skip
    body = {"model": "m", "prompt": "x" * 40, "n": n, "best_of": best_of, "max_tokens": 50}
    parsed = parse_request(CompletionRequest, json.dumps(body).encode())
    estimate = estimate_prompt_tokens(parsed)
    ctx = RequestContext("r", "completions", b"{}", "m", False, 0.0, estimate,
                         max_output_tokens(parsed, 512, estimate),
                         plan=plan_choices(parsed))  # fmt: skip
    tenancy.admit(ctx, tenancy.identify("Bearer sk-t", None), None)
    num_sequences = best_of or n
    assert ctx.ticket is not None and ctx.ticket.num_tokens_charged == estimate + 50 * num_sequences
    ctx.meter.output(3)  # relayed so far; the complete answer's usage wins over it
    ctx.answered(41, 7 * num_sequences, 0.5, 1.0)  # the usage of the whole answer
    tenancy.end(ctx, 200)
    tokens = {kind: registry.get_sample_value("pdrouter_api_key_tokens_total",
                                              {"key_id": "t", "kind": kind})
              for kind in ("prompt", "generation")}  # fmt: skip
    assert tokens == {"prompt": 41, "generation": 7 * num_sequences}


def _tenancy(tmp_path: Path, *entries: dict) -> tuple[Tenancy, CollectorRegistry]:
    path = tmp_path / "keys.json"
    path.write_text(keys_json(*entries))
    registry = CollectorRegistry()
    tenancy = Tenancy(TenancyConfig(api_keys_file=str(path)), Admission(AdmissionConfig()),
                      KeyMetrics(registry))  # fmt: skip
    return tenancy, registry


def test_a_request_that_ends_unanswered_is_settled_by_what_was_relayed(tmp_path: Path) -> None:
    tenancy, registry = _tenancy(tmp_path, {"id": "t", "key": "sk-t", "tokens_per_minute": 1000})
    ctx = RequestContext("r", "completions", b"{}", "m", False, 0.0, 9, 400)
    tenancy.admit(ctx, tenancy.identify("Bearer sk-t", None), None)
    state = tenancy.limits.id_to_state["t"]
    assert state.tokens.level == 1000 - 409  # type: ignore[union-attr]
    ctx.meter.prompt(0, 8)
    ctx.meter.output(1)  # P's first token
    ctx.meter.output(4)  # a batch of D's
    tenancy.end(ctx, 499)  # the client left: no answer, 13 tokens relayed
    samples = {kind: registry.get_sample_value("pdrouter_api_key_tokens_total",
                                               {"key_id": "t", "kind": kind})
               for kind in ("prompt", "generation")}  # fmt: skip
    assert samples == {"prompt": 8, "generation": 5}
    assert state.tokens.level == pytest.approx(1000 - 13, abs=1)  # type: ignore[union-attr]
    assert (
        registry.get_sample_value(
            "pdrouter_api_key_requests_total", {"key_id": "t", "status": "499"}
        )
        == 1
    )


@pytest.mark.parametrize(
    ("header", "field", "priority"),
    [("-1000", None, -2), (None, -3, -2), ("7", None, 7), (None, None, 5), ("-2", 9, 9)],
)
def test_a_claimed_priority_is_clamped_to_the_keys_max_priority(
    tmp_path: Path, header: str | None, field: int | None, priority: int
) -> None:
    tenancy, _ = _tenancy(tmp_path, {"id": "r", "key": "sk-r", "priority": 5, "max_priority": -2})
    ctx = RequestContext("q", "completions", b"{}", "m", False, 0.0, 1, 1, priority=field)
    tenancy.admit(ctx, tenancy.identify("Bearer sk-r", None), header)
    assert ctx.priority == priority


def test_a_keys_max_priority_defaults_to_its_priority(tmp_path: Path) -> None:
    tenancy, _ = _tenancy(tmp_path, {"id": "c", "key": "sk-c", "priority": 5})
    ctx = RequestContext("q", "completions", b"{}", "m", False, 0.0, 1, 1)
    tenancy.admit(ctx, tenancy.identify("Bearer sk-c", None), "-1000")
    assert ctx.priority == 5
    other = RequestContext("o", "completions", b"{}", "m", False, 0.0, 1, 1)
    tenancy.admit(other, None, "-1000")  # a key of --api-key: no cap
    assert other.priority == -1000


def test_a_tokenizer_call_counts_against_the_keys_call_limits(tmp_path: Path) -> None:
    tenancy, registry = _tenancy(
        tmp_path, {"id": "k", "key": "sk-k", "requests_per_minute": 1, "max_concurrent": 1}
    )
    gauge = {"key_id": "k"}
    with tenancy.call("Bearer sk-k", None):
        assert tenancy.limits.id_to_state["k"].in_flight == 1
        # the scraped gauge follows the call's max_concurrent slot, as a completion's does
        assert registry.get_sample_value("pdrouter_api_key_in_flight", gauge) == 1
    assert tenancy.limits.id_to_state["k"].in_flight == 0
    assert registry.get_sample_value("pdrouter_api_key_in_flight", gauge) == 0
    with pytest.raises(APIError) as info, tenancy.call("Bearer sk-k", None):
        pass
    assert (info.value.status, info.value.param) == (429, "requests_per_minute")
    with pytest.raises(APIError) as unknown, tenancy.call("Bearer sk-x", None):
        pass
    assert unknown.value.status == 401
    counts = {s: registry.get_sample_value("pdrouter_api_key_requests_total",
                                           {"key_id": "k", "status": s})
              for s in ("200", "429")}  # fmt: skip
    assert counts == {"200": 1, "429": 1}
