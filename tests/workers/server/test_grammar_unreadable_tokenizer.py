"""A model whose tokenizer llguidance cannot read (a word-level tokenizer with no decoder)
still serves free text: the worker starts, says why structured output is off, and answers a
constrained request with a 400 naming the reason (it failed to start, before)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.workers.server.conftest import start_worker
from workers.engine.tiny import PRESETS, write_checkpoint

pytestmark = pytest.mark.slow


def _word_level_checkpoint(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    write_checkpoint(folder, PRESETS["tiny"], seed=0)
    vocab_size = PRESETS["tiny"].vocab_size
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # and no decoder: llguidance refuses
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))


def test_free_text_is_served_and_a_schema_gets_a_400_naming_why(tmp_path: Path) -> None:
    model = tmp_path / "word-level"
    _word_level_checkpoint(model)
    handle = start_worker(
        tmp_path, tmp_path / "cache", "--model", str(model), "--served-model-name", "word-level"
    )
    try:
        url = f"{handle.base_url}/v1/completions"
        free = httpx.post(
            url,
            json={"model": "word-level", "prompt": "w5 w6 w7", "max_tokens": 3, "temperature": 0},
            timeout=60,
        )
        assert free.status_code == 200, free.text
        assert free.json()["usage"]["completion_tokens"] == 3
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        constrained = httpx.post(
            f"{handle.base_url}/v1/chat/completions",
            json={
                "model": "word-level",
                "messages": [{"role": "user", "content": "w5"}],
                "max_tokens": 8,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": schema},
                },
            },
            timeout=60,
        )
        assert constrained.status_code == 400, constrained.text
        message = constrained.json()["error"]["message"]
        assert "structured output is unavailable with this model's tokenizer" in message
        assert httpx.get(f"{handle.base_url}/health", timeout=10).status_code == 200
    finally:
        assert handle.proc is not None
        handle.proc.stop()
    log = (tmp_path / "pdworker-mixed.log").read_text()
    assert "constrained requests will be refused" in log
