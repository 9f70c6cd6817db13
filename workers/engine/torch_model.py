"""TorchLlamaDecoder: the PyTorch forward of the Llama-family decoder, the math of model.py.

    x = embed(tokens)                                          all T tokens of the step at once
    per layer:  h = rmsnorm(x);  q, k, v = h @ Wqkv^T (+ b);  rope(q, k)
                write k, v into the cache at (block, row) of each token
                attention per group (see step_input.py), through SDPA:
                  fresh:  every chunk of the group starts at position 0 -> causal attention
                          over the chunk's own k, v (no gather; flash kernel on a GPU)
                  tail:   every chunk starts at one position p > 0 (a later chunk of a
                          chunked prefill, a chunk after a prefix hit) -> k, v gathered from
                          the cache, causal attention aligned to the bottom right (flash)
                  masked: the rest (decodes, mixed starts, a window inside the context):
                          k, v gathered, an explicit mask
    x += attn @ Wo^T (+ b);  x += down(silu(h2 @ Wgate^T) * (h2 @ Wup^T)),  h2 = rmsnorm(x)
    logits = rmsnorm(x[logits_rows]) @ lm_head^T               only rows that need them

Weights stay in HF's [out, in] layout (F.linear reads them transposed at no cost); q/k/v and
gate/up are fused into one matrix each. Query head h reads kv head h // group (HF's GQA).

Attention kernel: torch.nn.functional.scaled_dot_product_attention (SDPA), not flex
attention. SDPA needs no compilation (flex attention compiles a kernel per mask shape, which
a continuous batch changes every step) and picks the fused kernel itself: flash for the fresh
causal path (is_causal, enable_gqa: no repeat of kv heads) and the tail path (its lower-right
causal bias, torch.nn.attention.bias.causal_lower_right), memory-efficient attention for the
masked path. Tail and masked gather each sequence's blocks first (one index_select per layer,
K and V), as the Paddle decoder does; the masked path's queries are laid out per kv head
([S, kv_heads, group * L, d]) so grouped heads need no repeat there either. With
paged_decode (--decode-attention triton) decode groups skip the gather: paged_decode.py reads
the blocks in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from workers.engine.config import ModelConfig
from workers.engine.rope import cos_sin_tables
from workers.engine.step_input import AttentionGroup, StepInput
from workers.engine.torch_runtime import torch

F = torch.nn.functional
causal_lower_right = torch.nn.attention.bias.causal_lower_right


@dataclass(frozen=True)
class TorchLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o: torch.Tensor  # [hidden, q_size]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class TorchLlamaDecoder:
    """Forward pass only; weights are HF-named torch tensors on one device, in the model dtype
    (loader.load_model(..., framework="torch"))."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        paged_decode: bool = False,
    ) -> None:
        """max_positions: the longest sequence the cache can hold (rope tables cover it).
        all_reduce: a tensor-parallel rank's sum of the row-parallel outputs (o_proj,
        down_proj) over ranks; config and weights are then the rank's shard."""
        self.config = config
        self.all_reduce = all_reduce
        # Decode groups through the Triton paged kernel instead of gather + SDPA.
        self.paged_decode = paged_decode
        c = config
        self.embed = weights["model.embed_tokens.weight"]  # [vocab, hidden]
        self.device = self.embed.device
        self.layers: list[TorchLayer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv_names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            qkv_bias = None
            if c.qkv_bias:
                qkv_bias = torch.cat([weights[p + n + ".bias"] for n in qkv_names])
            self.layers.append(
                TorchLayer(
                    input_norm=weights[p + "input_layernorm.weight"],
                    qkv=torch.cat([weights[p + n + ".weight"] for n in qkv_names], dim=0),
                    qkv_bias=qkv_bias,
                    o=weights[p + "self_attn.o_proj.weight"],
                    o_bias=weights[p + "self_attn.o_proj.bias"] if c.o_bias else None,
                    post_norm=weights[p + "post_attention_layernorm.weight"],
                    gate_up=torch.cat(
                        [weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]],
                        dim=0,
                    ),
                    down=weights[p + "mlp.down_proj.weight"],
                )
            )
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed)  # [vocab, hidden]; tied: embed
        cos, sin = cos_sin_tables(c.head_dim, c.rope_theta, c.rope_scaling, max_positions)
        # rotate_half(x) * sin == roll(x, dim / 2) * [-sin_1 | sin_2] (as model.py does).
        sin[:, : c.head_dim // 2] *= -1.0
        dtype = self.embed.dtype
        self.rope_cos = self._upload(cos).to(dtype)  # [max_positions, dim]
        self.rope_sin_signed = self._upload(sin).to(dtype)
        self.max_positions = max_positions

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def check_positions(self, step: StepInput) -> None:
        if step.num_tokens and int(step.positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(step.positions.max())} beyond the {self.max_positions} "
                "positions this cache and rope table cover"
            )

    def prepare(self, step: StepInput) -> StepTensors:
        """The step's index arrays on the device (the attention groups' too)."""
        upload = self._upload
        return StepTensors(
            token_ids=upload(step.token_ids),
            positions=upload(step.positions),
            write_blocks=upload(step.write_block_ids),
            write_rows=upload(step.write_rows),
            groups=tuple(
                GroupTensors.build(g, step.positions, self.config, upload, self.paged_decode)
                for g in step.groups
            ),
            logits_rows=upload(step.logits_rows),
        )

    def forward(self, step: StepInput, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """float32 logits [len(step.logits_rows), vocab]; writes the step's K/V into kv_caches
        ([K0, V0, K1, V1, ...], each [num_blocks, kv_heads, block_size, head_dim])."""
        self.check_positions(step)
        return self.run_tensors(self.prepare(step), kv_caches)

    @torch.inference_mode()
    def run_tensors(self, t: StepTensors, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """forward() on prepared tensors: only device work, no host sync (a CUDA graph
        captures it: torch_graphs.py)."""
        c = self.config
        write_blocks, write_rows, groups = t.write_blocks, t.write_rows, t.groups
        cos = self.rope_cos.index_select(0, t.positions).unsqueeze(1)  # [T, 1, dim]
        sin = self.rope_sin_signed.index_select(0, t.positions).unsqueeze(1)

        x = F.embedding(t.token_ids, self.embed)  # [T, hidden]
        num_tokens = t.token_ids.shape[0]
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, c.rms_norm_eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            qk, v = qkv.split([c.q_size + c.kv_size, c.kv_size], dim=-1)
            qk = _rope(qk.reshape(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            v = v.reshape(num_tokens, c.num_kv_heads, c.head_dim)
            k_cache, v_cache = kv_caches[2 * i], kv_caches[2 * i + 1]
            # [T] block and row indices around the head slice: each token's [kv_heads, dim].
            k_cache[write_blocks, :, write_rows] = k
            v_cache[write_blocks, :, write_rows] = v
            outs = [_attend(q, k, v, g, k_cache, v_cache, c) for g in groups]
            attn = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # [T, q_size]
            o = F.linear(attn, layer.o)
            if self.all_reduce is not None:
                o = self.all_reduce(o)
            if layer.o_bias is not None:
                o = o + layer.o_bias
            x = x + o
            h = _rms_norm(x, layer.post_norm, c.rms_norm_eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)  # [T, intermediate] each
            mlp = F.linear(F.silu(gate) * up, layer.down)
            x = x + (mlp if self.all_reduce is None else self.all_reduce(mlp))

        rows = x.index_select(0, t.logits_rows)
        rows = _rms_norm(rows, self.final_norm, c.rms_norm_eps)
        return F.linear(rows, self.lm_head).float()


@dataclass(frozen=True)
class StepTensors:
    """A StepInput on the device (TorchLlamaDecoder.prepare, or a CUDA graph's static inputs)."""

    token_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    write_blocks: torch.Tensor  # int64 [T]
    write_rows: torch.Tensor  # int64 [T]
    groups: tuple[GroupTensors, ...]
    logits_rows: torch.Tensor  # int64 [n]


@dataclass(frozen=True)
class GroupTensors:
    """One attention group's index and mask tensors, built once a step for every layer."""

    token_start: int
    num_seqs: int  # S
    query_len: int  # L
    # "fresh": every chunk starts at position 0 and no window cuts inside it, so its keys are
    # exactly its own tokens' and causal attention needs neither the cache nor a mask.
    # "tail": every chunk starts at one position > 0 and no window cuts inside the context:
    # causal attention over the gathered context, aligned to its end. "paged": decodes read
    # through their block tables in place (paged_decode.py, --decode-attention triton).
    # "masked": the rest.
    path: str
    context_len: int  # keys each sequence attends over ("tail": its end position)
    gather_ids: torch.Tensor | None  # int64 [S * kv_heads * max_blocks] (tail, masked)
    mask: torch.Tensor | None  # bool [S, 1, group * L or 1, ctx]: True = attend (masked)
    block_tables: torch.Tensor | None = None  # int64 [S, max_blocks] (paged)
    context_lens: torch.Tensor | None = None  # int32 [S]: keys [0, len) of each (paged)

    @classmethod
    def build(
        cls,
        g: AttentionGroup,
        positions: np.ndarray,
        c: ModelConfig,
        upload: Callable[[np.ndarray], torch.Tensor],
        paged: bool = False,
    ) -> GroupTensors:
        """paged: decode groups read the cache in place (the caller checked the kernel
        supports this model and block size: paged_decode.supports)."""
        s_, l_ = g.num_seqs, g.query_len
        if paged and l_ == 1:
            lens = (g.query_pos[:, 0] + 1).astype(np.int32)
            ctx = g.block_table.shape[1] * g.block_size
            return cls(
                g.token_start, s_, 1, "paged", ctx, None, None, upload(g.block_table), upload(lens)
            )
        starts = positions[g.token_start : g.token_start + s_ * l_ : l_]
        end = int(starts[0]) + l_
        window_inside = c.sliding_window is not None and end > c.sliding_window
        if l_ > 1 and not starts.any() and not window_inside:
            return cls(g.token_start, s_, l_, "fresh", l_, None, None)
        ids = upload(g.head_rows(c.num_kv_heads))
        if l_ > 1 and (starts == starts[0]).all() and not window_inside:
            return cls(g.token_start, s_, l_, "tail", end, ids, None)
        allowed = upload(g.allowed)  # [S, L, ctx]
        group = c.num_heads // c.num_kv_heads
        if l_ == 1:
            mask = allowed.unsqueeze(1)  # [S, 1, 1, ctx]: the same for the group's q rows
        else:  # query rows (j, i) of a kv head: head j of the group, token i
            ctx = allowed.shape[-1]
            mask = (
                allowed[:, None, None].expand(s_, 1, group, l_, ctx).reshape(s_, 1, group * l_, ctx)
            )
        return cls(g.token_start, s_, l_, "masked", allowed.shape[-1], ids, mask)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: GroupTensors,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c: ModelConfig,
) -> torch.Tensor:
    """Attention of one group's queries (rows [token_start, + S*L) of q): [S*L, q_size]."""
    s_, l_, kvh, d = g.num_seqs, g.query_len, c.num_kv_heads, c.head_dim
    rows = slice(g.token_start, g.token_start + s_ * l_)
    if g.path == "fresh":
        qs = q[rows].reshape(s_, l_, c.num_heads, d).transpose(1, 2)  # [S, H, L, d]
        ks = k[rows].reshape(s_, l_, kvh, d).transpose(1, 2)  # [S, kvh, L, d]
        vs = v[rows].reshape(s_, l_, kvh, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(s_ * l_, c.q_size)
    if g.path == "paged":
        from workers.engine.paged_decode import paged_decode_attention

        assert g.block_tables is not None and g.context_lens is not None
        out = paged_decode_attention(q[rows], k_cache, v_cache, g.block_tables, g.context_lens)
        return out.reshape(s_, c.q_size)
    assert g.gather_ids is not None
    if g.path == "tail":
        qs = q[rows].reshape(s_, l_, c.num_heads, d).transpose(1, 2)  # [S, H, L, d]
        ctx = g.context_len
        ks = _gather_heads(k_cache, g.gather_ids, s_)[:, :, :ctx]  # [S, kvh, ctx, d]
        vs = _gather_heads(v_cache, g.gather_ids, s_)[:, :, :ctx]
        # Query i (position ctx - L + i) sees keys [0, ctx - L + i]: the bottom-right triangle.
        bias = causal_lower_right(l_, ctx)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, enable_gqa=True)
        return out.transpose(1, 2).reshape(s_ * l_, c.q_size)
    assert g.mask is not None
    group = c.num_heads // kvh
    if l_ == 1:
        qs = q[rows].reshape(s_, kvh, group, d)
    else:
        qs = q[rows].reshape(s_, l_, kvh, group, d).permute(0, 2, 3, 1, 4)
        qs = qs.reshape(s_, kvh, group * l_, d)
    ks = _gather_heads(k_cache, g.gather_ids, s_)  # [S, kvh, ctx, d]
    vs = _gather_heads(v_cache, g.gather_ids, s_)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=g.mask)  # [S, kvh, group*L, d]
    if l_ == 1:
        return out.reshape(s_, c.q_size)
    out = out.reshape(s_, kvh, group, l_, d).permute(0, 3, 1, 2, 4)
    return out.reshape(s_ * l_, c.q_size)


def _gather_heads(cache: torch.Tensor, gather_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    # [num_blocks, kvh, bs, d] viewed as [num_blocks * kvh, bs, d], gathered as (seq, head,
    # block) rows -> [S, kvh, mb * bs, d]: blocks side by side give positions in order.
    num_blocks, kvh, bs, d = cache.shape
    rows = cache.view(num_blocks * kvh, bs, d).index_select(0, gather_ids)
    return rows.view(num_seqs, kvh, -1, d)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in float32 whatever the model dtype, as the reference implementation does.
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x [T, heads, dim]; cos, sin_signed [T, 1, dim]; rotate_half via roll (see model.py).
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed
