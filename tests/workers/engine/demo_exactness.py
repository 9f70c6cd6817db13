"""The exactness check of the torch backend: 20 demo-model prompts, greedy, whose Paddle (CPU,
float32) answers are recorded in demo_paddle_reference.json, so that the GPU machine (which has
no Paddle) compares its torch runner against them.

    python -m tests.workers.engine.demo_exactness    # re-record with the Paddle engine (CPU)
"""

from __future__ import annotations

import json
from pathlib import Path

from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig

REFERENCE_PATH = Path(__file__).with_name("demo_paddle_reference.json")
MAX_TOKENS = 24
QUESTIONS = (
    "What does the json module do?", "What does the os module do?", "What does sorted do?",
    "What does math.sqrt do?", "What does len do?", "Who are you?",
    'Tell me about the "while" statement.', "What does the copy module do?",
    "What is the itertools module for?", "Tell me about prefill and decode.",
    "What does the re module do?", "What is a list comprehension?", "What does zip do?",
    "What does the pathlib module do?", "How do I read a file?", "What is a dict?",
    "What does the random module do?", "What does print do?", "What is a tuple?",
    "What does the time module do?",
)  # fmt: skip


def engine_config(backend: str, device: str = "cpu", dtype: str = "float32") -> EngineConfig:
    return EngineConfig(
        model="demo", engine_backend=backend, device=device, dtype=dtype, block_size=16,
        num_kv_blocks=256, max_num_batched_tokens=512, max_num_seqs=32,
    )  # fmt: skip


def greedy_answers(engine: LLMEngine) -> list[dict]:
    """Per question: the prompt's token ids, the greedy output ids and each one's logprob."""
    tokenizer = engine.tokenizer
    requests = []
    for i, question in enumerate(QUESTIONS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        ids = tuple(tokenizer.encode(text))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                num_logprobs=0)  # fmt: skip
        requests.append(EngineRequest(f"q{i}", ids, params))
    outputs = engine.generate(requests)
    return [
        {
            "question": question,
            "prompt_token_ids": list(request.prompt_token_ids),
            "output_token_ids": [t for o in outputs[request.request_id] for t in o.new_token_ids],
            "logprobs": [lp.logprob for o in outputs[request.request_id] for lp in o.new_logprobs],
        }
        for question, request in zip(QUESTIONS, requests, strict=True)
    ]


def load_reference() -> list[dict]:
    with open(REFERENCE_PATH, encoding="utf-8") as f:
        return json.load(f)["answers"]


def main() -> None:
    answers = greedy_answers(LLMEngine.from_config(engine_config("paddle")))
    # One answer a line: a re-recording's diff shows which answers changed.
    lines = ",\n".join(json.dumps(a) for a in answers)
    text = f'{{"recorded_with": "Paddle ModelRunner, CPU, float32", "answers": [\n{lines}\n]}}\n'
    REFERENCE_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {REFERENCE_PATH} ({len(answers)} answers)")


if __name__ == "__main__":
    main()
