"""POST /v1/responses through PD and on the mixed worker, with the openai client's
client.responses.create (streamed and not) and langchain's ChatOpenAI(use_responses_api=True):
the same answer as the chat route, token for token, with usage."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.pd.clients import Answer, chat, client
from tests.e2e.pd.conftest import MODEL, PDCluster

INSTRUCTIONS = "Answer briefly."
QUESTION = "What does a decode worker do?"
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]


def respond(api: openai.OpenAI, stream: bool, **kwargs) -> Answer:
    """A Responses turn reduced to (text, finish, input tokens, output tokens)."""
    if not stream:
        r = api.responses.create(**kwargs)
        assert r.output[0].type == "message" and r.output[0].role == "assistant"
        finish = "length" if r.status == "incomplete" else "stop"
        return Answer(r.output_text, finish, r.usage.input_tokens, r.usage.output_tokens)
    events = list(api.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas == events[-4].text
    finish = {"response.completed": "stop", "response.incomplete": "length"}[kinds[-1]]
    return Answer(deltas, finish, final.usage.input_tokens, final.usage.output_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_text_turn_equals_the_chat_answer_through_pd_and_mixed(
    pd_cluster: PDCluster, stream: bool
) -> None:
    kwargs = {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "input": QUESTION,
        "max_output_tokens": 12,
        "temperature": 0,
    }
    expected = chat(
        client(pd_cluster.mixed_url),
        False,
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
    )
    assert expected.finish_reason == "length"
    for url in (pd_cluster.router_url, pd_cluster.mixed_url):
        assert respond(client(url), stream, **kwargs) == expected, url
    seeded = {
        "model": MODEL,
        "max_output_tokens": 10,
        "temperature": 0.8,
        "top_p": 0.9,
        "extra_body": {"seed": 5},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
    }
    assert respond(client(pd_cluster.router_url), stream, **seeded) == respond(
        client(pd_cluster.mixed_url), False, **seeded
    )


@pytest.mark.slow
def test_refusals_are_400s_naming_the_responses_field(pd_cluster: PDCluster) -> None:
    api = client(pd_cluster.router_url)
    for kwargs, param in [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            api.responses.create(model=MODEL, **kwargs)
        assert info.value.body["param"] == param


@pytest.mark.slow
def test_a_refused_type_is_quoted_clipped_not_echoed_whole(pd_cluster: PDCluster) -> None:
    # The error quoted it whole (150 KB of it, past this cluster's 512-token body bound).
    big = "x" * 1_500
    prefix = '"' + "x" * 63
    for body, param, says in [
        ({"input": [{"type": big}]}, "input[0].type", "input[0]: items of type "),
        ({"input": [{"role": "user", "content": [{"type": big}]}]}, "input[0].content[0]",
         "input[0].content[0] has type "),
        ({"input": "x", "tools": [{"type": big}]}, "tools[0].type", "tools[0]: tools of type "),
    ]:  # fmt: skip
        response = httpx.post(f"{pd_cluster.router_url}/v1/responses",
                              json={"model": MODEL, **body}, timeout=60)  # fmt: skip
        assert response.status_code == 400
        assert len(response.content) < 1000, len(response.content)
        error = response.json()["error"]
        assert error["param"] == param, error
        assert error["message"].startswith(f"{says}{prefix}... (1502 characters)")


@pytest.mark.slow
def test_langchain_chat_openai_on_the_responses_api(pd_cluster: PDCluster) -> None:
    import langchain_openai  # a dev extra; imported here so that collection stays quick

    expected = chat(
        client(pd_cluster.mixed_url),
        False,
        model=MODEL,
        max_tokens=8,
        temperature=0,
        messages=[{"role": "user", "content": QUESTION}],
    )
    llm = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"{pd_cluster.router_url}/v1",
        api_key="unused",
        use_responses_api=True,
        max_tokens=8,
        temperature=0,
        max_retries=0,
    )
    message = llm.invoke(QUESTION)
    assert message.text == expected.text
    assert message.usage_metadata["output_tokens"] == expected.completion_tokens
    assert "".join(chunk.text for chunk in llm.stream(QUESTION)) == expected.text


def _logprob_rows(api: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, list[tuple]]:
    """A Responses turn with output logprobs: its text and one (token, logprob, top) row per
    token (streamed: the deltas' rows, checked to equal output_text.done's and the part's)."""
    if not stream:
        part = api.responses.create(**kwargs).output[0].content[0]
        entries, text = part.logprobs, part.text
        assert all(e.bytes == list(e.token.encode()) for e in entries)
    else:
        events = list(api.responses.create(stream=True, **kwargs))
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        entries = [lp for e in deltas for lp in e.logprobs]
        text = "".join(e.delta for e in deltas)
        done = next(e for e in events if e.type == "response.output_text.done")
        assert [(lp.token, lp.logprob) for lp in done.logprobs] == [
            (lp.token, lp.logprob) for lp in entries
        ]
        part = events[-1].response.output[0].content[0]
        assert [(lp.token, lp.logprob) for lp in part.logprobs] == [
            (lp.token, lp.logprob) for lp in entries
        ]
    rows = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in entries]
    return text, rows


def _assert_rows_close(got: list[tuple], expected: list[tuple]) -> None:
    assert [(token, [t for t, _ in top]) for token, _, top in got] == [
        (token, [t for t, _ in top]) for token, _, top in expected
    ]
    for (_, lp, top), (_, m_lp, m_top) in zip(got, expected, strict=True):
        assert lp == pytest.approx(m_lp, abs=1e-4)
        assert [v for _, v in top] == pytest.approx([v for _, v in m_top], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_output_logprobs_through_pd_equal_mixed_and_the_chat_route(
    pd_cluster: PDCluster, stream: bool
) -> None:
    kwargs = {
        "model": MODEL,
        "input": QUESTION,
        "max_output_tokens": 8,
        "temperature": 0.8,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "extra_body": {"seed": 11},
    }
    chat_choice = (
        client(pd_cluster.mixed_url)
        .chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=8,
            temperature=0.8,
            seed=11,
            logprobs=True,
            top_logprobs=2,
        )
        .choices[0]
    )
    chat_rows = [
        (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
        for e in chat_choice.logprobs.content
    ]
    mixed_text, mixed = _logprob_rows(client(pd_cluster.mixed_url), stream, **kwargs)
    pd_text, pd = _logprob_rows(client(pd_cluster.router_url), stream, **kwargs)
    assert len(chat_rows) == 8 and all(len(top) == 2 for _, _, top in chat_rows)
    assert pd_text == mixed_text == chat_choice.message.content
    _assert_rows_close(mixed, chat_rows)
    _assert_rows_close(pd, chat_rows)
