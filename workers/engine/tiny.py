"""The built-in tiny model: a random Llama-style checkpoint in Hugging Face layout.

`--model tiny` materializes, deterministically from a seed (numpy RNG only), a folder holding

    config.json               LlamaForCausalLM, small sizes
    model.safetensors         HF tensor names (or shards + model.safetensors.index.json)
    tokenizer.json            byte-level: ids 0..255 are the bytes, then special tokens
    tokenizer_config.json     special token names and a small jinja2 chat template
    pdrouter_tiny.json        what generated it (spec, seed, digest of this generator)

and the engine loads it through the ordinary loader, so the real loading path is what runs.
The folder is written under a temporary name and renamed into place, so concurrent processes
racing to create it all end up reading one complete copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

MARKER_FILE = "pdrouter_tiny.json"
SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)
BOS_TOKEN, EOS_TOKEN, END_TOKEN = "<|bos|>", "<|eos|>", "<|end|>"
NUM_BYTE_TOKENS = 256
BIAS_CHANNEL_VALUE = 4.0
END_LOGIT_BIAS = 2.0
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Sizes and options of a generated checkpoint (tests also use it for Qwen2/Mistral shapes)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    attention_bias: bool = False
    # Extra rows past the tokenizer's vocabulary, as real checkpoints pad their embeddings.
    vocab_padding: int = 2
    head_dim: int | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return NUM_BYTE_TOKENS + len(SPECIAL_TOKENS) + self.vocab_padding

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


# Named presets for `--model`: the default, and a larger one for CPU throughput benchmarks.
PRESETS: MappingProxyType[str, TinySpec] = MappingProxyType(
    {
        "tiny": TinySpec(),
        "tiny-large": TinySpec(
            hidden_size=512,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=1408,
        ),
    }
)


def is_tiny_name(model: str) -> bool:
    return model in PRESETS


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "pdrouter"


def materialize_tiny(
    name: str = "tiny", seed: int = 0, cache_root: str | Path | None = None
) -> Path:
    """Return the folder of preset `name` for `seed`, generating it once if absent or stale.

    The folder is `<cache_root>/<name>-<seed>` (cache_root defaults to ~/.cache/pdrouter).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown tiny preset {name!r}; choose one of {sorted(PRESETS)}")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-{seed}"
    marker = _marker(PRESETS[name], seed)
    for _ in range(3):
        if _read_marker(final) == marker:
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-{seed}.", dir=root))
        try:
            write_checkpoint(tmp, PRESETS[name], seed)
            # Re-read: a racing process may have put a good copy in place meanwhile, and a
            # reader may be loading it; only a stale copy (older generator) is moved aside.
            if final.exists() and _read_marker(final) != marker:
                _move_aside(final, root)
            # Losing the rename means another process put its copy in first: use that one.
            with contextlib.suppress(OSError):
                os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    if _read_marker(final) != marker:
        raise RuntimeError(f"could not materialize the tiny model at {final}")
    return final


