"""A Paddle ModelRunner and a PyTorch TorchModelRunner over one checkpoint, fed the same
batches: every step's logits (and prompt logits) compared within a bound, greedy tokens
compared exactly, and the caches compared at the end (torch tests only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workers.engine.batch import RunnerOutput, ScheduledBatch
from workers.engine.loader import load_model
from workers.engine.runner import ModelRunner

# float32 on both sides; the two frameworks' CPU GEMMs sum in different orders. Measured on
# this CPU: at most 2.1e-5 on the demo model's logits (magnitude ~10), 7e-6 on tiny.
LOGITS_BOUND = 1e-4


@dataclass
class TwinRunners:
    paddle: ModelRunner
    torch: object  # TorchModelRunner

    @classmethod
    def load(cls, model: str, cache_dir: str, num_blocks: int, block_size: int) -> TwinRunners:
        from workers.engine.torch_runner import TorchModelRunner

        paddle_loaded = load_model(model, cache_dir=cache_dir)
        torch_loaded = load_model(model, cache_dir=cache_dir, framework="torch")
        return cls(
            ModelRunner(paddle_loaded, num_blocks, block_size),
            TorchModelRunner(torch_loaded, num_blocks, block_size),
        )

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        """Both runners' step; asserts they agree, returns the torch one's output."""
        want, got = self.paddle.run(batch), self.torch.run(batch)
        assert got.logits.dtype == np.float32 and got.logits.shape == want.logits.shape
        np.testing.assert_allclose(got.logits, want.logits, atol=LOGITS_BOUND, rtol=0)
        assert _argmax(got.logits) == _argmax(want.logits)
        assert len(got.prompt_logits) == len(want.prompt_logits)
        for mine, theirs in zip(got.prompt_logits, want.prompt_logits, strict=True):
            assert mine.shape == theirs.shape
            np.testing.assert_allclose(mine, theirs, atol=LOGITS_BOUND, rtol=0)
            assert _argmax(mine) == _argmax(theirs)
        return got

    def assert_caches_agree(self) -> None:
        for mine, theirs in zip(self.torch.kv_caches, self.paddle.kv_caches, strict=True):
            assert tuple(mine.shape) == tuple(theirs.shape)
            np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=LOGITS_BOUND, rtol=0)
            # Unwritten slots stay exactly zero in both: the same positions were written.
            assert np.array_equal(mine.numpy() == 0, theirs.numpy() == 0)


def _argmax(rows: np.ndarray) -> list[int]:
    return [int(i) for i in np.argmax(rows, axis=-1)]
