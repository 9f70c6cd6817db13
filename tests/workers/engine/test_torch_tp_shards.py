"""The torch backend's tensor-parallel pieces: the loader's select hook reads a rank's slices
straight into torch (the same values as the Paddle shards), and two torch decoders over those
shards, their row-parallel outputs summed by an all-reduce, compute the whole model's logits
and split its KV cache by heads. The ranks are threads here with a barrier for the all-reduce:
the torch backend builds no torch.distributed group yet (a worker refuses --engine-backend
torch with --tensor-parallel-size > 1), so this pins the math a group would run."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.loader import load_model
from workers.engine.tp.sharding import shard_config, shard_selector

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

TP = 2
BLOCK_SIZE = 4


class ThreadAllReduce:
    """Sum over TP threads, every rank adding the parts in rank order (identical results)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.parts: list = [None] * size

    def for_rank(self, rank: int) -> Callable:
        def all_reduce(tensor):
            self.parts[rank] = tensor
            self.barrier.wait()
            total = self.parts[0]
            for part in self.parts[1:]:
                total = total + part
            self.barrier.wait()  # nobody overwrites a part before every rank has summed
            return total

        return all_reduce


def _run_ranks(ranks: list, batch: ScheduledBatch) -> list:
    """Every rank's step at once (each blocks in the all-reduce until all arrive)."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(lambda runner: runner.run(batch), ranks))


def _shard(rank: int, cache_dir: str, framework: str):
    loaded = load_model("tiny", cache_dir=cache_dir, framework=framework,
                        select_for=lambda full: shard_selector(full, rank, TP))  # fmt: skip
    return dataclasses.replace(loaded, config=shard_config(loaded.config, TP))


def test_torch_shards_equal_the_paddle_shards(tmp_path):
    pytest.importorskip("paddle")
    for rank in range(TP):
        mine, theirs = _shard(rank, str(tmp_path), "torch"), _shard(rank, str(tmp_path), "paddle")
        assert sorted(mine.weights) == sorted(theirs.weights)
        for name, tensor in mine.weights.items():
            assert np.array_equal(tensor.numpy(), theirs.weights[name].numpy()), name


def test_two_torch_ranks_compute_the_whole_models_logits(tmp_path):
    from workers.engine.torch_runner import TorchModelRunner

    cache_dir = str(tmp_path)
    whole = TorchModelRunner(load_model("tiny", cache_dir=cache_dir, framework="torch"), 16,
                             BLOCK_SIZE)  # fmt: skip
    reduce = ThreadAllReduce(TP)
    ranks = [
        TorchModelRunner(_shard(r, cache_dir, "torch"), 16, BLOCK_SIZE,
                         all_reduce=reduce.for_rank(r))
        for r in range(TP)
    ]  # fmt: skip
    vocab = whole.vocab_size
    prompt = tuple(np.random.default_rng(3).integers(0, vocab, size=11).tolist())
    steps = [
        ScheduledBatch((ScheduledChunk("a", prompt[:7], 0, (0, 1, 2), False),
                        ScheduledChunk("b", prompt[:5], 0, (3, 4), True))),
        ScheduledBatch((ScheduledChunk("a", prompt[7:], 7, (0, 1, 2), True),
                        ScheduledChunk("b", (9,), 5, (3, 4), True))),
    ]  # fmt: skip
    for batch in steps:
        want = whole.run(batch).logits
        outs = _run_ranks(ranks, batch)
        for out in outs:  # every rank holds the same hidden states after the last all-reduce
            np.testing.assert_allclose(out.logits, want, atol=1e-5, rtol=0)
    heads = whole.config.num_kv_heads // TP
    for r, rank in enumerate(ranks):  # rank r's cache: heads [r * H / TP, (r + 1) * H / TP)
        for mine, full in zip(rank.kv_caches, whole.kv_caches, strict=True):
            assert tuple(mine.shape) == (16, heads, BLOCK_SIZE, whole.config.head_dim)
            torch.testing.assert_close(mine, full[:, r * heads : (r + 1) * heads],
                                       atol=1e-5, rtol=0)  # fmt: skip
