"""logprobs through PD equal the mixed worker's: P reports the first token's, D the rest's, the
router joins them; both routes, streamed and not, within float tolerance.

Each answer is reduced to one (token, logprob, [(top token, top logprob)]) row per generated
token, in the order the tokens were generated (a stream's chunks concatenated).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.pd.clients import client, prompt_ids
from tests.e2e.pd.conftest import BLOCK_SIZE, MODEL, PDCluster

TOLERANCE = 1e-4
TOP = 3
Row = tuple[str, float, list[tuple[str, float]]]


def _completion_rows(base_url: str, stream: bool, **kwargs: Any) -> tuple[list[Row], str]:
    api = client(base_url)
    if stream:
        chunks = list(api.completions.create(stream=True, **kwargs))
        choices = [c.choices[0] for c in chunks if c.choices]
        parts = [c.logprobs for c in choices if c.logprobs is not None]
        text = "".join(c.text for c in choices)
    else:
        choice = api.completions.create(**kwargs).choices[0]
        parts, text = [choice.logprobs], choice.text
    rows, offsets = [], []
    for lp in parts:
        for token, logprob, top, offset in zip(
            lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True
        ):
            # completions' top dict: the k most likely and the sampled token
            assert token in top and len(top) in (TOP, TOP + 1)
            rows.append((token, logprob, sorted(top.items(), key=lambda kv: -kv[1])[:TOP]))
            offsets.append(offset)
    expected_offsets = [sum(len(r[0]) for r in rows[:i]) for i in range(len(rows))]
    assert offsets == expected_offsets
    return rows, text


def _chat_rows(base_url: str, stream: bool, **kwargs: Any) -> tuple[list[Row], str]:
    api = client(base_url)
    if stream:
        chunks = list(api.chat.completions.create(stream=True, **kwargs))
        choices = [c.choices[0] for c in chunks if c.choices]
        entries = [e for c in choices if c.logprobs is not None for e in c.logprobs.content]
        text = "".join(c.delta.content or "" for c in choices)
    else:
        choice = api.chat.completions.create(**kwargs).choices[0]
        entries, text = choice.logprobs.content, choice.message.content or ""
    rows = []
    for e in entries:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == TOP
        rows.append((e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]))
    return rows, text


def _assert_close(pd: list[Row], mixed: list[Row], num_tokens: int) -> None:
    assert len(pd) == len(mixed) == num_tokens
    for i, ((tok, lp, top), (m_tok, m_lp, m_top)) in enumerate(zip(pd, mixed, strict=True)):
        assert tok == m_tok, f"token {i}"
        assert abs(lp - m_lp) < TOLERANCE, f"token {i}: {lp} vs {m_lp}"
        assert lp <= 0.0
        assert [t for t, _ in top] == [t for t, _ in m_top], f"top tokens of token {i}"
        for (_, a), (_, b) in zip(top, m_top, strict=True):
            assert abs(a - b) < TOLERANCE, f"top logprob of token {i}"
        assert top[0][1] >= lp - TOLERANCE  # the most likely is at least as likely


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_equal_mixed(pd_cluster: PDCluster, stream: bool) -> None:
    max_tokens = 7
    kwargs = {"model": MODEL, "prompt": prompt_ids(2 * BLOCK_SIZE + 5, salt=4242),
              "max_tokens": max_tokens, "temperature": 0.8, "seed": 77, "logprobs": TOP,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    pd, pd_text = _completion_rows(pd_cluster.router_url, stream, **kwargs)
    mixed, mixed_text = _completion_rows(pd_cluster.mixed_url, False, **kwargs)
    assert pd_text == mixed_text
    _assert_close(pd, mixed, max_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_equal_mixed(pd_cluster: PDCluster, stream: bool) -> None:
    max_tokens = 6
    content = "".join(chr(c) for c in prompt_ids(BLOCK_SIZE + 3, salt=4343))
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": content}],
              "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
              "top_logprobs": TOP, "extra_body": {"ignore_eos": True}}  # fmt: skip
    pd, pd_text = _chat_rows(pd_cluster.router_url, stream, **kwargs)
    mixed, mixed_text = _chat_rows(pd_cluster.mixed_url, stream, **kwargs)
    assert pd_text == mixed_text
    _assert_close(pd, mixed, max_tokens)
    # greedy: each sampled token is the most likely one
    assert all(tok == top[0][0] for tok, _, top in pd)


@pytest.mark.slow
def test_one_token_answer_carries_p_s_logprobs(pd_cluster: PDCluster) -> None:
    """max_tokens 1 ends at P (no decode hop): its logprobs are P's alone."""
    kwargs = {"model": MODEL, "prompt": prompt_ids(9, salt=4444), "max_tokens": 1,
              "temperature": 0, "logprobs": 0}  # fmt: skip
    pd, _ = _completion_rows_top0(pd_cluster.router_url, **kwargs)
    mixed, _ = _completion_rows_top0(pd_cluster.mixed_url, **kwargs)
    assert len(pd) == 1 and pd[0][0] == mixed[0][0]
    assert abs(pd[0][1] - mixed[0][1]) < TOLERANCE


def _completion_rows_top0(base_url: str, **kwargs: Any) -> tuple[list[tuple[str, float]], str]:
    choice = client(base_url).completions.create(**kwargs).choices[0]
    lp = choice.logprobs
    # logprobs 0: no top tokens beyond the sampled one
    assert all(top == {tok: p} for tok, p, top in zip(lp.tokens, lp.token_logprobs,
                                                       lp.top_logprobs, strict=True))  # fmt: skip
    return list(zip(lp.tokens, lp.token_logprobs, strict=True)), choice.text
