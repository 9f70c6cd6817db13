"""The torch backend's exactness on the demo model against the Paddle engine's recorded answers
(demo_exactness.py): in float32, 20 greedy answers token for token with every logprob within
1e-3; in bfloat16, the teacher-forced next-token agreement with them is at least 95% (the
figure is printed: run with -s). On the CPU wherever torch is installed, and on a GPU (marker
gpu: skipped where torch sees none), which has no Paddle: hence the recording."""

from __future__ import annotations

import numpy as np
import pytest

from tests.workers.engine.demo_exactness import (
    MAX_TOKENS,
    engine_config,
    greedy_answers,
    load_reference,
)
from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.engine import LLMEngine
from workers.engine.runner_factory import build_runner

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]


def _need(device: str) -> None:
    if device == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU visible to torch")


@pytest.mark.parametrize("device", DEVICES)
def test_float32_equals_the_paddle_engine_token_for_token(device):
    _need(device)
    engine = LLMEngine.from_config(engine_config("torch", device))
    assert engine.runner.backend == "torch"
    got, want = greedy_answers(engine), load_reference()
    assert len(got) == len(want) == 20
    for mine, theirs in zip(got, want, strict=True):
        assert mine["prompt_token_ids"] == theirs["prompt_token_ids"]
        assert mine["output_token_ids"] == theirs["output_token_ids"], mine["question"]
        assert len(mine["logprobs"]) == MAX_TOKENS
        np.testing.assert_allclose(mine["logprobs"], theirs["logprobs"], atol=1e-3, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_agrees_on_at_least_95_percent_of_next_tokens(device, record_property):
    _need(device)
    runner, _ = build_runner(engine_config("torch", device, "bfloat16"))
    agree = total = 0
    for answer in load_reference():
        # The recorded sequence fed whole: the row before each output token predicts it.
        prompt, output = answer["prompt_token_ids"], answer["output_token_ids"]
        tokens = tuple(prompt + output[:-1])
        blocks = tuple(range(-(-len(tokens) // runner.block_size)))
        chunk = ScheduledChunk("r", tokens, 0, blocks, True, prompt_logprobs=True)
        rows = runner.run(ScheduledBatch((chunk,))).prompt_logits[0][len(prompt) - 1 :]
        predicted = np.argmax(rows, axis=-1).tolist()
        agree += sum(int(p == t) for p, t in zip(predicted, output, strict=True))
        total += len(output)
    share = agree / total
    record_property("bf16_next_token_agreement", share)
    print(f"bf16 on {device}: {agree}/{total} next tokens agree ({share:.1%})")
    assert total == 20 * MAX_TOKENS
    assert share >= 0.95
