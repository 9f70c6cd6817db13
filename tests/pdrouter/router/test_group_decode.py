"""A group's decode keeps, for each sequence still going on, the tokens the client has of it:
what a failover's payload resumes each from, a finished sequence left out, an event of a
sequence that is not decoding a broken contract. Plain state, no sockets."""

from __future__ import annotations

import json

import pytest

from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.group_decode import GroupDecode
from pdrouter.router.orchestrator.sub_answers import sequence_result
from pdrouter.router.upstream.decode_stream import BadEvent
from pdrouter.wire.pd import DecodeEvent, DecodeRequest, FirstToken, KVHandle, PrefillResult

KV = KVHandle(fingerprint="f", block_size=4, num_tokens=3, keys=["k:partial:3"])


def _group() -> GroupDecode:
    ctx = RequestContext("req-g", "completions", b'{"prompt":[1,2,3],"n":3}', "m", True, 0.0)
    result = PrefillResult(
        request_id="req-g",
        prompt_token_ids=[1, 2, 3],
        first_token_id=10,
        first_text="a",
        kv=KV,
        sequences=[
            FirstToken(token_id=20, text="b", finish_reason="stop"),  # ended by P's token
            FirstToken(token_id=30, text="c"),
        ],
    )
    return GroupDecode(None, ctx, result, None)  # type: ignore[arg-type]


def _sent(group: GroupDecode) -> tuple[list[int], list[tuple[int, list[int]]]]:
    sent = DecodeRequest.model_validate_json(group._payload())
    assert sent.sequences is not None
    return sent.output_token_ids, [(s.index, s.output_token_ids) for s in sent.sequences]


def test_a_failover_resumes_each_unfinished_sequence_after_its_tokens() -> None:
    group = _group()
    assert [t.token_id for t in group.first_tokens] == [10, 20, 30]
    assert _sent(group) == ([10], [(0, [10]), (2, [30])])  # sequence 1 ended on P
    for ev in (
        DecodeEvent(token_ids=[11, 12], text="xy", num_output_tokens=3, index=0),
        DecodeEvent(token_ids=[31], text="z", num_output_tokens=2, index=2),
    ):
        group._advance(ev)
    assert _sent(group) == ([10, 11, 12], [(0, [10, 11, 12]), (2, [30, 31])])
    last_of_0 = DecodeEvent(token_ids=[13], text="w", num_output_tokens=4, finished=True,
                            finish_reason="length", index=0, more=True)  # fmt: skip
    group._advance(last_of_0)
    group._advance(DecodeEvent(token_ids=[32], text="v", num_output_tokens=3, index=2))
    assert _sent(group) == ([30, 31, 32], [(2, [30, 31, 32])])
    with pytest.raises(BadEvent):  # finished: it is not decoding any more
        group._advance(DecodeEvent(token_ids=[14], text="u", num_output_tokens=5, index=0))
    assert json.loads(group._payload())["body"] == {"prompt": [1, 2, 3], "n": 3}


def test_each_sequence_sees_its_own_first_token() -> None:
    group = _group()
    views = [sequence_result(group.result, first) for first in group.first_tokens]
    assert [(v.first_token_id, v.first_text, v.finish_reason) for v in views] == [
        (10, "a", None), (20, "b", "stop"), (30, "c", None)]  # fmt: skip
    assert all(v.sequences == [] and v.kv == KV for v in views)
