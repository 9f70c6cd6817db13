"""The first-to-second token gap and the handoff left after P's first token, exactly: the
answer (orchestrator.answer.Answers) over scripted batches of D's events, on a clock the test
moves (the answer's and the timeline's), so every observed value is known in advance."""

from __future__ import annotations

import types
from collections.abc import AsyncIterator

import pytest

from pdrouter.router.instances.registry import Registry
from pdrouter.router.observability.metrics import LoopHistogram, RouterMetrics
from pdrouter.router.observability.timeline import TimelineRing
from pdrouter.router.orchestrator import answer as answer_module
from pdrouter.router.orchestrator.answer import Answers
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.wire.pd import DecodeEvent, LocalPrefill, PrefillResult

PROMPT = [1, 2, 3, 4, 5]


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class ScriptedAnswers(Answers):
    """Answers whose decode hop is a list of (arrival time, batch of D's events)."""

    def __init__(self, clock: Clock, batches: list[tuple[float, list[DecodeEvent]]]) -> None:
        super().__init__(RouterMetrics(Registry([], [])), None, None)  # type: ignore[arg-type]
        self.clock = clock
        self.batches = batches

    async def _events(self, ctx, result) -> AsyncIterator[list[DecodeEvent]]:  # type: ignore[override]
        for at_s, batch in self.batches:
            self.clock.now_s = at_s
            yield batch


def event(k: int, num_tokens: int = 4) -> DecodeEvent:
    last = k == num_tokens - 1
    return DecodeEvent(token_ids=[100 + k], text=f" t{k}", finished=last,
                       finish_reason="length" if last else None,
                       num_output_tokens=k + 1)  # fmt: skip


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(answer_module, "time", types.SimpleNamespace(monotonic=clock))
    return clock


def context(clock: Clock) -> RequestContext:
    timeline = TimelineRing(clock=clock).start("req-1", 0.0)
    return RequestContext("req-1", "completions", b"{}", "m", False, 0.0, timeline=timeline)


def observed(histogram: LoopHistogram) -> tuple[int, float]:
    return sum(histogram.counts), round(histogram.sum, 9)


def marks(ctx: RequestContext) -> dict[str, dict]:
    assert ctx.timeline is not None
    return {e["event"]: e for e in ctx.timeline.events}


async def drain(stream: AsyncIterator[bytes]) -> None:
    async for _ in stream:
        pass


async def test_through_p_the_gap_and_the_handoff_are_measured_from_p_s_answer(
    clock: Clock,
) -> None:
    result = PrefillResult(request_id="req-1", prompt_token_ids=PROMPT, first_token_id=100,
                           first_text=" t0")  # fmt: skip
    answers = ScriptedAnswers(clock, [(1.25, [event(1)]), (1.3, [event(2)]), (1.32, [event(3)])])
    ctx = context(clock)
    clock.now_s = ctx.prefill_done_s = 1.0  # P's result arrived (orchestrator.prefill sets it)
    await drain(answers.stream(ctx, result))
    m = answers.metrics
    assert observed(m.ttft_s) == (1, 1.0)
    assert observed(m.handoff_after_first_token_s) == (1, 0.25)
    assert observed(m.first_to_second_token_s) == (1, 0.25)
    assert observed(m.itl_s) == (3, 0.32)
    events = marks(ctx)
    assert events["first_decode_token"]["handoff_after_first_token_ms"] == 250.0
    assert events["second_token_sent"]["first_to_second_token_ms"] == 250.0
    assert events["second_token_sent"]["at_ms"] == 1250.0


async def test_after_local_prefill_d_s_first_token_is_ttft_and_no_handoff_is_left(
    clock: Clock,
) -> None:
    local = LocalPrefill(request_id="req-1", prompt_token_ids=PROMPT, num_uncached_tokens=5,
                         threshold_tokens=64)  # fmt: skip
    batches = [(2.0, [event(0)]), (2.125, [event(1)]), (2.2, [event(2), event(3)])]
    answers = ScriptedAnswers(clock, batches)
    ctx = context(clock)
    clock.now_s = 0.5  # P's LocalPrefill: nothing to measure from
    await drain(answers.stream(ctx, local))
    m = answers.metrics
    assert observed(m.ttft_s) == (1, 2.0)
    assert observed(m.handoff_after_first_token_s) == (0, 0.0)
    assert observed(m.first_to_second_token_s) == (1, 0.125)
    assert observed(m.itl_s) == (3, 0.2)  # 0.125, then 0.075 and 0 for the one that came with it
    events = marks(ctx)
    assert events["first_token_sent"]["at_ms"] == 2000.0
    assert "handoff_after_first_token_ms" not in events["first_decode_token"]
    assert events["second_token_sent"]["first_to_second_token_ms"] == 125.0


async def test_first_and_second_token_in_one_write_is_a_zero_gap(clock: Clock) -> None:
    local = LocalPrefill(request_id="req-1", prompt_token_ids=PROMPT, num_uncached_tokens=5,
                         threshold_tokens=64)  # fmt: skip
    answers = ScriptedAnswers(clock, [(3.0, [event(0), event(1)]), (3.5, [event(2), event(3)])])
    ctx = context(clock)
    await drain(answers.stream(ctx, local))
    assert observed(answers.metrics.first_to_second_token_s) == (1, 0.0)
    assert observed(answers.metrics.itl_s) == (3, 0.5)


async def test_an_answer_not_streamed_has_no_first_to_second_gap(clock: Clock) -> None:
    result = PrefillResult(request_id="req-1", prompt_token_ids=PROMPT, first_token_id=100,
                           first_text=" t0")  # fmt: skip
    answers = ScriptedAnswers(clock, [(1.5, [event(1)]), (1.6, [event(2), event(3)])])
    ctx = context(clock)
    clock.now_s = ctx.prefill_done_s = 1.0
    answer = await answers.complete(ctx, result)
    assert answer["choices"][0]["text"] == " t0 t1 t2 t3"
    assert observed(answers.metrics.first_to_second_token_s) == (0, 0.0)
    assert observed(answers.metrics.handoff_after_first_token_s) == (1, 0.5)
