"""Checks of the Triton paged decode kernel, run by test_paged_decode.py: in a subprocess under
TRITON_INTERPRET=1 on the CPU (Triton's interpreter must be chosen before triton is imported),
in the test process itself on a GPU.

    TRITON_INTERPRET=1 python -m tests.workers.engine.paged_decode_check   # prints JSON
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
import torch

from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.loader import load_model
from workers.engine.paged_decode import paged_decode_attention

# (num_heads, num_kv_heads, head_dim, block_size): MHA, GQA groups of 2, 4 and 8, two sizes.
SHAPES = [(4, 4, 16, 16), (8, 4, 32, 16), (8, 2, 64, 64), (16, 2, 32, 16)]


def kernel_errors(device: str, dtype: torch.dtype) -> list[float]:
    """Max |kernel - SDPA over the gathered context| for each shape: 3 sequences whose
    contexts end mid-block, on a block boundary and at one token, over scattered blocks."""
    gen = torch.Generator().manual_seed(0)
    errors = []
    for heads, kv_heads, dim, bs in SHAPES:
        num_blocks = 16

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        q = rand(3, heads, dim)
        k_cache, v_cache = rand(num_blocks, kv_heads, bs, dim), rand(num_blocks, kv_heads, bs, dim)
        tables = torch.tensor([[3, 9, 1, 0], [7, 2, 0, 0], [12, 0, 0, 0]], device=device)
        lens = torch.tensor([2 * bs + 5, 2 * bs, 1], dtype=torch.int32, device=device)
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens)
        worst = 0.0
        for s in range(3):
            n = int(lens[s])
            blocks = tables[s, : -(-n // bs)]
            k = k_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, dim)[:, :n].float()
            v = v_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, dim)[:, :n].float()
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[s].float()[None, :, None], k[None], v[None], enable_gqa=True
            )[0, :, 0]
            worst = max(worst, float((out[s].float() - ref).abs().max()))
        errors.append(worst)
    return errors


def runner_agreement(device: str, cuda_graphs: bool) -> dict:  # device: "cpu" or "gpu"
    """The demo model decoding 4 sequences of mixed lengths (block size 16) with the paged
    kernel against the SDPA path: the largest logits difference and whether greedy tokens
    agree at every step."""
    from workers.engine.torch_runner import TorchModelRunner

    loaded = load_model("demo", framework="torch", cache_dir=tempfile.mkdtemp())
    sdpa = TorchModelRunner(loaded, 32, 16, device)
    paged = TorchModelRunner(loaded, 32, 16, device, cuda_graphs=cuda_graphs,
                             decode_attention="triton")  # fmt: skip
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, sdpa.vocab_size, size=n).tolist() for n in (5, 16, 30, 1)]
    computed = [0] * 4
    worst, same = 0.0, True
    for _ in range(6):  # a prefill step, then decodes crossing block boundaries
        chunks = tuple(
            ScheduledChunk(str(i), tuple(seqs[i][computed[i] :]), computed[i],
                           tuple(range(i * 8, i * 8 + 8)), True)
            for i in range(4)
        )  # fmt: skip
        want, got = sdpa.run(ScheduledBatch(chunks)), paged.run(ScheduledBatch(chunks))
        worst = max(worst, float(np.abs(want.logits - got.logits).max()))
        same &= np.argmax(want.logits, -1).tolist() == np.argmax(got.logits, -1).tolist()
        for i in range(4):
            computed[i] = len(seqs[i])
            seqs[i].append(int(np.argmax(want.logits[i])))
    return {"max_logits_diff": worst, "tokens_agree": bool(same)}


def main() -> None:
    report = {
        "kernel_float32": kernel_errors("cpu", torch.float32),
        "runner": runner_agreement("cpu", cuda_graphs=False),
        "runner_padded": runner_agreement("cpu", cuda_graphs=True),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
