"""GrammarCompiler: JSON schema -> llguidance grammar, within a size and a time budget, cached.

    compile(schema_json)   canonical schema JSON (pdrouter.wire.structured.OutputConstraint)
      size      len(bytes) > max_schema_bytes             -> GrammarBudgetError (no compile)
      cache     a schema seen before answers what it did: the grammar, or the same error
                (a rejected schema costs nothing the second time)
      in flight the same schema already compiling: wait for that compile (one per schema)
      compile   in a child process (grammar_child.py), killed at compile_timeout_s
                                                          -> GrammarBudgetError
                what llguidance refuses (unsupported, unsatisfiable) -> GrammarError

Called from the servers' CPU threads (never the event loop, never the engine thread): the
thread waits on the child's pipe, so /health and every stream keep being served while a
schema compiles. At most `num_children` compiles run at once; a compile waits for a free
child, and each child frees within the budget. A killed child is replaced on the next miss.

Measured (tiny model, 2 cores): a 300-key `patternProperties` schema (24 KB) took 6.8 s to
validate and 2.1 s to build a matcher over the tokenizer; an ordinary schema 5-10 ms.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


class GrammarError(ValueError):
    """A schema the grammar library cannot compile; the message says why."""


class GrammarBudgetError(GrammarError):
    """A schema past a budget: its size or its compile time; the message names which."""


@dataclass(frozen=True)
class GrammarBudget:
    """What one schema may cost (EngineConfig's --grammar-* flags)."""

    max_schema_bytes: int = 65536
    compile_timeout_s: float = 5.0
    num_children: int = 2
    cache_size: int = 512


DEFAULT_BUDGET = GrammarBudget()


@dataclass(frozen=True)
class TokenizerSpec:
    """What the child needs to build the tokenizer's llguidance view; tokenizer_json None: none
    (the grammar is validated without one)."""

    tokenizer_json: str | None
    n_vocab: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class GrammarCounts:
    """Compiles by outcome, since start (pdworker_grammar_compiles_total)."""

    compiled: int = 0
    cache_hit: int = 0
    rejected: int = 0  # llguidance refused it (including cached refusals' first time)
    over_budget: int = 0


class _Child:
    """One compiler process; compile() answers within timeout_s or kills it."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers.engine.grammar_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self._send(
            {
                "tokenizer": spec.tokenizer_json,
                "n_vocab": spec.n_vocab,
                "eos": list(spec.eos_token_ids),
            }
        )

    def _send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def compile(self, schema_json: str, timeout_s: float) -> dict[str, str] | None:
        """The child's reply; None when it gave none within timeout_s (it is killed then)."""
        assert self.proc.stdout is not None
        try:
            self._send({"schema": schema_json})
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
            line = self.proc.stdout.readline() if ready else ""
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.kill()
            return None
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class GrammarCompiler:
    """Compiles schemas for one worker (its tokenizer), within a GrammarBudget; thread-safe."""

    def __init__(self, spec: TokenizerSpec, budget: GrammarBudget = DEFAULT_BUDGET) -> None:
        self._spec = spec
        self.budget = budget
        self._lock = threading.Lock()
        self._child_free = threading.Condition(self._lock)
        self._idle: list[_Child] = []
        self._num_children = 0  # idle or busy
        self._cache: OrderedDict[str, str | GrammarError] = OrderedDict()
        self._in_flight: dict[str, threading.Event] = {}
        self._counts = {"compiled": 0, "cache_hit": 0, "rejected": 0, "over_budget": 0}
        self._closed = False

    def idle_pids(self) -> list[int]:
        """Process ids of the children waiting for a compile (tests, diagnostics)."""
        with self._lock:
            return [child.proc.pid for child in self._idle]

    def counts(self) -> GrammarCounts:
        with self._lock:
            return GrammarCounts(**self._counts)

    def cached(self, schema_json: str) -> str | None:
        """The grammar of a schema answered before (its refusal raised again); None when it
        must be compiled. Never blocks on a compile: an event loop may ask."""
        with self._lock:
            if schema_json not in self._cache:
                return None
            self._cache.move_to_end(schema_json)
            self._counts["cache_hit"] += 1
            return _answer(self._cache[schema_json])

    def compile(self, schema_json: str) -> str:
        """The grammar of schema_json; GrammarBudgetError past a budget, GrammarError for a
        schema llguidance refuses. Blocks (a CPU thread) for at most about the time budget
        plus the wait for a free child."""
        size = len(schema_json.encode())
        if size > self.budget.max_schema_bytes:
            with self._lock:
                self._counts["over_budget"] += 1
            raise GrammarBudgetError(
                f"the schema is {size} bytes, over the grammar size budget of "
                f"{self.budget.max_schema_bytes} bytes (--grammar-max-schema-bytes)"
            )
        while True:
            with self._lock:
                if schema_json in self._cache:
                    self._cache.move_to_end(schema_json)
                    self._counts["cache_hit"] += 1
                    return _answer(self._cache[schema_json])
                running = self._in_flight.get(schema_json)
                if running is None:
                    done = self._in_flight[schema_json] = threading.Event()
                    break
            running.wait()  # the same schema compiling on another thread: its answer is ours
        try:
            result = self._compile_in_child(schema_json)
            with self._lock:
                self._cache[schema_json] = result
                while len(self._cache) > self.budget.cache_size:
                    self._cache.popitem(last=False)
                self._counts[_outcome(result)] += 1
        finally:
            with self._lock:
                del self._in_flight[schema_json]
            done.set()
        return _answer(result)

    def _compile_in_child(self, schema_json: str) -> str | GrammarError:
        child = self._take_child()
        t0 = time.monotonic()
        reply = child.compile(schema_json, self.budget.compile_timeout_s)
        if reply is not None and self._closed:
            child.kill()
        with self._lock:
            if reply is None or self._closed:  # killed (a fresh one next time), or shut down
                self._num_children -= 1
            else:
                self._idle.append(child)
            self._child_free.notify()
        if reply is None:
            return GrammarBudgetError(
                f"compiling the schema took longer than the grammar time budget of "
                f"{self.budget.compile_timeout_s:g} s (--grammar-compile-timeout-s); stopped "
                f"after {time.monotonic() - t0:.1f} s"
            )
        if "error" in reply:
            return GrammarError(reply["error"])
        return reply["grammar"]

    def _take_child(self) -> _Child:
        with self._lock:
            while not self._idle and self._num_children >= self.budget.num_children:
                self._child_free.wait()
            if self._closed:
                raise GrammarError("the grammar compiler is shut down")
            if self._idle:
                return self._idle.pop()
            self._num_children += 1
        try:
            return _Child(self._spec)
        except OSError:
            with self._lock:
                self._num_children -= 1
                self._child_free.notify()
            raise

    def close(self) -> None:
        """Stop every idle child (a busy one is stopped when its compile returns)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._child_free.notify_all()
        for child in idle:
            child.kill()


def _answer(result: str | GrammarError) -> str:
    if isinstance(result, GrammarError):
        raise type(result)(str(result))
    return result


def _outcome(result: str | GrammarError) -> str:
    if isinstance(result, GrammarBudgetError):
        return "over_budget"
    return "rejected" if isinstance(result, GrammarError) else "compiled"
