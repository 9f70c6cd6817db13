"""PyTorch, imported in one place with an actionable message when it is missing.

The PyTorch backend (workers/engine/torch_runner.py) is optional: `pip install -e '.[torch]'`
(or `make install-torch`; on a GPU host the CUDA build: `make install-gpu BACKEND=torch`).
Every torch import of the engine goes through here, so a process on the Paddle backend never
imports torch and a torch process never imports Paddle.
"""

from __future__ import annotations

try:
    import torch
    import torch.nn.attention.bias  # the causal biases torch_model.py passes to SDPA
except ImportError as exc:  # pragma: no cover - exercised where torch is absent
    raise ImportError(
        f"the PyTorch engine backend needs torch ({exc}); install it with "
        "`pip install -e '.[torch]'` (make install-torch), or run with --engine-backend paddle"
    ) from exc

__all__ = ["torch"]
