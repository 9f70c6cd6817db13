"""pdrouter.wire.choices and pdrouter.wire.scoring without processes: which requests fan out,
the sub-request bodies and seeds, the merge (indexes, best_of, usage), the echo rewrite."""

from __future__ import annotations

import json

from pdrouter.wire.choices import (
    StreamMerge,
    choice_seed,
    group_bodies,
    merge_responses,
    plan_choices,
    sse_events,
    sub_bodies,
)
from pdrouter.wire.logprobs import TokenLogprob
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest, parse_request
from pdrouter.wire.scoring import EchoedPrompt, Scoring, scored


def _plan(cls: type, **body: object):  # type: ignore[no-untyped-def]
    return plan_choices(parse_request(cls, json.dumps({"model": "m", **body}).encode()))


def test_only_requests_of_several_sequences_or_scoring_fan_out() -> None:
    assert _plan(CompletionRequest, prompt="a") is None
    assert _plan(CompletionRequest, prompt=["a"]) is None
    assert _plan(ChatCompletionRequest, messages=[{"role": "user", "content": "x"}]) is None
    plan = _plan(CompletionRequest, prompt=["a", "b"], n=2, best_of=3)
    assert (plan.num_prompts, plan.n, plan.num_sequences_per_prompt) == (2, 2, 3)
    assert plan.num_sub_requests == 6 and [plan.prompt_of(k) for k in range(6)] == [0] * 3 + [1] * 3
    assert _plan(CompletionRequest, prompt="a", echo=True).echo
    assert _plan(CompletionRequest, prompt="a", max_tokens=0).score_only


def test_sub_bodies_one_prompt_one_choice_each_with_derived_seeds() -> None:
    body = {"model": "m", "prompt": [[1, 2], [3]], "n": 2, "seed": 7, "stream": True,
            "stream_options": {"include_usage": False}}  # fmt: skip
    plan = _plan(CompletionRequest, **{k: v for k, v in body.items() if k != "model"})
    subs = sub_bodies(body, plan)
    assert [s["prompt"] for s in subs] == [[1, 2], [1, 2], [3], [3]]
    assert [s["seed"] for s in subs] == [7, choice_seed(7, 1), 7, choice_seed(7, 1)]
    assert choice_seed(7, 1) != 7 and 0 <= choice_seed(7, 1) < 2**63
    assert all("n" not in s and s["stream_options"] == {"include_usage": True} for s in subs)
    # -1 is "no seed": none is sent, each sequence draws its own
    assert all("seed" not in s for s in sub_bodies({**body, "seed": -1}, plan))


def test_group_bodies_one_per_prompt_with_its_sequences_and_the_requests_seed() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "best_of": 3, "seed": 7}
    plan = _plan(CompletionRequest, **{k: v for k, v in body.items() if k != "model"})
    common = {"model": "m", "seed": 7, "logprobs": 0, "n": 2, "best_of": 3}
    assert group_bodies(body, plan) == [{**common, "prompt": "a"}, {**common, "prompt": "b"}]
    plan = _plan(CompletionRequest, prompt=[5, 6], n=3, logprobs=1, stream=True)
    no_seed = {"model": "m", "prompt": [5, 6], "n": 3, "logprobs": 1, "seed": -1, "stream": True}
    assert group_bodies(no_seed, plan) == [{"model": "m", "prompt": [5, 6], "n": 3, "logprobs": 1,
        "stream": True, "stream_options": {"include_usage": True}}]  # fmt: skip


def _answer(text: str, lps: list[float], prompt_tokens: int) -> dict:
    n = len(lps)
    return {"id": "x", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": {
                "tokens": list(text), "token_logprobs": lps, "top_logprobs": [{}] * n,
                "text_offset": list(range(n))}}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                      "total_tokens": prompt_tokens + n}}  # fmt: skip


def test_best_of_keeps_the_n_most_likely_and_usage_counts_prompts_once() -> None:
    plan = _plan(CompletionRequest, prompt=["a", "b"], n=1, best_of=2)
    answers = [_answer("xy", [-1.0, -1.0], 4), _answer("zw", [-0.5, -0.1], 4),
               _answer("pq", [-0.2, -0.2], 6), _answer("rs", [-3.0, 0.0], 6)]  # fmt: skip
    merged = merge_responses(answers, plan)
    assert [(c["index"], c["text"], c["logprobs"]) for c in merged["choices"]] == [
        (0, "zw", None),
        (1, "pq", None),
    ]
    assert merged["usage"]["prompt_tokens"] == 10 and merged["usage"]["completion_tokens"] == 8


def test_stream_merge_indexes_and_sums_usage() -> None:
    plan = _plan(CompletionRequest, prompt=["a", "b"], n=2, stream=True,
                 stream_options={"include_usage": True})  # fmt: skip
    merge = StreamMerge(plan, "cmpl-r", 5)
    chunk = {"id": "cmpl-r-3", "created": 9, "object": "text_completion",
             "choices": [{"index": 0, "text": "t"}]}  # fmt: skip
    (event,) = sse_events(merge.part(3, b"data: " + json.dumps(chunk).encode() + b"\n\n"))
    assert (event["id"], event["created"], event["choices"][0]["index"]) == ("cmpl-r", 5, 3)
    error = b'data: {"error": {"message": "engine failed"}}\n\n'
    assert merge.part(1, error + b'data: {"choices": [{"index": 0, "text": "late"}]}\n\n') == b""
    assert merge.error is not None and b"engine failed" in merge.error
    for sub in range(4):
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        assert merge.event(sub, {"choices": [], "usage": usage}) is None
    (total,) = sse_events(merge.usage_event())
    assert total["object"] == "text_completion" and total["choices"] == []
    assert total["usage"]["prompt_tokens"] == 6 and total["usage"]["completion_tokens"] == 8


def _entry(token: str, lp: float) -> TokenLogprob:
    return TokenLogprob(token=token, logprob=lp, top_logprobs=[])


def test_echo_puts_the_prompt_and_its_logprobs_first_and_score_only_drops_the_token() -> None:
    echoed = EchoedPrompt(text="ab", first_token="a", logprobs=[_entry("b", -0.5)])
    answer = _answer("c", [-0.25], 2)
    Scoring(echoed, score_only=False).response(answer)
    lp = answer["choices"][0]["logprobs"]
    assert answer["choices"][0]["text"] == "abc"
    assert (lp["tokens"], lp["token_logprobs"]) == (["a", "b", "c"], [None, -0.5, -0.25])
    assert lp["top_logprobs"][0] is None and lp["text_offset"] == [0, 1, 2]
    scored_only = _answer("c", [-0.25], 2)
    Scoring(echoed, score_only=True).response(scored_only)
    choice = scored_only["choices"][0]
    assert (choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"]) == (
        "ab", ["a", "b"], "length")  # fmt: skip
    assert scored_only["usage"]["completion_tokens"] == 0


def test_scored_stream_echoes_on_the_first_chunk_only() -> None:
    scoring = Scoring(EchoedPrompt(text="P:"), score_only=False)
    first = scored(scoring, b'data: {"choices":[{"index":0,"text":"x","logprobs":null}]}\n\n')
    second = scored(scoring, b'data: {"choices":[{"index":0,"text":"y","logprobs":null}]}\n\n')
    assert [e["choices"][0]["text"] for e in sse_events(first + second)] == ["P:x", "y"]
