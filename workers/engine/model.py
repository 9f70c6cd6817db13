"""LlamaDecoder: the Paddle forward pass of a Llama-family decoder over a paged KV cache.

    x = embed(tokens)                                          all T tokens of the step at once
    per layer:  h = rmsnorm(x);  q, k, v = h @ Wqkv (+ b);  rope(q, k)
                write k, v into the cache at (block, row) of each token
                attention per group through block tables   (see step_input.py)
                x += attn @ Wo (+ b);  x += down(silu(h2 @ Wgate) * (h2 @ Wup)),  h2 = rmsnorm(x)
    logits = rmsnorm(x[logits_rows]) @ lm_head                  only rows that need them

Weights are kept fused and pre-transposed ([in, out]) so each projection is one matmul:
q/k/v as one [hidden, q + 2 kv] matrix, gate/up as one [hidden, 2 * intermediate] matrix.
Grouped-query attention follows HF's convention: query head h reads kv head h // group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from workers.engine.config import ModelConfig
from workers.engine.paddle_runtime import paddle
from workers.engine.rope import cos_sin_tables
from workers.engine.step_input import AttentionGroup, StepInput

F = paddle.nn.functional


@dataclass(frozen=True)
class LayerWeights:
    input_norm: paddle.Tensor  # [hidden]
    qkv: paddle.Tensor  # [hidden, q_size + 2 * kv_size]
    qkv_bias: paddle.Tensor | None  # [q_size + 2 * kv_size]
    o: paddle.Tensor  # [q_size, hidden]
    o_bias: paddle.Tensor | None  # [hidden]
    post_norm: paddle.Tensor  # [hidden]
    gate_up: paddle.Tensor  # [hidden, 2 * intermediate]
    down: paddle.Tensor  # [intermediate, hidden]


class LlamaDecoder:
    """Forward pass only (inference); weights come from `loader.load_model` (HF names)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, paddle.Tensor],
        max_positions: int,
        all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
    ):
        """weights: HF-named tensors already in the model dtype; max_positions: the longest
        sequence the cache can hold (rope tables cover it). all_reduce: a tensor-parallel
        rank's sum over ranks of the row-parallel outputs (o_proj, down_proj); config and
        weights are then the rank's shard (workers/engine/tp/sharding.py)."""
        self.config = config
        self.all_reduce = all_reduce
        c = config
        self.embed = weights["model.embed_tokens.weight"]  # [vocab, hidden]
        self.layers: list[LayerWeights] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."

            def w(name: str, prefix: str = p) -> paddle.Tensor:
                return weights[prefix + name]

            qkv = paddle.concat(
                [
                    w("self_attn.q_proj.weight"),
                    w("self_attn.k_proj.weight"),
                    w("self_attn.v_proj.weight"),
                ],
                axis=0,
            )  # HF stores [out, in]
            qkv_bias = None
            if c.qkv_bias:
                qkv_bias = paddle.concat(
                    [
                        w("self_attn.q_proj.bias"),
                        w("self_attn.k_proj.bias"),
                        w("self_attn.v_proj.bias"),
                    ]
                )
            gate_up = paddle.concat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")], axis=0)
            self.layers.append(
                LayerWeights(
                    input_norm=w("input_layernorm.weight"),
                    qkv=qkv.T.contiguous(),
                    qkv_bias=qkv_bias,
                    o=w("self_attn.o_proj.weight").T.contiguous(),
                    o_bias=w("self_attn.o_proj.bias") if c.o_bias else None,
                    post_norm=w("post_attention_layernorm.weight"),
                    gate_up=gate_up.T.contiguous(),
                    down=w("mlp.down_proj.weight").T.contiguous(),
                )
            )
        self.final_norm = weights["model.norm.weight"]
        # Tied: read the embedding through matmul(transpose_y) instead of copying it.
        self.lm_head = weights.get("lm_head.weight", self.embed)  # [vocab, hidden]
        cos, sin = cos_sin_tables(c.head_dim, c.rope_theta, c.rope_scaling, max_positions)
        # rotate_half(x) * sin == roll(x, dim / 2) * [-sin_1 | sin_2]: fold the sign into the
        # table so that rope is one roll and three elementwise ops.
        half = c.head_dim // 2
        sin[:, :half] *= -1.0
        # Every tensor this class makes goes where the weights are, explicitly: the engine
        # thread that calls forward() need not be the one that called paddle.set_device().
        self.place = self.embed.place
        self.rope_cos = self._upload(cos).astype(self.embed.dtype)  # [max_positions, dim]
        self.rope_sin_signed = self._upload(sin).astype(self.embed.dtype)
        self.max_positions = max_positions

    @paddle.no_grad()
    def forward(self, step: StepInput, kv_caches: list[paddle.Tensor]) -> paddle.Tensor:
        """float32 logits [len(step.logits_rows), vocab]; writes the step's K/V into kv_caches
        ([K0, V0, K1, V1, ...], each [num_blocks, kv_heads, block_size, head_dim])."""
        c = self.config
        if step.num_tokens and int(step.positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(step.positions.max())} beyond the {self.max_positions} "
                "positions this cache and rope table cover"
            )
        upload = self._upload
        token_ids = upload(step.token_ids)
        positions = upload(step.positions)
        block_idx = upload(step.write_block_ids).unsqueeze(1)  # [T, 1]
        row_idx = upload(step.write_rows).unsqueeze(1)  # [T, 1]
        head_idx = upload(np.arange(c.num_kv_heads, dtype=np.int64)).unsqueeze(0)  # [1, kv_heads]
        write_index = (block_idx, head_idx, row_idx)
        groups = [_GroupTensors.from_group(g, c.num_kv_heads, upload) for g in step.groups]
        cos = paddle.gather(self.rope_cos, positions).unsqueeze(1)  # [T, 1, dim]
        sin = paddle.gather(self.rope_sin_signed, positions).unsqueeze(1)

        x = F.embedding(token_ids, self.embed)  # [T, hidden]
        num_tokens = step.num_tokens
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, c.rms_norm_eps)
            qkv = paddle.matmul(h, layer.qkv)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            # q and k heads are rotated together: one rope for both.
            qk, v = paddle.split(qkv, [c.q_size + c.kv_size, c.kv_size], axis=-1)
            qk = _rope(qk.reshape([num_tokens, c.num_heads + c.num_kv_heads, c.head_dim]), cos, sin)
            q, k = paddle.split(qk, [c.num_heads, c.num_kv_heads], axis=1)
            v = v.reshape([num_tokens, c.num_kv_heads, c.head_dim])
            k_cache, v_cache = kv_caches[2 * i], kv_caches[2 * i + 1]
            paddle.index_put_(k_cache, write_index, k)
            paddle.index_put_(v_cache, write_index, v)
            outs = [self._attend(q, g, k_cache, v_cache) for g in groups]
            attn = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)  # [T, q_size]
            o = paddle.matmul(attn, layer.o)
            if self.all_reduce is not None:
                o = self.all_reduce(o)
            if layer.o_bias is not None:
                o = o + layer.o_bias
            x = x + o
            h = _rms_norm(x, layer.post_norm, c.rms_norm_eps)
            gate, up = paddle.split(
                paddle.matmul(h, layer.gate_up), 2, axis=-1
            )  # [T, intermediate] each
            mlp = paddle.matmul(F.silu(gate) * up, layer.down)
            x = x + (mlp if self.all_reduce is None else self.all_reduce(mlp))

        rows = paddle.gather(x, upload(step.logits_rows))
        rows = _rms_norm(rows, self.final_norm, c.rms_norm_eps)
        logits = paddle.matmul(rows, self.lm_head, transpose_y=True)
        return logits.astype("float32")

    def _upload(self, array: np.ndarray) -> paddle.Tensor:
        return paddle.to_tensor(array, place=self.place)

    def _attend(
        self, q: paddle.Tensor, g: _GroupTensors, k_cache: paddle.Tensor, v_cache: paddle.Tensor
    ) -> paddle.Tensor:
        """Attention of one group's queries ([S*L] rows of q) over their gathered cache."""
        c = self.config
        s_, l_, kvh, d = g.num_seqs, g.query_len, c.num_kv_heads, c.head_dim
        group = c.num_heads // kvh
        q = q[g.token_start : g.token_start + s_ * l_]  # [S*L, heads, d]
        # Query head h = kv * group + j reads kv head kv: rows (j, i) of batch (s, kv).
        # Decode (L == 1) needs no transpose, which matters: CPU transposes are slow.
        if l_ == 1:
            q = q.reshape([s_, kvh, group, d])
        else:
            q = q.reshape([s_, l_, kvh, group, d]).transpose([0, 2, 3, 1, 4])
            q = q.reshape([s_, kvh, group * l_, d])
        k = _gather_heads(k_cache, g.gather_ids, s_)  # [S, kvh, ctx, d]
        v = _gather_heads(v_cache, g.gather_ids, s_)
        scores = paddle.matmul(q, k, transpose_y=True).astype("float32") * (d**-0.5)
        ctx = scores.shape[-1]
        scores = scores.reshape([s_, kvh, group, l_, ctx]) + g.mask_bias  # mask [S,1,1,L,ctx]
        probs = F.softmax(scores, axis=-1).astype(q.dtype).reshape([s_, kvh, group * l_, ctx])
        out = paddle.matmul(probs, v)  # [S, kvh, group * L, d]
        if l_ == 1:
            return out.reshape([s_, c.q_size])
        out = out.reshape([s_, kvh, group, l_, d]).transpose([0, 3, 1, 2, 4])
        return out.reshape([s_ * l_, c.q_size])


