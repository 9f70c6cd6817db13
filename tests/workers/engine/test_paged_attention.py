"""The paged decoder equals a dense float64 reference (tests/workers/engine/dense_reference.py).

Covered: prompts ending mid-block and on a block boundary, prefill in one chunk, chunked
prefill, decode steps across block boundaries, a mixed batch with scattered block tables, and
the exact cache placement of every position's K/V; for Llama (GQA), Qwen2 (qkv bias, tied
embeddings, one kv head), Llama 3.1 rope scaling with attention bias, and Mistral with an
explicit head_dim and linear rope scaling, and Mistral with a sliding window of 5.
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.workers.engine.dense_reference import dense_forward
from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.loader import load_model
from workers.engine.runner import ModelRunner
from workers.engine.tiny import TinySpec, write_checkpoint

BLOCK_SIZE = 4
NUM_BLOCKS = 32
# float32 paged forward vs float64 dense forward, logits of magnitude ~10
ATOL = 2e-4
RTOL = 1e-4

SPECS = {
    "llama_gqa": TinySpec(),
    "qwen2_tied_mqa": TinySpec(model_type="qwen2", tie_word_embeddings=True, num_kv_heads=1),
    "llama3_rope_bias": TinySpec(
        attention_bias=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "mistral_linear_headdim": TinySpec(
        model_type="mistral", head_dim=32, rope_scaling={"type": "linear", "factor": 2.0}
    ),
    # A window shorter than the sequences, so that it masks keys in every test below.
    "mistral_window": TinySpec(model_type="mistral", extra_config={"sliding_window": 5}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (LoadedModel, numpy weights read straight from the file)."""
    out = {}
    for seed, (name, spec) in enumerate(SPECS.items()):
        folder = tmp_path_factory.mktemp(name)
        write_checkpoint(folder, spec, seed=seed + 11)
        out[name] = (load_model(str(folder)), load_file(str(folder / "model.safetensors")))
    return out


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def _chunk(rid, tokens, start, blocks, need_logits=True):
    return ScheduledChunk(rid, tuple(tokens), start, tuple(blocks), need_logits)


