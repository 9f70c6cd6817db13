"""GrammarCompiler with real child processes: a size budget checked before any compile, a
time budget that kills the compile (a fresh child serves the next one), refusals cached like
grammars, one compile for a schema asked by several threads at once, children stopped at
close."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator

import pytest

from workers.engine.grammar_compiler import (
    GrammarBudget,
    GrammarBudgetError,
    GrammarCompiler,
    GrammarCounts,
    GrammarError,
    TokenizerSpec,
)

NO_TOKENIZER = TokenizerSpec(None, 0, ())
SMALL = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})


def _slow(num_keys: int = 300) -> str:
    """Seconds to validate: every pattern property's key regex against all the others."""
    properties = {f"^k{i}_[a-z]{{2,9}}[0-9]*$": {"type": "string", "pattern": f"^v{i}[0-9]+$"}
                  for i in range(num_keys)}  # fmt: skip
    return json.dumps({"type": "object", "patternProperties": properties})


@pytest.fixture
def compiler() -> Iterator[GrammarCompiler]:
    budget = GrammarBudget(max_schema_bytes=50_000, compile_timeout_s=1.0)
    compiler = GrammarCompiler(NO_TOKENIZER, budget)
    yield compiler
    compiler.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_past_the_time_budget_the_child_is_killed_and_the_refusal_cached(compiler):
    compiler.compile(SMALL)
    [first_pid] = compiler.idle_pids()
    t0 = time.monotonic()
    with pytest.raises(GrammarBudgetError, match=r"time budget of 1 s \(--grammar-compile"):
        compiler.compile(_slow())
    assert time.monotonic() - t0 < 2.0
    assert not _alive(first_pid) and compiler.idle_pids() == []
    with pytest.raises(GrammarBudgetError):  # again: from the cache, at once
        compiler.compile(_slow())
    assert compiler.compile(SMALL) == compiler.compile(SMALL)  # cached: no child needed
    assert compiler.idle_pids() == []
    compiler.compile(json.dumps({"type": "array"}))  # a miss: a fresh child
    assert len(compiler.idle_pids()) == 1 and compiler.idle_pids() != [first_pid]
    assert compiler.counts() == GrammarCounts(compiled=2, cache_hit=3, over_budget=1)


def test_the_size_budget_is_checked_before_any_compile(compiler):
    big = json.dumps({"enum": ["x" * 100] * 600})
    with pytest.raises(GrammarBudgetError) as info:
        compiler.compile(big)
    assert str(info.value) == (
        f"the schema is {len(big)} bytes, over the grammar size budget of 50000 bytes "
        "(--grammar-max-schema-bytes)"
    )
    assert compiler.idle_pids() == [] and compiler.counts() == GrammarCounts(over_budget=1)


def test_refusals_are_cached_and_one_schema_compiles_once(compiler):
    bad = json.dumps({"properties": {"a": {"$ref": "#/nowhere"}}})
    for _ in range(2):
        with pytest.raises(GrammarError, match="nowhere") as info:
            compiler.compile(bad)
        assert not isinstance(info.value, GrammarBudgetError)
    schema = _slow(60)  # long enough that the others ask while it compiles
    answers: list[str] = []
    threads = [threading.Thread(target=lambda: answers.append(compiler.compile(schema)))
               for _ in range(3)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(answers) == 3 and len(set(answers)) == 1
    assert compiler.counts() == GrammarCounts(compiled=1, cache_hit=3, rejected=1)


def test_close_stops_the_children(compiler):
    compiler.compile(SMALL)
    pids = compiler.idle_pids()
    compiler.close()
    assert compiler.idle_pids() == [] and not any(_alive(pid) for pid in pids)
    with pytest.raises(GrammarError, match="shut down"):
        compiler.compile(json.dumps({"type": "string"}))
