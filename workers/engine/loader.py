"""load_model: a Hugging Face checkpoint folder (or a built-in model) -> LoadedModel.

    <folder>/config.json                    -> ModelConfig
    <folder>/model.safetensors              -> weights (one file), or
    <folder>/model.safetensors.index.json   -> weights spread over the shards it maps
    <folder>/tokenizer.json (+ tokenizer_config.json) -> Tokenizer

Every tensor the decoder needs is checked against the config before any is loaded, so a
wrong checkpoint fails fast with an error that names the tensor and the file.

Built-in names: the tiny presets ("tiny", "tiny-large": random weights, generated on first
use) and the packaged models ("demo": trained, shipped in workers/models/).

Tensors are converted to the model dtype (`--dtype`, float32 by default) as they load, in one
named step, `convert_to_model_dtype`, logged once per load. They load as Paddle tensors on the
CPU (framework "paddle") or as PyTorch tensors straight onto the runner's device (framework
"torch": safetensors.torch, no Paddle import); each framework is imported only when asked for.
A half-precision checkpoint (the demo model is float16) served on the CPU is widened to
float32, which Paddle's CPU kernels need; the widening is exact: every float16 and bfloat16
value is a float32 value.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.engine.config import ModelConfig
from workers.engine.tiny import PRESETS, is_tiny_name, materialize_tiny
from workers.engine.tokenizer import Tokenizer
from workers.models.packaged import PACKAGED_MODELS, is_packaged_name, packaged_model_dir

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names the loader converts to the model dtype; anything else (quantized
# ints, fp8) is rejected by name.
FLOAT_DTYPES = ("F32", "F16", "BF16")
# A tensor name -> the part of it to read (index slices), None for all of it: a
# tensor-parallel rank reads only its slices (workers/engine/tp/sharding.py).
Select = Callable[[str], "tuple[slice, ...] | None"]


class CheckpointError(ValueError):
    """The checkpoint does not match its config: a tensor missing, misshapen or of a bad dtype."""


# The tensor libraries load_weights reads into: "paddle" (CPU tensors) or "torch".
FRAMEWORKS = ("paddle", "torch")


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    # HF-named tensors already in config.dtype: Paddle tensors on the CPU (the runner moves
    # them) or, framework "torch", PyTorch tensors on the device load_model was given.
    weights: dict[str, Any]
    tokenizer: Tokenizer
    path: Path


def load_model(
    model: str,
    dtype: str = "float32",
    seed: int = 0,
    cache_dir: str | None = None,
    select_for: Callable[[ModelConfig], Select] | None = None,
    framework: str = "paddle",
    device: str = "cpu",
) -> LoadedModel:
    """Load `model`: a tiny preset name ("tiny", "tiny-large"), a packaged model name
    ("demo") or a checkpoint folder.

    A tiny preset is first materialized (once, atomically) under `cache_dir`
    (default ~/.cache/pdrouter) as `<name>-<seed>`, then loaded from there like any checkpoint.
    A packaged model is loaded from its folder inside the package (seed and cache_dir unused).
    select_for(config): read only part of some tensors (each checked whole against the config
    first): a tensor-parallel rank's slices. framework: "paddle" or "torch" (FRAMEWORKS);
    device: where torch tensors load ("cpu", "cuda:0"; Paddle tensors always load on the CPU).
    """
    folder, model_id = model_folder(model, seed, cache_dir)
    config = ModelConfig.from_dir(folder, model_id=model_id, dtype=dtype)
    select = select_for(config) if select_for is not None else None
    weights = load_weights(folder, config, select, framework, device)
    tokenizer = Tokenizer.from_dir(folder, eos_token_ids=config.eos_token_ids)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=folder)


def model_folder(model: str, seed: int = 0, cache_dir: str | None = None) -> tuple[Path, str]:
    """(the checkpoint folder of `model`, its model id): load_model's first step."""
    if is_tiny_name(model):
        folder = materialize_tiny(model, seed, cache_dir)
        model_id = f"{model}-{seed}"
    elif is_packaged_name(model):
        folder = packaged_model_dir(model)
        model_id = model
    else:
        folder = Path(model).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"model {model!r} is neither a tiny preset nor a checkpoint folder; built-in "
                f"names: {', '.join([*PRESETS, *PACKAGED_MODELS])}"
            )
        model_id = folder.resolve().name
    return folder, model_id


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the decoder reads."""
    c = config
    h, inter = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, c.q_size)
        if c.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, or the single file)."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: no 'weight_map' object")
        return {name: folder / file_name for name, file_name in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="numpy") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def load_weights(
    folder: str | Path,
    config: ModelConfig,
    select: Select | None = None,
    framework: str = "paddle",
    device: str = "cpu",
) -> dict[str, Any]:
    """Check then load every tensor `config` needs, cast to config.dtype (Paddle on the CPU,
    or torch on `device`); select(name) slices a tensor as it is read (only those bytes leave
    the file)."""
    from safetensors import safe_open

    lib = _tensor_library(framework)

    name_to_file = weight_files(folder)
    shapes = expected_shapes(config)
    if config.tie_word_embeddings and "lm_head.weight" not in name_to_file:
        del shapes["lm_head.weight"]  # the decoder reads the embedding instead
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        if name not in name_to_file:
            where = Path(folder) / (
                INDEX_FILE if (Path(folder) / INDEX_FILE).is_file() else SINGLE_FILE
            )
            raise CheckpointError(f"tensor {name!r} missing from {where}")
        by_file.setdefault(name_to_file[name], []).append(name)

    weights: dict[str, Any] = {}
    conversions: Counter[str] = Counter()  # file dtype -> tensors converted from it
    for path, names in by_file.items():
        if not path.is_file():
            raise CheckpointError(f"{path} (holding {names[0]!r} per the index) not found")
        opened = (
            safe_open(str(path), framework="paddle", device="cpu")
            if framework == "paddle"
            else safe_open(str(path), framework="pt", device=device)
        )
        with opened as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"tensor {name!r} missing from {path}")
                meta = f.get_slice(name)
                shape, st_dtype = tuple(meta.get_shape()), meta.get_dtype()
                if shape != shapes[name]:
                    raise CheckpointError(
                        f"tensor {name!r} in {path} has shape {list(shape)}, "
                        f"config.json implies {list(shapes[name])}"
                    )
                if st_dtype not in FLOAT_DTYPES:
                    raise CheckpointError(
                        f"tensor {name!r} in {path} has dtype {st_dtype}; "
                        f"expected one of {FLOAT_DTYPES}"
                    )
            for name in names:
                part = select(name) if select is not None else None
                tensor = f.get_tensor(name) if part is None else f.get_slice(name)[part]
                if tensor.dtype != getattr(lib, config.dtype):
                    conversions[f.get_slice(name).get_dtype()] += 1
                weights[name] = convert_to_model_dtype(lib, tensor, config.dtype)
    for file_dtype, count in sorted(conversions.items()):
        log.info(
            "%s: %d tensors stored as %s converted to the model dtype %s (--dtype)",
            folder,
            count,
            file_dtype,
            config.dtype,
        )
    return weights


def convert_to_model_dtype(lib: Any, tensor: Any, dtype: str) -> Any:
    """`tensor` (read from a checkpoint file) as a new tensor of the model dtype `dtype`;
    lib: the paddle or torch module the tensor belongs to.

    Always a copy: the tensor views the file's memory map, and later writes to the file (or
    its replacement) must never change a loaded model. F16/BF16 -> float32 is exact (the
    float32 value equals the half value bit for bit once widened); narrowing rounds to nearest.
    """
    if tensor.dtype == getattr(lib, dtype):
        return tensor.clone()
    if lib.__name__ == "torch":
        return tensor.to(getattr(lib, dtype))
    return tensor.astype(dtype)


def _tensor_library(framework: str) -> Any:
    """The module tensors load as; imported here only (a torch process never imports Paddle,
    a Paddle one never torch)."""
    if framework == "paddle":
        from workers.engine.paddle_runtime import paddle

        return paddle
    if framework == "torch":
        from workers.engine.torch_runtime import torch

        return torch
    raise ValueError(f"framework {framework!r} unknown; use one of {FRAMEWORKS}")
