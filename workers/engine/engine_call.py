"""A block or lease call that AsyncEngine's thread applies between two steps, and how a
cancelled caller gets back what its call took (workers/engine/async_engine.py)."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.engine.engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass
class EngineCall:
    """A block or lease call for the engine thread; future (if any) gets its result."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future | None = None

    def run(self, engine: LLMEngine, after: Callable[[], None]) -> None:
        """fn(engine), then after() (the stats snapshot), then the caller is woken."""
        if self.future is not None and not self.future.set_running_or_notify_cancel():
            return  # the caller was cancelled before it ran: nothing taken
        try:
            result = self.fn(engine)
        except Exception as exc:  # the caller's error (e.g. a lease already released)
            if self.future is None:
                logger.exception("engine call failed")
            else:
                self.future.set_exception(exc)
            return
        after()
        if self.future is not None:
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        if self.future is not None and self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)


def undo_cancelled(
    future: concurrent.futures.Future,
    undo: Callable[[Any], object],
    undo_unrun: Callable[[], object] | None,
) -> None:
    """Give back what a cancelled caller's call took (or was handed), once it has settled."""
    if future.cancelled():
        if undo_unrun is not None:
            undo_unrun()
    elif future.exception() is None:
        undo(future.result())
