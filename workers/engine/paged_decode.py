"""paged_decode_attention: one decode token per sequence attending over its paged KV cache in
place, a Triton kernel (no gather of the blocks first, unlike the SDPA path).

    program (s, h):  sequence s, kv head h; its GROUP query heads h * GROUP + [0, GROUP)
    for block j < ceil(context_lens[s] / BS):  b = block_tables[s, j]
        K[b, h] [BS, D], V[b, h] [BS, D]        (the cache: [num_blocks, kv_heads, BS, D])
        scores = q @ K^T * scale, positions >= context_lens[s] masked; online softmax
    out[s, h * GROUP + g] = sum_j softmax_j * V_j

Queries are padded to 16 rows for tl.dot (memory-bound anyway: the cache is read once). Needs
block_size >= 16 and power-of-two block_size and head_dim; no sliding window (callers check
`supports`). Runs under TRITON_INTERPRET=1 on the CPU, which is how the tests check it.
"""

from __future__ import annotations

from workers.engine.torch_runtime import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - Triton ships with PyTorch's CUDA wheels
    raise ImportError(
        f"--decode-attention triton needs Triton ({exc}): pip install triton, or use "
        "--decode-attention sdpa"
    ) from exc


def supports(block_size: int, head_dim: int, sliding_window: int | None) -> bool:
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    return block_size >= 16 and pow2(block_size) and pow2(head_dim) and sliding_window is None


@triton.jit
def _kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    stride_table,
    scale,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BS: tl.constexpr,
    D: tl.constexpr,
    IEEE: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D)
    slots = tl.arange(0, BS)
    heads = h * GROUP + rows  # query heads of this kv head
    q_offsets = (s * NUM_KV_HEADS * GROUP + heads)[:, None] * D + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=rows[:, None] < GROUP, other=0.0)  # [GP, D]
    context = tl.load(lens_ptr + s)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for j in range(0, tl.cdiv(context, BS)):
        block = tl.load(tables_ptr + s * stride_table + j).to(tl.int64)
        base = (block * NUM_KV_HEADS + h) * BS * D
        kv_offsets = base + slots[:, None] * D + dims[None, :]
        k = tl.load(k_ptr + kv_offsets)  # [BS, D]
        v = tl.load(v_ptr + kv_offsets)
        # float32 caches: full-precision dots (tf32 would cost ~1e-3 of exactness)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k))
        scores = qk.to(tl.float32) * scale  # [GP, BS]
        scores = tl.where((j * BS + slots)[None, :] < context, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee") if IEEE else tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv.to(tl.float32)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < GROUP)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """q [S, num_heads, D] (one token per sequence), caches [num_blocks, kv_heads, BS, D],
    block_tables int32/int64 [S, max_blocks], context_lens int32 [S] (keys [0, len) of each
    sequence, the token's own included) -> [S, num_heads, D] in q's dtype."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    _kernel[(num_seqs, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        block_tables.stride(0),
        head_dim**-0.5,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BS=block_size,
        D=head_dim,
        IEEE=q.dtype == torch.float32,
    )
    return out
