"""ModelConfig parsing, checkpoint loading (single file, sharded), and loader errors."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from workers.engine.config import ModelConfig, RopeScaling
from workers.engine.loader import CheckpointError, expected_shapes, load_model
from workers.engine.tiny import TinySpec, write_checkpoint
from workers.pool.keys import model_fingerprint

LLAMA31_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}
QWEN2_CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "eos_token_id": 151645,
}
MISTRAL_CONFIG = {
    "model_type": "mistral",
    "vocab_size": 131072,
    "hidden_size": 5120,
    "head_dim": 128,
    "intermediate_size": 14336,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 1024000,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": 4096,
    "eos_token_id": 2,
}


def test_llama31_config():
    c = ModelConfig.from_hf_dict(LLAMA31_CONFIG, model_id="llama31")
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (32, 32, 8, 128)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (128256, 4096, 14336)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert (c.qkv_bias, c.o_bias, c.tie_word_embeddings) == (False, False, False)
    assert c.dtype == "float32"  # the engine's dtype, not the checkpoint's torch_dtype


def test_qwen2_config_has_qkv_bias_and_tied_embeddings():
    c = ModelConfig.from_hf_dict(QWEN2_CONFIG, model_id="qwen2", dtype="bfloat16")
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (14, 2, 64)
    assert (c.qkv_bias, c.o_bias, c.tie_word_embeddings) == (True, False, True)
    assert c.eos_token_ids == (151645,)
    assert c.sliding_window is None  # use_sliding_window is false
    assert c.rope_scaling is None
    assert c.dtype == "bfloat16"


def test_mistral_config_explicit_head_dim():
    c = ModelConfig.from_hf_dict(MISTRAL_CONFIG, model_id="mistral")
    assert c.head_dim == 128 and c.q_size == 4096 and c.hidden_size == 5120
    assert c.kv_size == 1024
    assert c.sliding_window == 4096
    assert c.rms_norm_eps == 1e-05


def test_linear_rope_scaling_old_spelling():
    c = ModelConfig.from_hf_dict(
        dict(LLAMA31_CONFIG, rope_scaling={"type": "linear", "factor": 4.0}), model_id="m"
    )
    assert c.rope_scaling == RopeScaling("linear", 4.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
        ({"model_type": "gpt2"}, "model_type 'gpt2' not supported"),
        ({"num_key_value_heads": 5}, "num_heads=32 is not a multiple of num_kv_heads=5"),
        ({"hidden_size": None}, "hidden_size"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=true"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' not supported"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ],
)
def test_config_errors(change, message):
    hf = {k: v for k, v in {**LLAMA31_CONFIG, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(hf, model_id="m")


def test_bad_dtype_rejected():
    with pytest.raises(ValueError, match="dtype 'int8' not supported"):
        ModelConfig.from_hf_dict(LLAMA31_CONFIG, model_id="m", dtype="int8")


def test_fingerprint_uses_key_scheme():
    c = ModelConfig.from_hf_dict(QWEN2_CONFIG, model_id="qwen2")
    assert c.fingerprint(block_size=64) == model_fingerprint("qwen2", "float32", 24, 2, 64, 64)
    assert c.fingerprint(64) != c.fingerprint(32)


def test_generation_config_adds_eos_ids(tmp_path):
    write_checkpoint(tmp_path, TinySpec(), seed=0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [261, 42]}))
    c = ModelConfig.from_dir(tmp_path, model_id="x")
    assert c.eos_token_ids == (257, 261, 42)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    write_checkpoint(folder, TinySpec(), seed=3)
    return folder


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_same_weights(checkpoint, tmp_path):
    sharded = tmp_path / "sharded"
    write_checkpoint(sharded, TinySpec(), seed=3, num_shards=3)
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    }
    one = load_model(str(checkpoint))
    three = load_model(str(sharded))
    assert set(one.weights) == set(three.weights) == set(expected_shapes(one.config))
    for name, tensor in one.weights.items():
        assert np.array_equal(tensor.numpy(), three.weights[name].numpy()), name


def test_missing_tensor_names_tensor_and_file(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "ck")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_model(str(folder))
    assert "'model.layers.1.mlp.up_proj.weight' missing" in str(err.value)
    assert str(folder / "model.safetensors") in str(err.value)


def test_wrong_shape_names_tensor_file_and_shapes(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "ck")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_model(str(folder))
    assert str(err.value) == (
        f"tensor 'model.layers.0.self_attn.k_proj.weight' in {folder / 'model.safetensors'} "
        "has shape [16, 64], config.json implies [32, 64]"
    )


def test_unexpected_dtype_rejected(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "ck")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = np.ones(64, np.int8)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' in .* has dtype I8"):
        load_model(str(folder))


def test_missing_shard_named(tmp_path):
    folder = tmp_path / "sharded"
    write_checkpoint(folder, TinySpec(), seed=1, num_shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors .* not found"):
        load_model(str(folder))


def test_tensor_missing_from_index(tmp_path):
    folder = tmp_path / "sharded"
    write_checkpoint(folder, TinySpec(), seed=1, num_shards=2)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_model(str(folder))
    assert str(err.value) == f"tensor 'model.norm.weight' missing from {index_path}"


def test_untied_model_needs_lm_head(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path / "ck")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape("'lm_head.weight' missing")):
        load_model(str(folder))


def test_qwen2_bias_tensors_required(tmp_path):
    folder = tmp_path / "qwen"
    write_checkpoint(folder, TinySpec(model_type="qwen2"), seed=2)
    loaded = load_model(str(folder))
    assert loaded.config.qkv_bias and not loaded.config.o_bias
    assert tuple(loaded.weights["model.layers.1.self_attn.k_proj.bias"].shape) == (32,)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_proj.bias"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=re.escape("'model.layers.1.self_attn.v_proj.bias' missing")
    ):
        load_model(str(folder))


def test_no_weights_file(tmp_path):
    write_checkpoint(tmp_path, TinySpec(), seed=0)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape("neither model.safetensors nor")):
        load_model(str(tmp_path))


def test_not_a_model():
    with pytest.raises(FileNotFoundError, match="neither a tiny preset nor a checkpoint folder"):
        load_model("/nonexistent/model")


def test_dtype_cast_on_load(checkpoint):
    loaded = load_model(str(checkpoint), dtype="float16")
    assert loaded.config.dtype == "float16"
    assert {str(t.dtype) for t in loaded.weights.values()} == {"paddle.float16"}
    ref = load_file(str(checkpoint / "model.safetensors"))["model.norm.weight"]
    np.testing.assert_array_equal(
        loaded.weights["model.norm.weight"].numpy(), ref.astype(np.float16)
    )


def test_bfloat16_checkpoint_loads_as_float32(checkpoint, tmp_path):
    import paddle
    from safetensors.paddle import save_file as save_paddle

    folder = _copy(checkpoint, tmp_path / "bf16")
    tensors = load_file(str(folder / "model.safetensors"))
    save_paddle(
        {k: paddle.to_tensor(v).astype("bfloat16") for k, v in tensors.items()},
        str(folder / "model.safetensors"),
    )
    loaded = load_model(str(folder))
    got = loaded.weights["model.embed_tokens.weight"].numpy()
    assert got.dtype == np.float32
    # bf16 keeps 8 mantissa bits: relative error below 2^-8
    np.testing.assert_allclose(got, tensors["model.embed_tokens.weight"], rtol=2**-8, atol=0)
    assert not np.array_equal(got, tensors["model.embed_tokens.weight"])
