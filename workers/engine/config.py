"""ModelConfig: the architecture of a Llama-family decoder, read from a Hugging Face config.json.

One decoder covers Llama, Qwen2 and Mistral checkpoints; what differs between them is only
configuration, normalized here so that nothing downstream looks at `model_type`:

    llama    attention_bias (q, k, v and o biases when true), rope_scaling (linear, llama3)
    qwen2    q, k and v always carry biases, o does not
    mistral  sliding_window (keys older than the window are masked), explicit head_dim

No Paddle here: the control plane reads this config too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from workers.engine.checkpoint_digest import checkpoint_digest
from workers.pool.keys import model_fingerprint

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
# rope_scaling types the decoder implements; "default" is HF's spelling of "none".
SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """The subset of HF's rope_scaling dict the decoder uses (see `rope.py` for the formulas)."""

    rope_type: str
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    model_id: str
    dtype: str = "float32"
    model_type: str = "llama"
    qkv_bias: bool = False
    checkpoint_digest: str = ""  # content of the checkpoint (checkpoint_digest.py)
    o_bias: bool = False
    # Mistral's sliding-window attention: a query at position q attends to keys k with
    # q - sliding_window < k <= q. None means full causal attention.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not supported; use one of {SUPPORTED_DTYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention needs it)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def fingerprint(self, block_size: int) -> str:
        """16 hex chars: workers whose KV blocks are interchangeable share it (whatever
        their TP sizes: a pool object names the KV heads it holds)."""
        return model_fingerprint(
            model_id=self.model_id,
            dtype=self.dtype,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            checkpoint_digest=self.checkpoint_digest,
        )

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], model_id: str, dtype: str = "float32") -> ModelConfig:
        """Normalize a parsed config.json. Raises ValueError naming the offending key."""
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} not supported; this decoder covers "
                f"{SUPPORTED_MODEL_TYPES}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if key not in hf:
                raise ValueError(f"config.json lacks required key {key!r}")
        # The decoder's MLP is SwiGLU without biases; anything else would load and run wrong.
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {hf['hidden_act']!r} not supported (only silu)")
        if hf.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported")
        hidden = int(hf["hidden_size"])
        num_heads = int(hf.get("num_attention_heads", 0))
        if num_heads < 1:
            raise ValueError("config.json lacks a positive 'num_attention_heads'")
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        # Mistral-Nemo and others give head_dim explicitly (hidden != heads * head_dim).
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        attention_bias = bool(hf.get("attention_bias", False))
        qkv_bias = model_type == "qwen2" or attention_bias
        o_bias = model_type != "qwen2" and attention_bias
        sliding_window = hf.get("sliding_window")
        if model_type == "qwen2":
            # Qwen2 applies its window only to some layers (max_window_layers); its released
            # checkpoints all leave it off.
            if hf.get("use_sliding_window", False):
                raise ValueError("qwen2 with use_sliding_window=true is not supported")
            sliding_window = None
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=_parse_rope_scaling(hf.get("rope_scaling")),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
            model_id=model_id,
            dtype=dtype,
            model_type=model_type,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_window=int(sliding_window) if sliding_window else None,
        )

    @classmethod
    def from_dir(cls, path: str | Path, model_id: str, dtype: str = "float32") -> ModelConfig:
        """Read `config.json` (and `generation_config.json` for extra eos ids) from a folder."""
        folder = Path(path)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found: not a Hugging Face checkpoint")
        with open(config_path, encoding="utf-8") as f:
            hf = json.load(f)
        try:
            config = cls.from_hf_dict(hf, model_id=model_id, dtype=dtype)
        except ValueError as exc:
            raise ValueError(f"{config_path}: {exc}") from exc
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            with open(gen_path, encoding="utf-8") as f:
                extra = _as_id_tuple(json.load(f).get("eos_token_id"))
            merged = config.eos_token_ids + tuple(i for i in extra if i not in config.eos_token_ids)
            config = replace(config, eos_token_ids=merged)
        return replace(config, checkpoint_digest=checkpoint_digest(folder))


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _parse_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    # Older configs spell it "type", newer ones "rope_type".
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_SCALING:
        raise ValueError(
            f"rope_scaling type {rope_type!r} not supported; use one of {SUPPORTED_ROPE_SCALING}"
        )
    if rope_type == "default":
        return None
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
