"""Two runners over one checkpoint fed the same batches: every step's logits (and prompt
logits) compared within a bound, greedy tokens compared exactly, and the caches compared at
the end (torch tests only).

The reference is the Paddle ModelRunner on the CPU where Paddle is installed; on a machine
without Paddle (the GPU machine) it is the torch runner on the CPU, itself held to Paddle
wherever both are installed. The candidate is the torch runner on the device under test.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.engine.batch import RunnerOutput, ScheduledBatch
from workers.engine.loader import load_model

# float32 on both sides; the frameworks' CPU GEMMs sum in different orders. Measured on this
# CPU: at most 2.1e-5 on the demo model's logits (magnitude ~10), 7e-6 on tiny. A GPU's
# kernels (cuBLAS, SDPA's fused attention) reorder more: 1e-3 there (the logprob bound).
LOGITS_BOUND = {"cpu": 1e-4, "gpu": 1e-3}


def paddle_installed() -> bool:
    try:
        return importlib.util.find_spec("paddle") is not None
    except (ImportError, ValueError):  # a process that blocked it (sys.modules["paddle"] = None)
        return False


@dataclass
class TwinRunners:
    reference: Any  # Paddle ModelRunner on the CPU (or TorchModelRunner on the CPU)
    torch: Any  # TorchModelRunner on `device`
    bound: float

    @classmethod
    def load(
        cls, model: str, cache_dir: str, num_blocks: int, block_size: int, device: str = "cpu"
    ) -> TwinRunners:
        from workers.engine.torch_runner import TorchModelRunner

        def torch_runner(on: str) -> TorchModelRunner:
            loaded = load_model(model, cache_dir=cache_dir, framework="torch")
            return TorchModelRunner(loaded, num_blocks, block_size, on)

        if paddle_installed():
            from workers.engine.runner import ModelRunner

            reference = ModelRunner(load_model(model, cache_dir=cache_dir), num_blocks, block_size)
        else:
            reference = torch_runner("cpu")
        kind = "cpu" if device == "cpu" else "gpu"
        return cls(reference, torch_runner(device), LOGITS_BOUND[kind])

    def zero_caches(self) -> None:
        for tensor in (*self.reference.kv_caches, *self.torch.kv_caches):
            tensor.zero_()

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        """Both runners' step; asserts they agree, returns the torch one's output."""
        want, got = self.reference.run(batch), self.torch.run(batch)
        assert got.logits.dtype == np.float32 and got.logits.shape == want.logits.shape
        np.testing.assert_allclose(got.logits, want.logits, atol=self.bound, rtol=0)
        assert _argmax(got.logits) == _argmax(want.logits)
        assert len(got.prompt_logits) == len(want.prompt_logits)
        for mine, theirs in zip(got.prompt_logits, want.prompt_logits, strict=True):
            assert mine.shape == theirs.shape
            np.testing.assert_allclose(mine, theirs, atol=self.bound, rtol=0)
            assert _argmax(mine) == _argmax(theirs)
        return got

    def assert_caches_agree(self) -> None:
        for mine, theirs in zip(self.torch.kv_caches, self.reference.kv_caches, strict=True):
            assert tuple(mine.shape) == tuple(theirs.shape)
            mine_np, theirs_np = _numpy(mine), _numpy(theirs)
            np.testing.assert_allclose(mine_np, theirs_np, atol=self.bound, rtol=0)
            # Unwritten slots stay exactly zero in both: the same positions were written.
            assert np.array_equal(mine_np == 0, theirs_np == 0)


def _numpy(tensor: Any) -> np.ndarray:
    return tensor.cpu().numpy() if type(tensor).__module__.startswith("torch") else tensor.numpy()


def _argmax(rows: np.ndarray) -> list[int]:
    return [int(i) for i in np.argmax(rows, axis=-1)]
