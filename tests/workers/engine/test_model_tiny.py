"""The built-in tiny model: deterministic bytes across processes, race-free materialization,
loading through the ordinary loader, and greedy output that is text, not one repeated token."""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
import pytest

from pdrouter.common.proc import ManagedProcess
from tests.wait import wait_until
from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.loader import load_model
from workers.engine.runner import ModelRunner
from workers.engine.tiny import MARKER_FILE, materialize_tiny

TINY_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_FILE,
}
# Each child waits for a start file, so that all of them materialize at the same moment.
MATERIALIZE = """
import os, sys, time
from workers.engine.tiny import materialize_tiny
root, seed, go, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
open(ready, "w").close()  # imports done: at the start line
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.005)
print(materialize_tiny("tiny", seed, root))
"""


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def _run_materializers(tmp_path, jobs):
    """Start one process per (cache_root, seed) at once; return their printed folders."""
    procs = []
    go = tmp_path / "go"
    try:
        for i, (root, seed) in enumerate(jobs):
            log = tmp_path / f"proc{i}.log"
            ready = tmp_path / f"ready{i}"
            argv = [sys.executable, "-c", MATERIALIZE, str(root), str(seed), str(go), str(ready)]
            procs.append(ManagedProcess(f"materialize{i}", argv, log_path=log))
        # Every child at the start line before any starts: they really run at the same time.
        wait_until(
            lambda: all((tmp_path / f"ready{i}").exists() for i in range(len(jobs))),
            60, "every materializer at the start line",
        )  # fmt: skip
        go.touch()
        for proc in procs:
            assert proc.popen.wait(timeout=60) == 0, proc.log_tail()
        return [proc.log_tail().strip().splitlines()[-1] for proc in procs]
    finally:
        for proc in procs:
            proc.stop()


def test_same_seed_same_bytes_in_two_processes(tmp_path):
    roots = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    folders = _run_materializers(tmp_path, [(roots[0], 0), (roots[1], 0), (roots[2], 1)])
    assert folders == [str(roots[0] / "tiny-0"), str(roots[1] / "tiny-0"), str(roots[2] / "tiny-1")]
    a, b, c = (_digests(r / f"tiny-{s}") for r, s in zip(roots, (0, 0, 1), strict=True))
    assert set(a) == TINY_FILES
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]


def test_concurrent_materialization_is_atomic(tmp_path):
    root = tmp_path / "shared"
    folders = _run_materializers(tmp_path, [(root, 7)] * 3)
    assert folders == [str(root / "tiny-7")] * 3
    # One complete folder, no temporary leftovers.
    assert sorted(p.name for p in root.iterdir()) == ["tiny-7"]
    assert set(_digests(root / "tiny-7")) == TINY_FILES


def test_stale_copy_is_rebuilt(tmp_path):
    folder = materialize_tiny("tiny", 0, tmp_path)
    good = _digests(folder)
    marker = json.loads((folder / MARKER_FILE).read_text())
    marker["generator_sha256"] = "0" * 64
    (folder / MARKER_FILE).write_text(json.dumps(marker))
    (folder / "model.safetensors").write_bytes(b"truncated")
    assert materialize_tiny("tiny", 0, tmp_path) == folder
    assert _digests(folder) == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-0"]


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown tiny preset 'huge'"):
        materialize_tiny("huge", 0, "/nonexistent")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    return root, load_model("tiny", seed=0, cache_dir=str(root))


def test_load_tiny_through_loader(tiny):
    root, loaded = tiny
    c = loaded.config
    assert loaded.path == root / "tiny-0"
    assert c.model_id == "tiny-0"
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (264, 64, 128)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert c.eos_token_ids == (257, 261)
    assert loaded.tokenizer.eos_token_ids == (257, 261)
    assert c.max_position_embeddings == 2048
    assert not c.tie_word_embeddings
    assert len(loaded.weights) == 1 + 2 * 9 + 1 + 1
    text = "héllo 🎉"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text


def test_tiny_large_preset_config(tmp_path):
    loaded = load_model("tiny-large", seed=0, cache_dir=str(tmp_path))
    c = loaded.config
    assert c.model_id == "tiny-large-0"
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (512, 4, 8, 4)
    assert c.fingerprint(16) != load_model("tiny", cache_dir=str(tmp_path)).config.fingerprint(16)


def _greedy(runner, tokenizer, prompt, num_tokens, blocks):
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    out = runner.run(ScheduledBatch((ScheduledChunk("r", tuple(ids), 0, blocks, True),)))
    generated = []
    for _ in range(num_tokens):
        token = int(np.argmax(out.logits[0]))
        generated.append(token)
        pos = len(ids) + len(generated) - 1
        out = runner.run(ScheduledBatch((ScheduledChunk("r", (token,), pos, blocks, True),)))
    return generated


def test_greedy_output_varies(tiny):
    _, loaded = tiny
    runner = ModelRunner(loaded, num_blocks=64, block_size=16)
    outputs = [
        _greedy(runner, loaded.tokenizer, prompt, 48, tuple(range(8 * i, 8 * i + 8)))
        for i, prompt in enumerate(["Hello there", "1234", "Write a poem about the sea"])
    ]
    for generated in outputs:
        assert len(set(generated)) >= 12, generated
        # readable: printable ASCII, newline, or <|end|> (261)
        assert all(32 <= t < 127 or t in (10, 261) for t in generated), generated
        # no token repeated more than 4 times in a row
        runs = [len(set(generated[i : i + 5])) for i in range(len(generated) - 4)]
        assert min(runs) > 1, generated
    assert outputs[0] != outputs[1] != outputs[2] != outputs[0]
