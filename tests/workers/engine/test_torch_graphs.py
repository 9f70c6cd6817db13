"""DecodeGraphs: decode steps padded to (batch, context) buckets answer as the eager forward.

On the CPU the padded steps run eagerly (no capture): the padding rows, the scratch block and
the padded block tables are checked there. On a GPU (marker gpu) the buckets are captured as
CUDA graphs and replayed; the graph runner must match the eager runner step for step."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.loader import load_model
from workers.engine.step_input import build_step_input

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

BLOCK_SIZE = 4
NUM_BLOCKS = 64
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def _runners(model: str, device: str, cache_dir: str):
    from workers.engine.torch_runner import TorchModelRunner

    if device == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU visible to torch")
    loaded = load_model(model, cache_dir=cache_dir, framework="torch")
    eager = TorchModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE, device)
    graphed = TorchModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE, device, cuda_graphs=True)
    return eager, graphed


def _table(i: int) -> tuple[int, ...]:
    return tuple(range(i * 10, i * 10 + 10))  # 40 positions per sequence


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["tiny", "demo"])
def test_padded_decode_steps_answer_as_the_eager_forward(model, device, tmp_path):
    eager, graphed = _runners(model, device, str(tmp_path))
    vocab = eager.vocab_size
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, vocab, size=n).tolist() for n in (3, 9, 14, 6, 1)]
    computed = [0] * len(seqs)
    # Padded shapes change the reduction lengths: the last float32 bits differ (measured on this
    # CPU: 1.4e-5 on the demo model's logits).
    bound = 5e-5 if device == "cpu" else 1e-3

    def step(active: list[int], prompt_logprobs: bool = False) -> None:
        chunks = tuple(
            ScheduledChunk(str(i), tuple(seqs[i][computed[i] :]), computed[i], _table(i), True,
                           prompt_logprobs=prompt_logprobs and i == active[0])
            for i in active
        )  # fmt: skip
        batch = ScheduledBatch(chunks)
        want, got = eager.run(batch), graphed.run(batch)
        np.testing.assert_allclose(got.logits, want.logits, atol=bound, rtol=0)
        assert np.argmax(got.logits, -1).tolist() == np.argmax(want.logits, -1).tolist()
        for row, i in enumerate(active):
            computed[i] = len(seqs[i])
            seqs[i].append(int(np.argmax(want.logits[row])))

    step([0, 1, 2])  # prefills: eager in both
    step([0, 1, 2])  # 3 decodes: bucket 4; tables of 1-4 blocks: 4 blocks
    step([3, 4])  # prefills
    for _ in range(7):  # 5 decodes (bucket 8), contexts crossing block boundaries
        step([0, 1, 2, 3, 4])
    step([2])  # 1 decode: bucket 1
    step([0, 1], prompt_logprobs=True)  # a row asks for prompt logprobs: eager
    for mine, theirs in zip(graphed.kv_caches, eager.kv_caches, strict=True):
        torch.testing.assert_close(mine, theirs, atol=bound, rtol=0)
    graphs = graphed.graphs
    # (batch bucket, blocks bucket): 3 decodes over tables of up to 4 blocks; 5 decodes over
    # up to 4 then up to 6 blocks (-> 8); then 1 decode over 6 blocks.
    assert sorted(graphs.buckets) == [(1, 8), (4, 4), (8, 4), (8, 8)]
    assert all((b.graph is not None) == (device == "gpu") for b in graphs.buckets.values())
    scratch = graphed.kv_cache.with_scratch[0][graphed.kv_cache.scratch_block]
    assert bool(scratch[:, 0].any()) and not bool(scratch[:, 1:].any())  # padding wrote row 0


def test_which_steps_fit(tmp_path):
    from workers.engine.torch_graphs import DecodeGraphs
    from workers.engine.torch_runner import TorchModelRunner

    runner = TorchModelRunner(load_model("tiny", cache_dir=str(tmp_path), framework="torch"),
                              NUM_BLOCKS, BLOCK_SIZE, cuda_graphs=True)  # fmt: skip
    graphs: DecodeGraphs = runner.graphs

    def fits(*chunks: ScheduledChunk) -> bool:
        return graphs.fits(build_step_input(ScheduledBatch(chunks), BLOCK_SIZE, NUM_BLOCKS))

    decode = ScheduledChunk("a", (5,), 7, _table(0), True)
    assert fits(decode, ScheduledChunk("b", (6,), 2, _table(1), True))
    assert not fits(ScheduledChunk("a", (5, 6), 6, _table(0), True))  # a prefill chunk
    assert not fits(decode, ScheduledChunk("b", (6, 7), 2, _table(1), True))
    assert not fits(ScheduledChunk("a", (5,), 7, _table(0), True, prompt_logprobs=True))
    many = [ScheduledChunk(str(i), (5,), 1, (i,), True) for i in range(64)]
    assert fits(*many[:64])
    many.append(ScheduledChunk("x", (5,), 1, (0,), True))
    assert not fits(*many)  # past max_batch (64)
