"""Paddle-free parts of the model path: step flattening, rope frequencies, KV sizing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.config import ModelConfig, RopeScaling
from workers.engine.kv_cache import kv_block_bytes, kv_block_shape, num_blocks_for_bytes
from workers.engine.rope import cos_sin_tables, inv_frequencies
from workers.engine.step_input import build_step_input

NEG_INF = -np.inf


def _chunk(rid, tokens, start, blocks, need_logits=True):
    return ScheduledChunk(rid, tuple(tokens), start, tuple(blocks), need_logits)


def test_flat_order_groups_chunks_by_length():
    batch = ScheduledBatch(
        (
            _chunk("p1", [10, 11, 12], 2, [4, 5]),  # positions 2..4 -> block 4 rows 2,3; 5 row 0
            _chunk("d1", [20], 5, [1, 3]),  # position 5 -> block 3 row 1
            _chunk("p2", [30, 31], 0, [7], need_logits=False),
            _chunk("d2", [40], 0, [6]),
        )
    )
    step = build_step_input(batch, block_size=4, num_blocks=8)
    # flat order by chunk length: d1, d2, p2, p1
    assert step.token_ids.tolist() == [20, 40, 30, 31, 10, 11, 12]
    assert step.positions.tolist() == [5, 0, 0, 1, 2, 3, 4]
    assert step.write_block_ids.tolist() == [3, 6, 7, 7, 4, 4, 5]
    assert step.write_rows.tolist() == [1, 0, 0, 1, 2, 3, 0]
    # chunk order p1, d1, d2 (p2 needs none): their last flat rows
    assert step.logits_rows.tolist() == [6, 0, 1]
    assert [(g.token_start, g.num_seqs, g.query_len) for g in step.groups] == [
        (0, 2, 1),
        (2, 1, 2),
        (4, 1, 3),
    ]


def test_equal_length_prefills_share_a_group():
    batch = ScheduledBatch((_chunk("a", [1, 2], 0, [3]), _chunk("b", [5, 6], 4, [0, 2])))
    (group,) = build_step_input(batch, block_size=4, num_blocks=4).groups
    assert (group.token_start, group.num_seqs, group.query_len) == (0, 2, 2)
    assert group.block_table.tolist() == [[3, 0], [0, 2]]
    allowed = (group.mask_bias == 0).astype(int).tolist()
    assert allowed == [
        [[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]],  # a: positions 0, 1
        [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]],  # b: positions 4, 5
    ]


def test_decode_group_pads_block_tables_and_masks_padding():
    batch = ScheduledBatch((_chunk("a", [1], 5, [2, 9]), _chunk("b", [2], 1, [4, 8])))
    group = build_step_input(batch, block_size=4, num_blocks=10).groups[0]
    # b needs only its first block for positions [0, 2): the rest of its row is padding
    assert group.block_table.tolist() == [[2, 9], [4, 0]]
    assert group.mask_bias.shape == (2, 1, 8)
    ok = 0.0
    assert group.mask_bias[0, 0].tolist() == [ok] * 6 + [NEG_INF] * 2
    assert group.mask_bias[1, 0].tolist() == [ok] * 2 + [NEG_INF] * 6


def test_prefill_chunk_mask_is_causal_from_start_pos():
    batch = ScheduledBatch((_chunk("a", [1, 2, 3], 2, [0, 1]),))
    mask = build_step_input(batch, block_size=4, num_blocks=2).groups[0].mask_bias[0]
    allowed = (mask == 0).astype(int).tolist()
    assert allowed == [
        [1, 1, 1, 0, 0, 0, 0, 0],  # position 2
        [1, 1, 1, 1, 0, 0, 0, 0],  # position 3
        [1, 1, 1, 1, 1, 0, 0, 0],  # position 4
    ]


def test_sliding_window_mask():
    batch = ScheduledBatch((_chunk("a", [1, 2, 3], 3, [0, 1]),))
    mask = build_step_input(batch, 4, 2, sliding_window=2).groups[0].mask_bias[0]
    allowed = (mask == 0).astype(int).tolist()
    assert allowed == [
        [0, 0, 1, 1, 0, 0, 0, 0],  # position 3 sees 2, 3
        [0, 0, 0, 1, 1, 0, 0, 0],  # position 4 sees 3, 4
        [0, 0, 0, 0, 1, 1, 0, 0],  # position 5 sees 4, 5
    ]


def test_only_blocks_in_use_are_checked():
    # A table longer than needed may hold ids not yet valid (say, reserved ahead).
    batch = ScheduledBatch((_chunk("a", [1, 2], 0, [3, 99]),))
    step = build_step_input(batch, block_size=4, num_blocks=4)
    assert step.groups[0].block_table.tolist() == [[3]]


def test_bad_block_id_named():
    batch = ScheduledBatch((_chunk("a", [1, 2], 3, [3, 99]),))
    with pytest.raises(ValueError, match=r"request 'a': block ids \[99\] outside \[0, 4\)"):
        build_step_input(batch, block_size=4, num_blocks=4)


def test_rope_default_and_linear():
    inv = inv_frequencies(8, 10000.0, None)
    np.testing.assert_allclose(inv, [1.0, 0.1, 0.01, 0.001], rtol=1e-12)
    linear = inv_frequencies(8, 10000.0, RopeScaling("linear", factor=4.0))
    np.testing.assert_allclose(linear, inv / 4.0, rtol=1e-12)


def test_rope_llama3_bands():
    # old context 64: wavelengths < 16 kept, > 64 divided by factor, blended between.
    s = RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64)
    inv = inv_frequencies(8, 100.0, None)  # 1, 0.316, 0.1, 0.0316: wavelengths 6.3 .. 199
    got = inv_frequencies(8, 100.0, s)
    wavelen = 2 * math.pi / inv
    assert wavelen[0] < 16 and got[0] == inv[0]
    assert wavelen[3] > 64 and got[3] == pytest.approx(inv[3] / 8)
    for i in (1, 2):  # 19.9 and 62.8: medium band
        smooth = (64 / wavelen[i] - 1.0) / (4.0 - 1.0)
        assert got[i] == pytest.approx((1 - smooth) * inv[i] / 8 + smooth * inv[i])


def test_cos_sin_tables_repeat_halves():
    cos, sin = cos_sin_tables(4, 10000.0, None, num_positions=3)
    assert cos.shape == sin.shape == (3, 4) and cos.dtype == np.float32
    np.testing.assert_allclose(cos[2], np.cos([2.0, 0.02, 2.0, 0.02]), rtol=1e-6)
    np.testing.assert_allclose(sin[1], np.sin([1.0, 0.01, 1.0, 0.01]), rtol=1e-6)


def test_kv_sizing():
    config = ModelConfig.from_hf_dict(
        {
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        model_id="m",
    )
    assert kv_block_shape(config, 16) == (2, 16, 16)
    assert kv_block_bytes(config, 16) == 3 * 2 * 2 * 16 * 16 * 4
    assert num_blocks_for_bytes(config, 16, 10 * 12288 + 1) == 10
