"""The fault pool (a dict-backed stand-in for KVPoolClient) and the real P/D seam over it and a
NumpyRunner engine, for the unit tests of the handoff and of the role handlers: the faults it
injects (a key gone between lookup and load, a failing or slow pool, no free staging slot)
are ones a real pool cannot be made to produce on cue.

The NumpyRunner "KV" of a position is its token id (int64). The engine exposes it to
swap_cache_layout as K and V of one layer, [num_blocks, 1 head, block_size, 2 int32 halves],
so a pool value is the block's token ids twice (K and V): loading a wrong block shows up as a
wrong token in the answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tests.workers.engine.char_tokenizer import CharTokenizer
from tests.workers.engine.numpy_runner import NumpyRunner
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig
from workers.pool.errors import BatchResult, MasterUnreachableError, PoolDegradedError
from workers.pool.pool_health import PoolHealth
from workers.pool.staging import SlotAllocator, StagingBuffer
from workers.server.app import worker_identity
from workers.server.cache_metrics import CacheMetrics
from workers.server.config import AppConfig, PDSettings
from workers.server.cpu_work import CpuWork
from workers.server.metrics import ServerMetrics
from workers.server.pd_worker import PDMetrics, PDSeam

MISSING = -704
MODEL = "numpy-stand-in"


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

    headers_later = None  # no optional capability (workers/handoff/slots.py HandoffPool)
    sharded = None

    def __init__(self, block_size: int, num_slots: int = 16) -> None:
        slot_bytes = 2 * block_size * 8
        self.config = FakeConfig(slot_bytes)
        self.buffer = StagingBuffer(num_slots, slot_bytes)
        self.slots = SlotAllocator(num_slots)
        self.store: dict[str, bytes] = {}
        self.is_open = True
        self.calls: list[tuple[str, int]] = []  # (call, number of keys)
        self.exists_error = False
        self.degraded = False  # the client reconnecting: exists() fails fast
        self.remove_before_get: set[str] = set()  # deleted between lookup and load
        self.get_delay_s = 0.0
        self.get_started = threading.Event()
        self.on_put: Callable[[Sequence[str]], None] | None = None  # runs before a put reads

    def health(self) -> PoolHealth:
        return PoolHealth("degraded", "fake: reconnecting") if self.degraded else PoolHealth("ok")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.calls.append(("exists", len(keys)))
        if self.exists_error:
            raise MasterUnreachableError("fake: master unreachable")
        if self.degraded:
            raise PoolDegradedError("fake: reconnecting")
        return [k in self.store for k in keys]

    def get_into(self, keys: Sequence[str], slots: Sequence[int], staging=None) -> BatchResult:
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

    def put_from(self, keys: Sequence[str], slots: Sequence[int], staging=None) -> BatchResult:
        self.calls.append(("put", len(keys)))
        if self.on_put is not None:
            self.on_put(keys)
        for key, slot in zip(keys, slots, strict=True):
            self.store.setdefault(key, self.buffer.view[slot].tobytes())
        return BatchResult.from_codes(keys, [0] * len(keys))


def numpy_engines(
    block_size: int,
    num_blocks: int,
    max_num_batched_tokens: int = 64,
    runner: NumpyRunner | None = None,
    **host_tier: Any,
) -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    """A started engine over NumpyRunner (or runner, one of its kind) whose cache the
    handoff can copy (kv_views), for a fixture to `yield from`; shut down after. host_tier:
    EngineConfig's swap_space_gib, write_policy, write_through_threshold."""
    config = EngineConfig(
        model="numpy-stand-in",
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=64,
        **host_tier,
    )
    runner = runner or NumpyRunner(num_blocks, block_size)
    runner.kv_caches = kv_views(runner.cache)
    llm = LLMEngine(runner, CharTokenizer(), config, vocab_size=128)
    eng = AsyncEngine(llm)
    eng.start()
    yield eng, llm
    assert eng.shutdown(timeout_s=5.0)


def numpy_seam(
    engine: AsyncEngine, settings: PDSettings, role: str = "prefill", pool: FakePool | None = None
) -> PDSeam:
    """The real P/D seam over a numpy_engines engine and the fault pool (empty unless given),
    with its metrics on one fresh registry (seam.server_metrics.registry)."""
    config = AppConfig(role=role, served_model_names=(MODEL,))
    server_metrics = ServerMetrics(lambda: None)
    registry = server_metrics.registry
    return PDSeam(
        engine=engine,
        pool=pool or FakePool(engine.engine_config.block_size),  # type: ignore[arg-type]
        settings=settings,
        identity=worker_identity(engine, config),
        metrics=PDMetrics(registry),
        cache_metrics=CacheMetrics(registry),
        server_metrics=server_metrics,
        cpu=CpuWork(1),
    )


def sample(seam: PDSeam, name: str, **labels: str) -> float:
    """One sample of the seam's registry; 0 when absent."""
    value = seam.server_metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
