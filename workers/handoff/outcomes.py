"""What put_blocks and get_blocks return (workers/handoff/pipeline.py), apart from the pipeline
so that the pool interface (slots.py HandoffPool) can name them without importing it."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.handoff.timings import ReadTimings, WriteTimings
from workers.pool.errors import BatchResult


@dataclass(frozen=True)
class PutOutcome:
    """P's result: one BatchResult per group, and what the thread waited on."""

    results: tuple[BatchResult, ...]
    timings: WriteTimings


@dataclass(frozen=True)
class GetOutcome:
    """D's result: blocks loaded in order up to the first miss, the keys the pool did not
    return in the group where reading stopped, and what the thread waited on."""

    num_loaded: int
    missing_keys: tuple[str, ...]
    timings: ReadTimings = field(default_factory=ReadTimings)
