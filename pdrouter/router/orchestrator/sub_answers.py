"""A sub-request's answer (orchestrator.choices): each sub-request of a request of several
sequences is answered as a plain request, with what it shares counted for the request once.

    SubAnswers        any sub-request: the request's first token (TTFT, first_token_sent)
                      is the first of its sub-requests' to come, observed and marked once,
                      and so is a stream's second token (Firsts)
    SequenceAnswers   a forked sequence: its D events are its share of its group's decode
                      (orchestrator.group_decode), and the group's first D event ends the
                      group's handoff, measured once from its one prefill
    sequence_result   the group's P result as one sequence sees it (its own first token)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdrouter.router.orchestrator.answer import Answers
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.group_decode import GroupDecode
from pdrouter.wire.pd import DecodeEvent, FirstToken, LocalPrefill, PrefillResult


@dataclass
class Firsts:
    """What a request's sub-requests count for it once: whether its first token (TTFT) and a
    stream's second token (the first-to-second token gap) have been counted."""

    request: RequestContext
    first_token: bool = False
    second_token: bool = False


class SubAnswers(Answers):
    """A sub-request's answer: the request's first token (its TTFT, its timeline's mark) is
    the first to come of its sub-requests', its second token the first sub-request's second
    to leave, each counted once."""

    def __init__(self, answers: Answers, firsts: Firsts) -> None:
        super().__init__(answers.metrics, answers.decode, answers.missing_kv_policy)
        self.firsts = firsts

    def _first_token(self, ctx: RequestContext, sent: bool) -> float:
        if self.firsts.first_token:
            return time.monotonic()
        self.firsts.first_token = True
        return super()._first_token(self.firsts.request, sent)

    def _second_token(
        self, ctx: RequestContext, num_before: int, t_first: float, now: float
    ) -> None:
        if not self.firsts.second_token:
            self.firsts.second_token = True
            super()._second_token(self.firsts.request, num_before, t_first, now)


class SequenceAnswers(SubAnswers):
    """A forked sequence's answer: D's events are its share of its group's decode."""

    def __init__(self, answers: Answers, firsts: Firsts, decode: GroupDecode, index: int) -> None:
        super().__init__(answers, firsts)
        self.group_decode = decode
        self.index = index

    def _events(
        self, ctx: RequestContext, result: PrefillResult | LocalPrefill
    ) -> AsyncIterator[list[DecodeEvent]]:
        return self.group_decode.events(self.index)

    def _decode_started(self, ctx: RequestContext, now: float) -> None:
        """The group's first D event (of any of its sequences) is its handoff's end, measured
        once from its one prefill (the sequences' own contexts had none) and marked on the
        group's timeline (the request's, for one prompt)."""
        ctx.decode_first_s = now
        group = self.group_decode.ctx
        if not group.decode_first_s:
            super()._decode_started(group, now)


def sequence_result(result: PrefillResult, first: FirstToken) -> PrefillResult:
    """A group's P result as one of its sequences sees it: first, its own first token."""
    return result.model_copy(
        update={
            "first_token_id": first.token_id,
            "first_text": first.text,
            "first_logprobs": first.logprobs,
            "finish_reason": first.finish_reason,
            "sequences": [],
        }
    )
