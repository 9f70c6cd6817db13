"""A dict-backed stand-in for KVPoolClient over a NumpyRunner engine, for the narrow unit tests
of the pool prefix tier and of write-back: the faults it injects (a key gone between lookup and
load, a failing or slow pool) are ones a real pool cannot be made to produce on cue.

The NumpyRunner "KV" of a position is its token id (int64). The engine exposes it to
swap_cache_layout as K and V of one layer, [num_blocks, 1 head, block_size, 2 int32 halves],
so a pool value is the block's token ids twice (K and V): loading a wrong block shows up as a
wrong token in the answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from tests.workers.engine.char_tokenizer import CharTokenizer
from tests.workers.engine.numpy_runner import NumpyRunner
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig
from workers.pool.errors import BatchResult, MasterUnreachableError
from workers.pool.staging import SlotAllocator, StagingBuffer
from workers.server.cache_metrics import CacheMetrics
from workers.server.config import PDSettings

MISSING = -704


def kv_views(cache: np.ndarray) -> list[np.ndarray]:
    """NumpyRunner's [num_blocks, block_size] int64 cache as swap_cache_layout's K, V."""
    num_blocks, block_size = cache.shape
    view = cache.view(np.int32).reshape(num_blocks, 1, block_size, 2)
    return [view, view]


def block_value(tokens: Sequence[int]) -> bytes:
    """The pool value of a block holding tokens (K then V, the same bytes)."""
    one = np.asarray(tokens, dtype=np.int64).tobytes()
    return one + one


@dataclass
class FakeConfig:
    slot_bytes: int


class FakePool:
    """exists / get_into / put_from over a dict; faults set as attributes."""

    def __init__(self, block_size: int, num_slots: int = 16) -> None:
        slot_bytes = 2 * block_size * 8
        self.config = FakeConfig(slot_bytes)
        self.buffer = StagingBuffer(num_slots, slot_bytes)
        self.slots = SlotAllocator(num_slots)
        self.store: dict[str, bytes] = {}
        self.is_open = True
        self.calls: list[tuple[str, int]] = []  # (call, number of keys)
        self.exists_error = False
        self.remove_before_get: set[str] = set()  # deleted between lookup and load
        self.get_delay_s = 0.0
        self.get_started = threading.Event()
        self.on_put: Callable[[Sequence[str]], None] | None = None  # runs before a put reads

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.calls.append(("exists", len(keys)))
        if self.exists_error:
            raise MasterUnreachableError("fake: master unreachable")
        return [k in self.store for k in keys]

    def get_into(self, keys: Sequence[str], slots: Sequence[int]) -> BatchResult:
        self.calls.append(("get", len(keys)))
        self.get_started.set()
        time.sleep(self.get_delay_s)
        for k in self.remove_before_get:
            self.store.pop(k, None)
        codes = []
        for key, slot in zip(keys, slots, strict=True):
            value = self.store.get(key)
            if value is None:
                codes.append(MISSING)
                continue
            self.buffer.view[slot, : len(value)] = np.frombuffer(value, dtype=np.uint8)
            codes.append(len(value))
        return BatchResult.from_codes(keys, codes)

    def put_from(self, keys: Sequence[str], slots: Sequence[int]) -> BatchResult:
        self.calls.append(("put", len(keys)))
        if self.on_put is not None:
            self.on_put(keys)
        for key, slot in zip(keys, slots, strict=True):
            self.store.setdefault(key, self.buffer.view[slot].tobytes())
        return BatchResult.from_codes(keys, [0] * len(keys))


class FakeEngine:
    """An AsyncEngine with the NumpyRunner's cache exposed as swap_cache_layout tensors."""

    def __init__(self, engine: Any, cache: np.ndarray) -> None:
        self._engine = engine
        self.kv_caches = kv_views(cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@dataclass
class FakeContext:
    """What pool_prefix and writeback read of a PDContext."""

    engine: Any
    pool: FakePool
    fingerprint: str
    block_size: int
    settings: PDSettings
    cache_metrics: CacheMetrics
    registry: CollectorRegistry
    metrics: Any = None  # PDMetrics (write-back counts bytes there)
    background: set = field(default_factory=set)

    def require_pool(self) -> FakePool:
        return self.pool

    def wait_for_slots(self, num_slots: int, deadline_s: float) -> list[int]:
        slots = self.pool.slots.allocate(num_slots)
        assert slots is not None, "fake pool: staging full"
        return slots


def numpy_engines(
    block_size: int,
    num_blocks: int,
    max_num_batched_tokens: int = 64,
    runner: NumpyRunner | None = None,
) -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    """A started engine over NumpyRunner (or runner, one of its kind), for a fixture to
    `yield from`; shut down after."""
    config = EngineConfig(
        model="numpy-stand-in",
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=64,
    )
    runner = runner or NumpyRunner(num_blocks, block_size)
    llm = LLMEngine(runner, CharTokenizer(), config, vocab_size=128)
    eng = AsyncEngine(llm)
    eng.start()
    yield eng, llm
    assert eng.shutdown(timeout_s=5.0)


def fake_context(
    engines: tuple[AsyncEngine, LLMEngine],
    block_size: int,
    settings: PDSettings,
    metrics: Any = None,
) -> FakeContext:
    """A FakeContext over numpy_engines' engine, an empty FakePool and a fresh registry;
    metrics, where given, is built on that registry (metrics(registry))."""
    eng, llm = engines
    registry = CollectorRegistry()
    return FakeContext(
        engine=FakeEngine(eng, llm.runner.cache),
        pool=FakePool(block_size),
        fingerprint=llm.fingerprint,
        block_size=block_size,
        settings=settings,
        cache_metrics=CacheMetrics(registry),
        registry=registry,
        metrics=None if metrics is None else metrics(registry),
    )
