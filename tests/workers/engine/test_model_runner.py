"""ModelRunner: cache layout and exact placement, malformed batches, and batch invariance.

Batch invariance: each of 8 sequences decoded greedily alone gives the same tokens as when
the 8 run together with staggered arrivals (so prefill chunks share steps with decodes).
Logits may differ in the last float32 bits, because a group's context is padded to its
longest member and matmul shapes change with the batch; the test bounds that difference
(measured: at most 6.2e-6 on logits of magnitude ~10, on this CPU) at 5e-5.
"""

from __future__ import annotations

import numpy as np
import pytest

from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.loader import load_model
from workers.engine.runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 96
LOGITS_BOUND = 5e-5


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model("tiny", seed=0, cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_kv_caches_layout(loaded):
    runner = ModelRunner(loaded, num_blocks=10, block_size=8)
    caches = runner.kv_caches
    assert len(caches) == 4  # K0, V0, K1, V1
    for t in caches:
        assert tuple(t.shape) == (10, 2, 8, 16)
        assert str(t.dtype) == "paddle.float32"
        assert not t.numpy().any()
    assert runner.kv_cache.total_bytes == 4 * 10 * 2 * 8 * 16 * 4
    assert caches[2] is runner.kv_cache.key(1) and caches[3] is runner.kv_cache.value(1)


def test_only_scheduled_slots_are_written(loaded):
    runner = ModelRunner(loaded, num_blocks=8, block_size=4)
    out = runner.run(ScheduledBatch((ScheduledChunk("r", (1, 2, 3, 4, 5, 6), 0, (5, 2), False),)))
    assert out.logits.shape == (0, 264)
    for t in runner.kv_caches:
        cache = t.numpy()
        written = {(b, r) for b in range(8) for r in range(4) if cache[b, :, r, :].any()}
        assert written == {(5, 0), (5, 1), (5, 2), (5, 3), (2, 0), (2, 1)}


def test_cache_tensors_are_updated_in_place(loaded):
    # The swap_cache_layout kernel holds these tensors: a step must never replace them.
    runner = ModelRunner(loaded, num_blocks=8, block_size=4)
    before = [(id(t), t.data_ptr()) for t in runner.kv_caches]
    runner.run(ScheduledBatch((ScheduledChunk("r", (1, 2, 3, 4, 5), 0, (1, 2), True),)))
    assert [(id(t), t.data_ptr()) for t in runner.kv_caches] == before
    assert runner.kv_caches[0].numpy()[1].any()


def test_resume_from_cache_written_from_outside(loaded):
    """Decode role: blocks filled by someone else (the pool read) hold tokens [0, k); the
    runner computes only k.. and matches a runner that computed everything itself."""
    import paddle

    prompt = tuple(range(40, 51))  # 11 tokens: blocks of 4 -> 3 blocks, the last partial
    full = ModelRunner(loaded, num_blocks=8, block_size=4)
    want = full.run(ScheduledBatch((ScheduledChunk("a", prompt, 0, (0, 1, 2), True),))).logits
    resumed = ModelRunner(loaded, num_blocks=8, block_size=4)
    src, dst = paddle.to_tensor([0, 1, 2]), paddle.to_tensor([6, 3, 5])
    for mine, theirs in zip(resumed.kv_caches, full.kv_caches, strict=True):
        paddle.index_put_(mine, (dst,), paddle.gather(theirs, src))
    k = 9  # the first 9 tokens' KV came from outside; compute tokens 9 and 10
    chunk = ScheduledChunk("a", prompt[k:], k, (6, 3, 5), True)
    got = resumed.run(ScheduledBatch((chunk,))).logits
    np.testing.assert_allclose(got, want, atol=LOGITS_BOUND, rtol=0)
    assert int(np.argmax(got)) == int(np.argmax(want))


def test_empty_batch(loaded):
    runner = ModelRunner(loaded, num_blocks=4, block_size=4)
    out = runner.run(ScheduledBatch(()))
    assert out.logits.shape == (0, 264) and out.logits.dtype == np.float32


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (ScheduledChunk("r1", (1, 2, 3, 4, 5), 0, (0,), True), "'r1': 1 blocks cannot hold"),
        (ScheduledChunk("r2", (1,), 4, (0, 8), True), r"'r2': block ids \[8\] outside \[0, 8\)"),
        (ScheduledChunk("r3", (), 0, (0,), True), "'r3': chunk has no tokens"),
        (ScheduledChunk("r4", (1,), -1, (0,), True), "'r4': negative start_pos"),
    ],
)
def test_malformed_chunks_name_the_request(loaded, chunk, message):
    runner = ModelRunner(loaded, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=message):
        runner.run(ScheduledBatch((chunk,)))


def test_position_beyond_rope_table(loaded):
    # 8 blocks of 4 cover positions [0, 32): the rope table is sized to that.
    runner = ModelRunner(loaded, num_blocks=8, block_size=4)
    chunk = ScheduledChunk("r", (1,), 32, (*range(8), 0), True)
    with pytest.raises(ValueError, match="position 32 beyond the 32 positions"):
        runner.run(ScheduledBatch((chunk,)))


def test_half_precision_refused_on_cpu(tmp_path):
    half = load_model("tiny", dtype="bfloat16", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="dtype 'bfloat16' needs a GPU device"):
        ModelRunner(half, num_blocks=4, block_size=4)


def _prompts(vocab):
    rng = np.random.default_rng(0)
    lengths = [5, 12, 1, 17, 8, 3, 24, 9]  # mid-block, on boundaries, a single token
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def _blocks_for(index):
    return tuple(range(index * 12, index * 12 + 12))  # 48 positions each


def _decode_together(runner, prompts, num_steps, arrivals):
    """Greedy-decode every sequence; sequence i is prefilled at step arrivals[i].
    Returns per sequence (tokens, logits rows)."""
    seqs = [list(p) for p in prompts]
    tokens = [[] for _ in prompts]
    logits = [[] for _ in prompts]
    computed = [0] * len(prompts)
    step = 0
    while any(len(t) < num_steps for t in tokens):
        active = [
            i for i in range(len(prompts)) if arrivals[i] <= step and len(tokens[i]) < num_steps
        ]
        chunks = tuple(
            ScheduledChunk(str(i), tuple(seqs[i][computed[i] :]), computed[i], _blocks_for(i), True)
            for i in active
        )
        out = runner.run(ScheduledBatch(chunks))
        for row, i in enumerate(active):
            computed[i] = len(seqs[i])
            token = int(np.argmax(out.logits[row]))
            tokens[i].append(token)
            logits[i].append(out.logits[row])
            seqs[i].append(token)
        step += 1
    return tokens, logits


def test_greedy_alone_equals_in_batch_of_8(loaded):
    prompts = _prompts(loaded.config.vocab_size)
    num_steps = 12
    together = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE)
    batch_tokens, batch_logits = _decode_together(
        together, prompts, num_steps, arrivals=[0, 0, 1, 2, 2, 3, 5, 6]
    )
    for i, prompt in enumerate(prompts):
        alone = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE)
        tokens, logits = _decode_together(alone, [prompt], num_steps, arrivals=[0])
        assert tokens[0] == batch_tokens[i], f"sequence {i}"
        diff = np.abs(np.array(logits[0]) - np.array(batch_logits[i])).max()
        assert diff <= LOGITS_BOUND, f"sequence {i}: max logits difference {diff}"
