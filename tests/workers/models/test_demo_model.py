"""The packaged demo model against transformers: log-likelihoods and greedy continuations.

demo_reference.json was recorded by `python -m workers.models.training.reference` (transformers'
LlamaForCausalLM in float32 on the GPU machine, from this very model.safetensors: its sha256 is
checked). Our engine must give every held-out token the same log-probability within 1e-4 and
continue each chat prompt greedily with the same tokens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig
from workers.engine.loader import load_model
from workers.engine.runner import ModelRunner
from workers.models.packaged import packaged_model_dir

REFERENCE = json.loads((Path(__file__).parent / "demo_reference.json").read_text())
LOGPROB_BOUND = 1e-4
# A greedy step whose two best logits were closer than this could flip on float32 noise
# alone; the recorded prompts all stay well clear of it.
MIN_MARGIN = 1e-3
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def loaded():
    return load_model("demo")


def test_reference_was_recorded_from_the_shipped_weights():
    weights = packaged_model_dir("demo") / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == REFERENCE["model_sha256"]


def test_demo_loads_half_precision_file_as_float32(loaded):
    with safe_open(str(loaded.path / "model.safetensors"), framework="numpy") as f:
        file_dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
        embed = f.get_tensor("model.embed_tokens.weight")
    assert file_dtypes == {"F16"}
    assert loaded.config.model_id == "demo" and loaded.config.dtype == "float32"
    assert {str(t.dtype) for t in loaded.weights.values()} == {"paddle.float32"}
    np.testing.assert_array_equal(
        loaded.weights["model.embed_tokens.weight"].numpy(), embed.astype(np.float32)
    )
    assert loaded.config.vocab_size == loaded.tokenizer.vocab_size


@pytest.mark.parametrize("case", REFERENCE["greedy"], ids=lambda c: c["messages"][-1]["content"])
def test_chat_prompt_renders_and_encodes_as_transformers(loaded, case):
    prompt = loaded.tokenizer.apply_chat_template(case["messages"])
    assert prompt == case["prompt"]
    assert loaded.tokenizer.encode(prompt) == case["prompt_token_ids"]


def _token_by_token_logprobs(runner: ModelRunner, token_ids: list[int]) -> np.ndarray:
    """log p(token i | tokens before it), each position fed as its own one-token step: the
    decode path, through the paged cache, at every position."""
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    blocks = tuple(range(num_blocks))
    logprobs = []
    for pos in range(len(token_ids) - 1):
        chunk = ScheduledChunk("heldout", (token_ids[pos],), pos, blocks, True)
        logits = runner.run(ScheduledBatch((chunk,))).logits[0].astype(np.float64)
        log_z = np.log(np.exp(logits - logits.max()).sum()) + logits.max()
        logprobs.append(logits[token_ids[pos + 1]] - log_z)
    return np.array(logprobs)


@pytest.mark.parametrize("case", REFERENCE["heldout"], ids=lambda c: c["name"])
def test_heldout_logprobs_match_transformers(loaded, case):
    ids = case["token_ids"]
    assert loaded.tokenizer.encode(case["text"])[: len(ids)] == ids
    runner = ModelRunner(loaded, num_blocks=-(-len(ids) // BLOCK_SIZE), block_size=BLOCK_SIZE)
    ours = _token_by_token_logprobs(runner, ids)
    diff = np.abs(ours - np.array(case["logprobs"]))
    assert diff.max() < LOGPROB_BOUND, f"max |delta logprob| {diff.max():.3g} at {diff.argmax()}"


def test_greedy_continuations_match_transformers():
    engine = LLMEngine.from_config(
        EngineConfig(model="demo", block_size=BLOCK_SIZE, num_kv_blocks=64)
    )
    cases = REFERENCE["greedy"]
    requests = [
        EngineRequest(
            f"r{i}",
            tuple(case["prompt_token_ids"]),
            SamplingParams(max_tokens=REFERENCE["max_new_tokens"], temperature=0.0),
        )
        for i, case in enumerate(cases)
    ]
    # All prompts in one batch: prefill chunks and decodes of different lengths share steps.
    outputs = engine.generate(requests)
    for i, case in enumerate(cases):
        assert case["min_top2_margin"] > MIN_MARGIN, case["prompt"]
        got = [t for out in outputs[f"r{i}"] for t in out.new_token_ids]
        assert got == case["output_token_ids"], case["prompt"]
        assert "".join(out.new_text for out in outputs[f"r{i}"]) == case["output_text"]
