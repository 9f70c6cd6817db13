"""The decode tests' engine behind a gate: a step runs only when the test lets it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.workers.decode.step_gate import BS, NUM_BLOCKS, StepGate
from tests.workers.handoff.fake_pool import numpy_engines
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine


@pytest.fixture
def gate() -> StepGate:
    return StepGate()


@pytest.fixture
def gated(gate: StepGate) -> Iterator[tuple[AsyncEngine, LLMEngine]]:
    started = numpy_engines(BS, NUM_BLOCKS, runner=gate)
    yield next(started)
    gate.open()  # a test that failed midway leaves no step waiting at the shutdown
    next(started, None)
