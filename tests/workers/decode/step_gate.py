"""The decode tests' engine size and StepGate, a NumpyRunner whose steps run only when the
test lets them (the numpy model would otherwise finish a whole request before the test's next
line)."""

from __future__ import annotations

import threading

from tests.workers.engine.numpy_runner import NumpyRunner

BS = 4
NUM_BLOCKS = 16
GATE_S = 10.0


class StepGate(NumpyRunner):
    """Runs a step only with a permit from the test (or once opened)."""

    def __init__(self) -> None:
        super().__init__(NUM_BLOCKS, BS)
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()
        self.num_entered = 0  # steps begun: waiting for their permit, or run

    def allow(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self._permits.release()

    def open(self) -> None:
        self._open.set()
        self._permits.release()  # wake a step already waiting

    def run(self, batch):
        self.num_entered += 1
        if not self._open.is_set():
            assert self._permits.acquire(timeout=GATE_S), "the test never allowed this step"
        return super().run(batch)
