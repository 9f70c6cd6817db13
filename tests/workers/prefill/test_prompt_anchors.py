"""prompt_anchors: on the real tiny tokenizer, each anchor's blocks are exactly the leading
blocks of every prompt that shares its key (another turn, another question), and its hash is
the prompt's own block hash."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest, parse_request
from pdrouter.wire.pd import PrefillRequest
from pdrouter.wire.prompt_keys import prompt_keys
from tests.wait import wait_until
from workers.engine.block_events import BlockEventLog
from workers.engine.tiny import materialize_tiny
from workers.engine.tokenizer import Tokenizer
from workers.pool.keys import block_hashes
from workers.prefill.prompt_anchors import AnchorThread, anchors_of, publish
from workers.server.prepare import prepare_request

BS = 4
FP = "fp"
SYSTEM = "You answer in one short sentence, and never in French. " * 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(Path(materialize_tiny("tiny", 0, tmp_path_factory.mktemp("t"))))


def _ids(tokenizer: Tokenizer, doc: dict) -> list[int]:
    cls = ChatCompletionRequest if "messages" in doc else CompletionRequest
    parsed = parse_request(cls, json.dumps({"model": "tiny", **doc}).encode())
    return prepare_request(parsed, "r", tokenizer, 4096).prompt_token_ids


def _chat(*turns: str) -> dict:
    roles = ["system"] + ["user", "assistant"] * len(turns)
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, turns, strict=False)]}


def _check(tokenizer: Tokenizer, doc: dict, other: dict, scope: str | None = None) -> int:
    """Every anchor of doc whose key other shares fixes blocks other has too; the most."""
    ids, other_ids = _ids(tokenizer, doc), _ids(tokenizer, other)
    anchors = anchors_of(tokenizer, doc, ids, FP, BS, scope)
    assert anchors, "no anchor"
    own = block_hashes(FP, ids, BS, scope)
    theirs = block_hashes(FP, other_ids, BS, scope)
    shared_keys = set(prompt_keys(doc, scope)) & set(prompt_keys(other, scope))
    best = 0
    for key, num_blocks, last in anchors:
        assert own[num_blocks - 1] == last
        if key in shared_keys:
            assert theirs[num_blocks - 1] == last  # the other prompt has these blocks too
            best = max(best, num_blocks)
    return best


def test_chat_anchors_hold_for_the_next_turn_and_another_question(tokenizer: Tokenizer) -> None:
    first = _chat(SYSTEM, "What is a block?")
    next_turn = _chat(SYSTEM, "What is a block?", "A unit of KV.", "And a page?")
    other = _chat(SYSTEM, "Something else entirely")
    system_blocks = _check(tokenizer, first, other)
    assert system_blocks >= len(SYSTEM) // BS // 2  # the system prompt's blocks, nearly all
    assert _check(tokenizer, first, next_turn) > system_blocks  # the whole first turn


def test_completion_anchors_and_scopes(tokenizer: Tokenizer) -> None:
    doc = {"prompt": SYSTEM * 4 + "tail one"}
    other = {"prompt": SYSTEM * 4 + "a different tail"}
    assert _check(tokenizer, doc, other) > 0
    assert _check(tokenizer, doc, other, scope="s") > 0
    ids = _ids(tokenizer, doc)
    scoped = {k for k, _, _ in anchors_of(tokenizer, doc, ids, FP, BS, "s")}
    assert scoped.isdisjoint(k for k, _, _ in anchors_of(tokenizer, doc, ids, FP, BS, None))
    assert anchors_of(tokenizer, {"prompt": "short"}, [1, 2], FP, BS, None) == []


def _seam(log: BlockEventLog, tokenizer: object) -> Any:
    identity = SimpleNamespace(fingerprint=FP, block_size=BS)
    return SimpleNamespace(engine=SimpleNamespace(block_events=log, tokenizer=tokenizer),
                           identity=identity)  # fmt: skip


def test_the_anchor_thread_logs_anchors_drops_past_its_bound_and_never_raises(
    tokenizer: Tokenizer,
) -> None:
    doc = _chat(SYSTEM, "What is a block?")
    ids = _ids(tokenizer, doc)
    req = PrefillRequest(request_id="r", endpoint="chat", body=doc)
    plan = SimpleNamespace(prepared=SimpleNamespace(prompt_token_ids=ids))
    log, thread = BlockEventLog(), AnchorThread()
    thread.submit(_seam(log, tokenizer), req, plan)
    wait_until(lambda: thread.num_pending, 30.0, "the anchors published", done=lambda n: n == 0)
    expected = anchors_of(tokenizer, doc, ids, FP, BS, None)
    events = log.since(0).events
    assert [(e.kind, e.key, e.num_blocks, e.hashes) for e in events] == [
        ("anchored", key, n, [last]) for key, n, last in expected
    ]
    thread.MAX_PENDING = 0  # type: ignore[misc]
    thread.submit(_seam(log, tokenizer), req, plan)
    assert thread.num_dropped == 1
    publish(log, None, req, ids, FP, BS)  # a broken tokenizer: logged, nothing published
    assert log.since(0).next_seq == len(expected)
