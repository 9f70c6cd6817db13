"""An 8B-shaped checkpoint of random bf16 weights, written on the GPU where it is served.

    python -m benchmarks.gpu.checkpoint /tmp/llama8b [--layers 32] [--device cuda]

Nothing is downloaded: the weights are drawn on the device (torch, seeded) at 1/sqrt(fan_in)
so activations stay finite through every layer, and written in Hugging Face layout as four
shards (no host copy of the whole model at once). The shapes are Llama-3-8B's:

    hidden 4096, 32 layers, 32 heads, 8 KV heads (head_dim 128), MLP 14336, vocab 128256

The tokenizer is a word-level one with a word per id ("w0" ... "w128255", split on spaces),
so every sampled id decodes to text and a prompt of N words is exactly N tokens:
`prompt_ids(n, salt)` builds one as token ids. A timing needs no meaningful text, only the shapes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    # Past Llama-3's 8192 so that the 16K-token timings fit; rope is plain (no scaling).
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": [1],
    "torch_dtype": "bfloat16",
}
NUM_SHARDS = 4
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w2 {% endif %}"
)


def prompt_ids(num_tokens: int, salt: int = 0) -> list[int]:
    """num_tokens ids past the special ones, a fresh run for each salt (no prefix shared with
    another salt's): the benchmarks' prompts, for this tokenizer or any of 30,003+ ids."""
    return [3 + (salt * 7919 + i * 31) % 30000 for i in range(num_tokens)]


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def write_checkpoint(
    folder: str | Path, num_layers: int | None = None, device: str = "cuda", seed: int = 0
) -> Path:
    """Write config.json, the shards with their index, and the tokenizer into `folder`."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(LLAMA3_8B)
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    shapes = tensor_shapes(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    names = list(shapes)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for shard in range(NUM_SHARDS):
        file_name = f"model-{shard + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        part = {}
        for name in names[shard::NUM_SHARDS]:
            shape = shapes[name]
            if len(shape) == 1:  # norms: near one
                t = 1.0 + 0.05 * torch.randn(shape, generator=gen, device=device)
            else:
                t = torch.randn(shape, generator=gen, device=device) / shape[1] ** 0.5
            part[name] = t.to(torch.bfloat16).cpu()
            total_bytes += part[name].numel() * 2
        save_file(part, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
        del part
    _write_json(
        folder / "model.safetensors.index.json",
        {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
    )
    _write_json(folder / "config.json", config)
    write_word_tokenizer(folder, config["vocab_size"])
    return folder


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.json: id i is the word "w{i}"; ids 0 and 1 are BOS and EOS.

    Words are spelled SentencePiece-style ("\u2581w5": split on spaces by a Metaspace
    pre-tokenizer, joined by the Llama-2 decoder sequence) so that llguidance, which every
    worker loads for structured output, recognises the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    space = "\u2581"
    vocab = {f"{space}w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=f"{space}w2"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme="always")
    llama2_decoder = [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*llama2_decoder, decoders.Strip(" ", 1, 0)])
    tok.save(str(folder / "tokenizer.json"))
    _write_json(
        folder / "tokenizer_config.json",
        {
            "bos_token": f"{space}w0",
            "eos_token": f"{space}w1",
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": LLAMA3_8B["max_position_embeddings"],
        },
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder = write_checkpoint(args.folder, args.layers, args.device, args.seed)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