def _assert_cache_holds(runner, kv_ref, blocks, num_tokens):
    """Position p's K/V sits at block blocks[p // bs], row p % bs of every layer."""
    for layer, (k_ref, v_ref) in enumerate(kv_ref):
        k_cache = runner.kv_caches[2 * layer].numpy()
        v_cache = runner.kv_caches[2 * layer + 1].numpy()
        for p in range(num_tokens):
            b, r = blocks[p // BLOCK_SIZE], p % BLOCK_SIZE
            np.testing.assert_allclose(k_cache[b, :, r, :], k_ref[p], atol=ATOL, rtol=RTOL)
            np.testing.assert_allclose(v_cache[b, :, r, :], v_ref[p], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("num_tokens", [1, 7, 8, 13])  # 7, 13 mid-block; 8 on a boundary
def test_prefill_in_one_chunk(models, name, num_tokens):
    loaded, weights = models[name]
    runner = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE)
    tokens = _tokens(num_tokens, loaded.config.vocab_size, seed=num_tokens)
    blocks = [9, 3, 17, 0][: -(-num_tokens // BLOCK_SIZE)]
    out = runner.run(ScheduledBatch((_chunk("r", tokens, 0, blocks),)))
    ref_logits, kv_ref = dense_forward(loaded.config, weights, tokens)
    assert out.logits.shape == (1, loaded.config.vocab_size)
    assert out.logits.dtype == np.float32
    np.testing.assert_allclose(out.logits[0], ref_logits[-1], atol=ATOL, rtol=RTOL)
    _assert_cache_holds(runner, kv_ref, blocks, num_tokens)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("chunk_sizes", [(3, 5, 4, 1), (4, 4, 4), (8, 5)])
def test_chunked_prefill(models, name, chunk_sizes):
    loaded, weights = models[name]
    runner = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE)
    total = sum(chunk_sizes)
    tokens = _tokens(total, loaded.config.vocab_size, seed=total)
    blocks = [30, 1, 12, 5]
    ref_logits, kv_ref = dense_forward(loaded.config, weights, tokens)
    start = 0
    for size in chunk_sizes:
        out = runner.run(
            ScheduledBatch((_chunk("r", tokens[start : start + size], start, blocks),))
        )
        start += size
        np.testing.assert_allclose(out.logits[0], ref_logits[start - 1], atol=ATOL, rtol=RTOL)
    _assert_cache_holds(runner, kv_ref, blocks, total)


@pytest.mark.parametrize("name", list(SPECS))
def test_decode_steps_cross_block_boundaries(models, name):
    loaded, weights = models[name]
    runner = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE)
    tokens = _tokens(15, loaded.config.vocab_size, seed=5)
    blocks = [2, 7, 4, 11]
    ref_logits, kv_ref = dense_forward(loaded.config, weights, tokens)
    out = runner.run(ScheduledBatch((_chunk("r", tokens[:6], 0, blocks),)))
    np.testing.assert_allclose(out.logits[0], ref_logits[5], atol=ATOL, rtol=RTOL)
    for pos in range(6, 15):  # rows 2,3 of block 1, all of block 2, into block 3
        out = runner.run(ScheduledBatch((_chunk("r", [tokens[pos]], pos, blocks),)))
        np.testing.assert_allclose(out.logits[0], ref_logits[pos], atol=ATOL, rtol=RTOL)
    _assert_cache_holds(runner, kv_ref, blocks, 15)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied_mqa"])
def test_mixed_batch_rows_follow_chunk_order(models, name):
    """Two decodes and two prefill chunks interleaved in one step, scattered block tables."""
    loaded, weights = models[name]
    vocab = loaded.config.vocab_size
    runner = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE)
    seqs = {
        rid: _tokens(n, vocab, seed=i)
        for i, (rid, n) in enumerate([("a", 9), ("b", 6), ("c", 11), ("d", 5)])
    }
    tables = {"a": [0, 8, 16], "b": [1, 9], "c": [2, 10, 18], "d": [3, 11]}
    # Step 1: a and b prefill all but their last token; c its first 4; d nothing yet.
    step1 = ScheduledBatch(
        (
            _chunk("a", seqs["a"][:8], 0, tables["a"]),
            _chunk("c", seqs["c"][:4], 0, tables["c"], need_logits=False),
            _chunk("b", seqs["b"][:5], 0, tables["b"]),
        )
    )
    assert runner.run(step1).logits.shape == (2, vocab)
    # Step 2: a, b decode one token; c prefills its rest; d prefills whole (order shuffled).
    step2 = ScheduledBatch(
        (
            _chunk("c", seqs["c"][4:], 4, tables["c"]),
            _chunk("a", seqs["a"][8:], 8, tables["a"]),
            _chunk("d", seqs["d"], 0, tables["d"]),
            _chunk("b", seqs["b"][5:], 5, tables["b"]),
        )
    )
    out = runner.run(step2)
    assert out.logits.shape == (4, vocab)
    for row, rid in enumerate(["c", "a", "d", "b"]):
        ref_logits, kv_ref = dense_forward(loaded.config, weights, seqs[rid])
        np.testing.assert_allclose(out.logits[row], ref_logits[-1], atol=ATOL, rtol=RTOL)
        _assert_cache_holds(runner, kv_ref, tables[rid], len(seqs[rid]))


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window"])
def test_equal_length_chunks_batched_together(models, name):
    """Three 4-token chunks (one group) at different offsets, plus two decodes."""
    loaded, weights = models[name]
    vocab = loaded.config.vocab_size
    runner = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE)
    seqs = {
        rid: _tokens(n, vocab, seed=20 + i)
        for i, (rid, n) in enumerate([("a", 4), ("b", 9), ("c", 10), ("d", 7), ("e", 3)])
    }
    tables = {"a": [5], "b": [6, 7, 8], "c": [9, 10, 11], "d": [12, 13], "e": [14]}
    first = ScheduledBatch(
        (
            _chunk("b", seqs["b"][:5], 0, tables["b"], need_logits=False),
            _chunk("c", seqs["c"][:6], 0, tables["c"], need_logits=False),
            _chunk("d", seqs["d"][:6], 0, tables["d"], need_logits=False),
            _chunk("e", seqs["e"][:2], 0, tables["e"], need_logits=False),
        )
    )
    assert runner.run(first).logits.shape == (0, vocab)
    second = ScheduledBatch(
        (
            _chunk("b", seqs["b"][5:], 5, tables["b"]),
            _chunk("d", seqs["d"][6:], 6, tables["d"]),
            _chunk("a", seqs["a"], 0, tables["a"]),
            _chunk("e", seqs["e"][2:], 2, tables["e"]),
            _chunk("c", seqs["c"][6:], 6, tables["c"]),
        )
    )
    out = runner.run(second)
    for row, rid in enumerate(["b", "d", "a", "e", "c"]):
        ref_logits, kv_ref = dense_forward(loaded.config, weights, seqs[rid])
        np.testing.assert_allclose(out.logits[row], ref_logits[-1], atol=ATOL, rtol=RTOL)
        _assert_cache_holds(runner, kv_ref, tables[rid], len(seqs[rid]))