@dataclass(frozen=True)
class _GroupTensors:
    token_start: int
    num_seqs: int
    query_len: int
    gather_ids: paddle.Tensor  # int64 [S * kv_heads * max_blocks], see _gather_heads
    mask_bias: paddle.Tensor  # float32 [S, 1, 1, L, ctx]

    @classmethod
    def from_group(
        cls, g: AttentionGroup, num_kv_heads: int, upload: Callable[[np.ndarray], paddle.Tensor]
    ) -> _GroupTensors:
        mask = upload(g.mask_bias)
        return cls(
            token_start=g.token_start,
            num_seqs=g.num_seqs,
            query_len=g.query_len,
            gather_ids=upload(g.head_rows(num_kv_heads)),
            mask_bias=mask.reshape([g.num_seqs, 1, 1, g.query_len, mask.shape[-1]]),
        )


def _gather_heads(cache: paddle.Tensor, gather_ids: paddle.Tensor, num_seqs: int) -> paddle.Tensor:
    # [num_blocks, kvh, bs, d] viewed as [num_blocks * kvh, bs, d] (free: contiguous), gathered
    # as (seq, head, block) rows -> [S, kvh, mb * bs, d]: position j of a sequence is row
    # j % bs of its (j // bs)-th block, so blocks side by side give positions in order.
    num_blocks, kvh, bs, d = cache.shape
    rows = paddle.gather(cache.reshape([num_blocks * kvh, bs, d]), gather_ids, axis=0)
    return rows.reshape([num_seqs, kvh, -1, d])


def _rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    # Computed in float32 whatever the model dtype, as the reference implementation does.
    x32 = x.astype("float32")
    normed = x32 * paddle.rsqrt(paddle.mean(x32 * x32, axis=-1, keepdim=True) + eps)
    return normed.astype(x.dtype) * weight


def _rope(x: paddle.Tensor, cos: paddle.Tensor, sin_signed: paddle.Tensor) -> paddle.Tensor:
    # x [T, heads, dim]; cos, sin_signed [T, 1, dim]. rotate_half(x) = [-x2 | x1]
    # = roll(x, dim / 2) with the first half negated (the sign lives in sin_signed).
    return x * cos + paddle.roll(x, x.shape[-1] // 2, axis=-1) * sin_signed
