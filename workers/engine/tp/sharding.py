"""How a tensor-parallel rank slices the checkpoint: Megatron's split of a Llama layer.

    q/k/v_proj  [out, in]   rows of the rank's heads          column-parallel: no reduction
    o_proj      [out, in]   columns of the rank's query heads  row-parallel: all-reduce after
    gate/up     [out, in]   rows [r * I / t, (r + 1) * I / t)  column-parallel
    down_proj   [out, in]   the same columns                   row-parallel: all-reduce after
    embeddings, norms, lm_head, o_proj bias                    whole on every rank

Query heads and KV heads split alike, so query head h of a rank still reads KV head
h // group of the same rank. The rank's decoder runs the shard's ModelConfig (its heads and
MLP width); the engine keeps the whole model's config, whose fingerprint names the blocks.
"""

from __future__ import annotations

import dataclasses

from workers.engine.config import ModelConfig
from workers.engine.loader import Select
from workers.engine.tp.shards import tp_problem


def shard_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The part of the model one rank computes: heads and MLP width divided by tp_size."""
    problem = tp_problem(config.num_heads, config.num_kv_heads, config.intermediate_size, tp_size)
    if problem is not None:
        raise ValueError(problem)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp_size,
        num_kv_heads=config.num_kv_heads // tp_size,
        intermediate_size=config.intermediate_size // tp_size,
    )


def shard_selector(config: ModelConfig, rank: int, tp_size: int) -> Select:
    """The loader's select: each sharded tensor's slice for `rank`, None for the rest."""
    part = shard_config(config, tp_size)
    q = slice(rank * part.q_size, (rank + 1) * part.q_size)
    kv = slice(rank * part.kv_size, (rank + 1) * part.kv_size)
    mlp = slice(rank * part.intermediate_size, (rank + 1) * part.intermediate_size)
    everything = slice(None)
    by_suffix: dict[str, tuple[slice, ...]] = {
        "self_attn.q_proj.weight": (q,),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (everything, q),
        "mlp.gate_proj.weight": (mlp,),
        "mlp.up_proj.weight": (mlp,),
        "mlp.down_proj.weight": (everything, mlp),
    }

    def select(name: str) -> tuple[slice, ...] | None:
        if not name.startswith("model.layers."):
            return None
        return by_suffix.get(name.split(".", 3)[3])

    return select
