"""cache_aware: prompt keys, the score (hit fraction minus the load penalty), a hot prefix
spread as queues grow, and two replicas with the same events deciding alike."""

from __future__ import annotations

import json

from pdrouter.router.instances.instance import Instance
from pdrouter.router.selection.cache_aware import CacheAware, CacheRoutingConfig
from pdrouter.router.selection.policies import make_policy
from pdrouter.wire.cache_events import Anchor, CacheSnapshot
from pdrouter.wire.prompt_keys import CHUNK_CHARS, body_prompt_keys, prompt_keys

SYSTEM = "you are terse " * 20


def _ps(n: int) -> list[Instance]:
    return [Instance(f"http://127.0.0.1:{9100 + i}", "prefill", block_size=16) for i in range(n)]


def _chat(*contents: str, max_tokens: int = 8) -> bytes:
    roles = ["system"] + ["user"] * (len(contents) - 1)
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
    return json.dumps({"model": "m", "max_tokens": max_tokens, "messages": messages}).encode()


def _holding(policy: CacheAware, url: str, *hashes: str) -> None:
    """url's snapshot holds hashes; the system prompt's key is anchored to 8 blocks ending h8."""
    key = body_prompt_keys(_chat(SYSTEM, "q"))[0]
    policy.index.load(
        url,
        CacheSnapshot(epoch="e", next_seq=0, tiers={"device": list(hashes)},
                      anchors=[Anchor(key=key, num_blocks=8, last_hash="h8")]),
    )  # fmt: skip


def test_prompt_keys_name_the_prompt_only_and_chain() -> None:
    assert body_prompt_keys(_chat("a", "b", max_tokens=1)) == body_prompt_keys(_chat("a", "b"))
    one, two = body_prompt_keys(_chat("a")), body_prompt_keys(_chat("a", "b"))
    assert len(two) == 2 and two[0] == one[0] and two[1] not in one
    text = prompt_keys({"prompt": "x" * CHUNK_CHARS * 2 + "y"})
    assert len(text) == 2 and prompt_keys({"prompt": "x" * CHUNK_CHARS})[0] == text[0]
    assert body_prompt_keys(b"not json") == [] and prompt_keys({"prompt": [1, 2]}) == []
    developer = {"messages": [{"role": "developer", "content": "a"}]}
    assert prompt_keys(developer) == body_prompt_keys(_chat("a"))  # as the template sees it


def test_the_holder_wins_while_the_load_penalty_is_smaller() -> None:
    policy = CacheAware(CacheRoutingConfig(load_weight=0.25))
    ps = _ps(2)
    _holding(policy, ps[1].url, "h8")
    body = _chat(SYSTEM, "question")
    scores = policy.scores(ps, body)
    assert scores == {ps[0].url: 0.0, ps[1].url: 1.0}  # all 8 known blocks (estimate: 4)
    assert policy.pick_for(ps, body) is ps[1]
    ps[1].in_flight = 3  # penalty 0.75 against the hit fraction 1.0
    assert policy.scores(ps, body)[ps[1].url] == 0.25 and policy.pick_for(ps, body) is ps[1]
    ps[1].in_flight = 5  # 1.25: more than any hit is worth
    assert policy.pick_for(ps, body) is ps[0]


def test_a_hot_prefix_spreads_once_every_p_holds_it() -> None:
    policy = CacheAware()
    ps = _ps(2)
    for p in ps:
        _holding(policy, p.url, "h8")
    chosen = []
    for _ in range(6):  # each request stays in flight
        inst = policy.pick_for(ps, _chat(SYSTEM, "q"))
        inst.in_flight += 1
        chosen.append(inst.url)
    assert [ps[0].in_flight, ps[1].in_flight] == [3, 3]
    assert chosen == [ps[0].url, ps[1].url] * 3  # ties: fewer in flight, then the URL


def test_two_replicas_with_the_same_events_decide_alike() -> None:
    a, b = CacheAware(), CacheAware()
    ps_a, ps_b = _ps(3), list(reversed(_ps(3)))  # registration order differs
    for policy in (a, b):
        _holding(policy, ps_a[2].url, "h8")
        _holding(policy, ps_a[1].url, "other")
    for body in (_chat(SYSTEM, "x"), _chat("unknown"), b'{"prompt": "p"}'):
        assert a.pick_for(ps_a, body).url == b.pick_for(ps_b, body).url
    assert a.pick_for(ps_a, _chat(SYSTEM, "x")).url == ps_a[2].url
    assert a.pick_for(ps_a, _chat("unknown")).url == ps_a[0].url  # no hit: least loaded, URL


def test_make_policy_and_a_bad_config() -> None:
    policy = make_policy("cache_aware", CacheRoutingConfig(load_weight=0.5))
    assert isinstance(policy, CacheAware) and policy.cfg.load_weight == 0.5
    try:
        CacheRoutingConfig(load_weight=-1)
    except ValueError:
        pass
    else:
        raise AssertionError("a negative weight was accepted")
