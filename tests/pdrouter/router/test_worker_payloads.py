"""What the router sends P and D: the client's body spliced in as the JSON it is (a seed added
when it has none), inside PrefillRequest and DecodeRequest documents built as bytes. They must
parse to exactly what the pydantic models would have sent."""

from __future__ import annotations

import json

import pytest

from pdrouter.router.service import body_for_workers
from pdrouter.router.upstream.decode_stream import parse_events
from pdrouter.wire.pd import (
    PREFILL_ANSWER,
    DecodeEvent,
    DecodeRequest,
    DecodeSequence,
    DecodeTimings,
    KVHandle,
    LocalPrefill,
    PrefillRequest,
    PrefillResult,
    decode_event_sse,
    decode_request_json,
    prefill_request_json,
)

BODY = {"model": "m", "prompt": 'Say "hi"\n and 日本', "max_tokens": 8, "stream": True}


def _seeded(raw: bytes, seed: int | None = None) -> dict:
    out = body_for_workers(raw, seed)
    body = json.loads(out)
    assert isinstance(body, dict)
    return body


def test_a_body_with_a_seed_passes_unchanged() -> None:
    raw = json.dumps({**BODY, "seed": 7}).encode()
    assert body_for_workers(raw, 7) is raw


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps(BODY).encode(),  # ASCII escapes for non-ASCII: decoded and encoded again
        json.dumps(BODY, ensure_ascii=False).encode(),  # spliced
        b"  \n" + json.dumps(BODY, ensure_ascii=False, indent=2).encode(),  # spliced
    ],
)
def test_a_seed_is_added_once_and_nothing_else_changes(raw: bytes) -> None:
    body = _seeded(raw)
    seed = body.pop("seed")
    assert isinstance(seed, int) and 0 <= seed < 2**31
    assert body == json.loads(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": "p", "seed": null}',  # an explicit null
        b'{"model": "m", "prompt": "p", "se\\u0065d": null}',  # the key spelled with an escape
        b'{"model": "m", "prompt": "a prompt that says \\"seed\\" and \\"seed\\""}',
    ],
)
def test_a_body_that_may_spell_a_seed_key_gets_exactly_one_seed(raw: bytes) -> None:
    out = body_for_workers(raw, None)
    pairs = json.loads(out, object_pairs_hook=lambda kv: kv)
    seeds = [value for key, value in pairs if key == "seed"]
    assert len(seeds) == 1 and isinstance(seeds[0], int), out


def test_each_request_draws_its_own_seed() -> None:
    raw = json.dumps(BODY).encode()
    assert len({_seeded(raw)["seed"] for _ in range(20)}) > 1


@pytest.mark.parametrize("threshold", [0, 64])
def test_prefill_request_bytes_are_the_models_document(threshold: int) -> None:
    raw = body_for_workers(json.dumps(BODY, ensure_ascii=False).encode(), None)
    sent = prefill_request_json("req-1", "chat", raw, None, threshold)
    expected = PrefillRequest(request_id="req-1", endpoint="chat", body=json.loads(raw),
                              local_prefill_below_tokens=threshold)  # fmt: skip
    assert PrefillRequest.model_validate_json(sent) == expected
    assert json.loads(sent) == json.loads(expected.model_dump_json())


def test_p_s_answer_parses_as_its_result_or_as_the_decision_to_prefill_on_decode() -> None:
    result = PrefillResult(request_id="r", prompt_token_ids=[1, 2], first_token_id=3,
                           first_text="x")  # fmt: skip
    local = LocalPrefill(request_id="r", prompt_token_ids=[1, 2], num_uncached_tokens=2,
                         threshold_tokens=64)  # fmt: skip
    for answer in (result, local):
        assert PREFILL_ANSWER.validate_json(answer.model_dump_json()) == answer
    with pytest.raises(ValueError):
        PREFILL_ANSWER.validate_json(b'{"request_id": "r", "prompt_token_ids": [1]}')


@pytest.mark.parametrize("kv", [None, KVHandle(fingerprint="fp", block_size=16, num_tokens=20,
                                                keys=["a/0", "a/1:partial:4"])])  # fmt: skip
@pytest.mark.parametrize("policy", [None, "recompute", "fail"])
def test_decode_request_bytes_are_the_models_document(
    kv: KVHandle | None, policy: str | None
) -> None:
    raw = json.dumps({**BODY, "seed": 3}).encode()
    sent = decode_request_json("r:2.x", "completions", raw, [1, 2, 3], [9, 10], kv, policy)  # type: ignore[arg-type]
    expected = DecodeRequest(
        request_id="r:2.x", endpoint="completions", body=json.loads(raw),
        prompt_token_ids=[1, 2, 3], output_token_ids=[9, 10], kv=kv,
        missing_kv_policy=policy,  # type: ignore[arg-type]
    )  # fmt: skip
    assert DecodeRequest.model_validate_json(sent) == expected
    assert json.loads(sent) == json.loads(expected.model_dump_json())


def test_a_group_decode_request_is_the_models_document() -> None:
    raw = json.dumps({**BODY, "seed": 3, "n": 2}).encode()
    seqs = [
        DecodeSequence(index=0, output_token_ids=[9]),
        DecodeSequence(index=2, output_token_ids=[7, 8]),
    ]
    sent = decode_request_json("r", "completions", raw, [1, 2, 3], [9], None, None, None, seqs)
    expected = DecodeRequest(
        request_id="r",
        endpoint="completions",
        body=json.loads(raw),
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[9],
        sequences=seqs,
    )
    assert DecodeRequest.model_validate_json(sent) == expected
    with pytest.raises(ValueError, match="output_token_ids the first one's"):
        DecodeRequest(request_id="r", endpoint="completions", body={}, prompt_token_ids=[1],
                      output_token_ids=[7], sequences=seqs)  # fmt: skip


def test_decode_events_leave_defaults_out_and_parse_back_the_same() -> None:
    token = DecodeEvent(token_ids=[5], text=" w1", num_output_tokens=2)
    final = DecodeEvent(
        token_ids=[6], text="", finished=True, finish_reason="length", num_output_tokens=3,
        num_blocks_loaded=2, num_tokens_recomputed=0, num_bytes_read=4096,
        timings=DecodeTimings(get_s=0.003, h2d_s=0.0, ttft_s=0.01),
    )  # fmt: skip
    sent = [decode_event_sse(token), decode_event_sse(final)]
    assert sent[0] == b'data: {"token_ids":[5],"text":" w1","num_output_tokens":2}\n\n'
    assert len(sent[0]) < len(b"data: " + token.model_dump_json().encode()) / 2
    assert parse_events([block.removesuffix(b"\n\n") for block in sent], "http://d") == [
        token,
        final,
    ]
