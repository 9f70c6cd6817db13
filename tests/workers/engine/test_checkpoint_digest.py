"""The checkpoint digest in the model fingerprint: two fine-tunes of one architecture (same
config, same header, other weights) never share blocks; a copy of one checkpoint does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from workers.engine.checkpoint_digest import checkpoint_digest
from workers.engine.config import ModelConfig

CONFIG = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
}  # fmt: skip


def checkpoint(folder: Path, weight: np.ndarray, config: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    save_file({"w": weight}, str(folder / "model.safetensors"))
    return folder


def test_other_weights_same_layout_give_another_fingerprint(tmp_path: Path) -> None:
    base = np.arange(8192, dtype=np.float32)
    tuned = base.copy()
    tuned[4000] += 1e-3  # one weight, in the middle 4 KiB sample (bytes 14336..18432)
    a = checkpoint(tmp_path / "a" / "model", base)
    b = checkpoint(tmp_path / "b" / "model", tuned)  # same folder name, same header
    assert checkpoint_digest(a) != checkpoint_digest(b)
    fa = ModelConfig.from_dir(a, model_id="model").fingerprint(16)
    fb = ModelConfig.from_dir(b, model_id="model").fingerprint(16)
    assert fa != fb


def test_a_copy_has_the_same_digest_and_config_changes_it(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "a", np.ones(64, dtype=np.float32))
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    assert checkpoint_digest(a) == checkpoint_digest(copy)
    other = checkpoint(tmp_path / "c", np.ones(64, dtype=np.float32), {**CONFIG, "rope_theta": 1e6})
    assert checkpoint_digest(other) != checkpoint_digest(a)
    assert len(checkpoint_digest(a)) == 16
