"""A plain numpy (float64) Llama forward over a whole sequence: no paging, no batching.

Written independently of workers/engine/model.py (explicit per-head loops, repeat_kv, a full
causal mask) so that the paged decoder is checked against a second implementation of the
same Hugging Face semantics rather than against itself.
"""

from __future__ import annotations

import numpy as np

from workers.engine.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    d = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    s = config.rope_scaling
    if s is None:
        return inv
    if s.rope_type == "linear":
        return inv / s.factor
    assert s.rope_type == "llama3"
    out = []
    for f in inv:
        wavelen = 2 * np.pi / f
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            out.append(f)
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return np.array(out)


def apply_rope(x: np.ndarray, positions: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """x [T, heads, dim] rotated by position, HF rotate_half convention."""
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for t, p in enumerate(positions):
        ang = p * inv
        cos, sin = np.cos(ang), np.sin(ang)
        x1, x2 = x[t, :, :half], x[t, :, half:]
        out[t, :, :half] = x1 * cos - x2 * sin
        out[t, :, half:] = x2 * cos + x1 * sin
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def dense_forward(
    config: ModelConfig, weights: dict[str, np.ndarray], token_ids: list[int]
) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """Logits [T, vocab] at every position, and per layer (K, V) [T, kv_heads, dim] (K after
    rope), all float64."""
    c = config
    wt = {k: v.astype(np.float64) for k, v in weights.items()}
    n = len(token_ids)
    positions = np.arange(n)
    inv = rope_inv_freq(c)
    x = wt["model.embed_tokens.weight"][np.array(token_ids)]
    group = c.num_heads // c.num_kv_heads
    kv_per_layer = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, wt[p + "input_layernorm.weight"], c.rms_norm_eps)
        proj = {}
        for name in ("q", "k", "v"):
            y = h @ wt[p + f"self_attn.{name}_proj.weight"].T
            bias = wt.get(p + f"self_attn.{name}_proj.bias")
            proj[name] = y if bias is None else y + bias
        q = apply_rope(proj["q"].reshape(n, c.num_heads, c.head_dim), positions, inv)
        k = apply_rope(proj["k"].reshape(n, c.num_kv_heads, c.head_dim), positions, inv)
        v = proj["v"].reshape(n, c.num_kv_heads, c.head_dim)
        kv_per_layer.append((k, v))
        attn = np.zeros((n, c.num_heads, c.head_dim))
        causal = np.tril(np.ones((n, n), dtype=bool))
        if c.sliding_window is not None:  # query i sees keys j with i - window < j
            causal &= np.subtract.outer(np.arange(n), np.arange(n)) < c.sliding_window
        for head in range(c.num_heads):
            kv_head = head // group
            scores = q[:, head] @ k[:, kv_head].T / np.sqrt(c.head_dim)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            attn[:, head] = probs @ v[:, kv_head]
        o = attn.reshape(n, -1) @ wt[p + "self_attn.o_proj.weight"].T
        if p + "self_attn.o_proj.bias" in wt:
            o = o + wt[p + "self_attn.o_proj.bias"]
        x = x + o
        h = rms_norm(x, wt[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = h @ wt[p + "mlp.gate_proj.weight"].T
        up = h @ wt[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ wt[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, wt["model.norm.weight"], c.rms_norm_eps)
    lm_head = wt.get("lm_head.weight", wt["model.embed_tokens.weight"])
    return x @ lm_head.T, kv_per_layer
