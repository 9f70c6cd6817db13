"""Sampling controls through PD equal the mixed worker token for token (P samples the first
token with them, D the rest, its penalties counting P's token), greedy and seeded, streamed
and not, with the openai client as a user sends them."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.pd.clients import chat, client, complete, prompt_ids
from tests.e2e.pd.conftest import MODEL, PDCluster

# Each changes the tiny model's answer (checked below), so an engine that ignored one on
# either side would not match the mixed worker.
CONTROLS = {
    "penalties": {"presence_penalty": 1.5, "frequency_penalty": 1.0},
    "repetition": {"extra_body": {"repetition_penalty": 1.6, "min_tokens": 10}},
    "bias": {"logit_bias": {"65": 8.0, "66": 6.0}, "extra_body": {"min_p": 0.05}},
}


def _kwargs(name: str, seeded: bool) -> dict:
    sampling = (
        {"temperature": 0.9, "seed": 77, "extra_body": {"top_k": 30}}
        if seeded
        else {"temperature": 0}
    )
    controls = dict(CONTROLS[name])
    extra = {**sampling.pop("extra_body", {}), **controls.pop("extra_body", {})}
    return {"model": MODEL, "max_tokens": 14, **sampling, **controls, "extra_body": extra}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", list(CONTROLS))
def test_controls_through_pd_equal_mixed(
    pd_cluster: PDCluster, name: str, seeded: bool, stream: bool
) -> None:
    kwargs = {**_kwargs(name, seeded), "prompt": prompt_ids(41, salt=300)}
    pd = complete(client(pd_cluster.router_url), stream, **kwargs)
    mixed = complete(client(pd_cluster.mixed_url), False, **kwargs)
    assert pd == mixed
    assert pd.completion_tokens == 14
    if not stream:
        plain = {k: v for k, v in kwargs.items() if k not in CONTROLS[name]}
        plain["extra_body"] = {"top_k": 30} if seeded else {}
        assert complete(client(pd_cluster.mixed_url), False, **plain).text != mixed.text
    messages = [{"role": "user", "content": "penalize the repeats"}]
    chat_kwargs = {**_kwargs(name, seeded), "messages": messages}
    assert chat(client(pd_cluster.router_url), stream, **chat_kwargs) == chat(
        client(pd_cluster.mixed_url), False, **chat_kwargs
    )


@pytest.mark.slow
def test_a_control_the_engine_cannot_apply_is_a_400(pd_cluster: PDCluster) -> None:
    for url in (pd_cluster.router_url, pd_cluster.mixed_url):
        with pytest.raises(openai.BadRequestError) as info:
            client(url).completions.create(
                model=MODEL, prompt="x", max_tokens=2, logit_bias={"100000": 1}
            )
        assert "outside the vocabulary" in str(info.value)
        with pytest.raises(openai.BadRequestError) as info:
            client(url).completions.create(
                model=MODEL, prompt="x", max_tokens=2, extra_body={"min_tokens": 3}
            )
        assert info.value.body["param"] == "min_tokens"
