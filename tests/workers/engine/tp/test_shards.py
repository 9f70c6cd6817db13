"""Which heads each rank holds, which shards a reader needs, and the checkpoint slices."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engine.tp.shards import (
    HeadRange,
    ShardPiece,
    covering,
    layouts,
    pairing_problem,
    rank_heads,
    tp_problem,
)


def test_ranks_split_the_heads_evenly() -> None:
    assert [rank_heads(8, 2, r) for r in range(2)] == [HeadRange(0, 4, 8), HeadRange(4, 8, 8)]
    assert rank_heads(8, 1, 0) == HeadRange(0, 8, 8)
    with pytest.raises(ValueError, match="cannot split 8 KV heads"):
        rank_heads(8, 3, 0)


def test_a_size_that_does_not_divide_the_model_says_which_part() -> None:
    assert tp_problem(32, 8, 14336, 2) is None
    assert "the model's 8 KV heads" in (tp_problem(32, 8, 14336, 3) or "")
    assert "intermediate_size" in (tp_problem(8, 8, 100, 8) or "")
    assert pairing_problem(8, 2, 1) is None and pairing_problem(8, 1, 8) is None
    assert "decode side's TP size 3" in (pairing_problem(8, 2, 3) or "")


def test_covering_shards_for_every_pairing() -> None:
    # D tp=1 after P tp=2: two whole shards, side by side.
    assert covering(HeadRange(0, 8, 8), 2) == [
        ShardPiece(HeadRange(0, 4, 8), 0, 0, 4), ShardPiece(HeadRange(4, 8, 8), 0, 4, 4)
    ]  # fmt: skip
    # D tp=2 rank 1 after P tp=1: the second half of the one shard.
    (piece,) = covering(HeadRange(4, 8, 8), 1)
    assert piece == ShardPiece(HeadRange(0, 8, 8), 4, 0, 4) and not piece.whole
    # Same sizes: the rank's own shard.
    assert covering(HeadRange(4, 8, 8), 2) == [ShardPiece(HeadRange(4, 8, 8), 0, 0, 4)]
    assert covering(HeadRange(2, 4, 8), 2)[0].src_head == 2
    assert layouts(8, 2) == (2, 1, 4, 8)
    assert layouts(6, 3) == (3, 1, 2, 6)


def test_a_rank_reads_only_its_slices_of_the_checkpoint(tiny_cache_dir) -> None:
    from workers.engine.engine_config import EngineConfig
    from workers.engine.loader import load_model
    from workers.engine.tp.runner import load_rank

    config = EngineConfig(model="tiny", cache_dir=str(tiny_cache_dir), tensor_parallel_size=2)
    full = load_model("tiny", cache_dir=str(tiny_cache_dir)).weights
    whole, shard = load_rank(config, 1)
    c, s = whole.config, shard.config
    assert (s.num_heads, s.num_kv_heads, s.intermediate_size) == (
        c.num_heads // 2, c.num_kv_heads // 2, c.intermediate_size // 2,
    )  # fmt: skip
    assert whole.weights == {} and c.fingerprint(16) != s.fingerprint(16)
    p = "model.layers.1."
    cases = {
        "self_attn.q_proj.weight": np.s_[s.q_size :],
        "self_attn.k_proj.weight": np.s_[s.kv_size :],
        "self_attn.o_proj.weight": np.s_[:, s.q_size :],
        "mlp.up_proj.weight": np.s_[s.intermediate_size :],
        "mlp.down_proj.weight": np.s_[:, s.intermediate_size :],
        "input_layernorm.weight": np.s_[:],
    }
    for name, part in cases.items():
        np.testing.assert_array_equal(shard.weights[p + name].numpy(), full[p + name].numpy()[part])
    np.testing.assert_array_equal(
        shard.weights["model.embed_tokens.weight"].numpy(),
        full["model.embed_tokens.weight"].numpy(),
    )


def test_a_size_the_model_cannot_split_fails_the_start_and_ends_the_ranks(tiny_cache_dir) -> None:
    from workers.engine.engine import LLMEngine
    from workers.engine.engine_config import EngineConfig

    config = EngineConfig(model="tiny", cache_dir=str(tiny_cache_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="size 3 does not divide the model's 2 KV heads"):
        LLMEngine.from_config(config)