def write_checkpoint(folder: str | Path, spec: TinySpec, seed: int, num_shards: int = 1) -> None:
    """Write a complete HF-layout checkpoint for `spec` into an existing folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = make_weights(spec, seed)
    _write_safetensors(folder, tensors, num_shards)
    _write_json(folder / "config.json", hf_config(spec))
    write_byte_tokenizer(folder)
    _write_json(folder / MARKER_FILE, _marker(spec, seed))


def hf_config(spec: TinySpec) -> dict[str, Any]:
    """config.json contents for `spec`."""
    arch = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
    }
    config: dict[str, Any] = {
        "architectures": [arch[spec.model_type]],
        "model_type": spec.model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias,
        "hidden_act": "silu",
        "bos_token_id": NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": [
            NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(EOS_TOKEN),
            NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(END_TOKEN),
        ],
        "torch_dtype": "float32",
    }
    if spec.head_dim is not None:
        config["head_dim"] = spec.head_dim
    config.update(spec.extra_config)
    return config


def make_weights(spec: TinySpec, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 tensors, a pure function of (spec, seed).

    Shaped so that output is varied readable text rather than one repeated token:
    projections at 1/sqrt(fan_in), LM-head rows of printable ASCII larger than the rest, the
    current token's direction taken out of the head, and a logit bias against the rest.
    """
    rng = np.random.Generator(np.random.Philox(key=seed))
    h, inter, d = spec.hidden_size, spec.intermediate_size, spec.resolved_head_dim
    q_size, kv_size = spec.num_heads * d, spec.num_kv_heads * d

    def dense(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    embed = rng.standard_normal((spec.vocab_size, h)).astype(np.float32)
    # Channel 0 is a constant: after the final norm it still reads ~3.5 for any token, so
    # the LM head's column 0 acts as a per-token logit bias (see below).
    embed[:, 0] = BIAS_CHANNEL_VALUE
    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed}
    qkv_bias = spec.model_type == "qwen2" or spec.attention_bias
    o_bias = spec.model_type != "qwen2" and spec.attention_bias
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = dense(q_size, h)
        tensors[p + "self_attn.k_proj.weight"] = dense(kv_size, h)
        tensors[p + "self_attn.v_proj.weight"] = dense(kv_size, h)
        tensors[p + "self_attn.o_proj.weight"] = dense(h, q_size)
        if qkv_bias:
            for proj, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
                bias = 0.1 * rng.standard_normal(size)
                tensors[p + f"self_attn.{proj}_proj.bias"] = bias.astype(np.float32)
        if o_bias:
            tensors[p + "self_attn.o_proj.bias"] = (0.1 * rng.standard_normal(h)).astype(np.float32)
        tensors[p + "mlp.gate_proj.weight"] = dense(inter, h)
        tensors[p + "mlp.up_proj.weight"] = dense(inter, h)
        tensors[p + "mlp.down_proj.weight"] = dense(h, inter)
        tensors[p + "input_layernorm.weight"] = norm(h)
        tensors[p + "post_attention_layernorm.weight"] = norm(h)
    tensors["model.norm.weight"] = norm(h)
    if not spec.tie_word_embeddings:
        row_scale = np.full((spec.vocab_size, 1), 0.3, dtype=np.float32)
        row_scale[0x20:0x7F] = 1.0  # printable ASCII
        row_scale[ord("\n")] = 1.0
        end_id = NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(END_TOKEN)
        row_scale[end_id] = 0.8
        # The last hidden state leans towards the current token's embedding (the residual
        # stream), so a random head would often repeat it forever: subtract that direction.
        lm_head = dense(spec.vocab_size, h) * 3.0 * row_scale - 6.0 * embed / h
        # Logit bias through the constant channel: bytes that are not printable ASCII (and
        # so mostly invalid UTF-8 alone) and specials other than <|end|> are ~8 logits down,
        # so even sampled text reads as text and <|end|> ends it now and then.
        readable = row_scale[:, 0] == 1.0
        readable[end_id] = True
        lm_head[:, 0] = np.where(readable, 0.0, -8.0 / 3.5)
        lm_head[end_id, 0] = END_LOGIT_BIAS / 3.5
        tensors["lm_head.weight"] = lm_head.astype(np.float32)
    return tensors


def byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: each byte maps to one printable character (GPT-2's scheme,
    which `tokenizers`' ByteLevel pre-tokenizer and decoder use)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_byte_tokenizer(folder: str | Path) -> None:
    """tokenizer.json (ids 0..255 = bytes, then SPECIAL_TOKENS) and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    folder = Path(folder)
    vocab = {char: b for b, char in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no merges: every byte of any UTF-8 text becomes exactly one token.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    tok.save(str(folder / "tokenizer.json"))
    _write_json(
        folder / "tokenizer_config.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "chat_template": TINY_CHAT_TEMPLATE,
            "model_max_length": 2048,
        },
    )


def _write_safetensors(folder: Path, tensors: dict[str, np.ndarray], num_shards: int) -> None:
    from safetensors.numpy import save_file

    if num_shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[shard::num_shards]}
        save_file(part, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
    total_bytes = sum(t.nbytes for t in tensors.values())
    _write_json(
        folder / "model.safetensors.index.json",
        {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
    )


def _marker(spec: TinySpec, seed: int) -> dict[str, Any]:
    # The generator's own source is part of the marker: any change to it (which may change the
    # bytes) makes cached copies stale, with no version number to forget to bump.
    source_sha256 = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return {"generator_sha256": source_sha256, "seed": seed, "spec": asdict(spec)}


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        with open(folder / MARKER_FILE, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _move_aside(folder: Path, root: Path) -> None:
    trash = Path(tempfile.mkdtemp(prefix=".stale-", dir=root))
    # Fails harmlessly when a racing process already moved or replaced it.
    with contextlib.suppress(OSError):
        os.rename(folder, trash / folder.name)
    shutil.rmtree(trash, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
