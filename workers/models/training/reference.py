"""Record transformers' view of the demo model, for the engine's CPU tests to match.

    python -m workers.models.training.reference --model workers/models/demo \\
        --corpus /tmp/demo-corpus.jsonl.gz --out tests/workers/models/demo_reference.json

Loads the folder with LlamaForCausalLM in float32 (no TF32) and AutoTokenizer, and writes:

    heldout   texts the model never trained on (one written here, the first documents of the
              corpus's validation split): token ids and the log-probability of each token
              given the ones before it (float64 log-softmax of float32 logits)
    greedy    chat prompts rendered by transformers' own chat template: prompt token ids and
              generate(do_sample=False)'s continuation, with the smallest gap between the two
              best logits along it (how far the greedy choice was from a tie)

On a GPU it also scores the held-out texts on the CPU and reports the largest difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from workers.models.training.chat_format import BOS_TOKEN
from workers.models.training.corpus import read_corpus

# Written for this check (not from the Python docs): plain English about Python.
HANDWRITTEN = (
    "To count the words in a text file, open the file, read it line by line, split each "
    "line on whitespace and add the length of the resulting list to a running total. "
    "Return the total when the file has been read to the end."
)
PROMPTS: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": "What does the json module do?"}],
    [{"role": "user", "content": "What is the json module for?"}],
    [{"role": "user", "content": "What does the os module do?"}],
    [{"role": "user", "content": "What does sorted do?"}],
    [{"role": "user", "content": "What does math.sqrt do?"}],
    [{"role": "user", "content": "What does len do?"}],
    [{"role": "user", "content": "Who are you?"}],
    [{"role": "user", "content": 'Tell me about the "while" statement.'}],
    [{"role": "user", "content": "What does the copy module do?"}],  # a validation module
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the itertools module for?"},
    ],
    [{"role": "user", "content": "Tell me about prefill and decode."}],
)
MAX_NEW_TOKENS = 48
HELDOUT_MAX_TOKENS = 256


def heldout_texts(corpus: Path) -> list[tuple[str, str]]:
    rows = read_corpus(corpus)
    first_val = {
        kind: next(r for r in rows if r["split"] == "val" and r["kind"] == kind)
        for kind in ("text", "chat")
    }
    return [
        ("handwritten", BOS_TOKEN + HANDWRITTEN),
        (f"val text: {first_val['text']['source']}", first_val["text"]["text"]),
        (f"val chat: {first_val['chat']['source']}", first_val["chat"]["text"]),
    ]


def token_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)[:-1]
    return logp.gather(1, torch.tensor(ids[1:], device=logp.device)[:, None])[:, 0].tolist()


def greedy(model: Any, tok: Any, messages: list[dict[str, str]]) -> dict[str, Any]:
    import torch

    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids], device=model.device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new_ids = out.sequences[0, len(ids) :].tolist()
    margins = [float(torch.topk(step[0].float(), 2).values.diff().abs()) for step in out.logits]
    return {
        "messages": messages,
        "prompt": prompt,
        "prompt_token_ids": ids,
        "output_token_ids": new_ids,
        "output_text": tok.decode(new_ids, skip_special_tokens=True),
        "min_top2_margin": min(margins),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--corpus", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        import torch
        import transformers
        from transformers import AutoTokenizer, LlamaForCausalLM
    except ImportError as exc:
        raise SystemExit(f"the reference needs torch and transformers ({exc})") from exc

    torch.set_float32_matmul_precision("highest")  # no TF32: true float32 matmuls
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(str(args.model))

    def load(on: str) -> Any:
        model = LlamaForCausalLM.from_pretrained(
            str(args.model), dtype=torch.float32, attn_implementation="eager"
        )
        return model.to(on).eval()

    model = load(device)
    heldout = []
    for name, text in heldout_texts(args.corpus):
        ids = tok(text, add_special_tokens=False)["input_ids"][:HELDOUT_MAX_TOKENS]
        # text is whole; token_ids its first HELDOUT_MAX_TOKENS tokens.
        heldout.append(
            {"name": name, "text": text, "token_ids": ids, "logprobs": token_logprobs(model, ids)}
        )
    result: dict[str, Any] = {
        "model_sha256": hashlib.sha256((args.model / "model.safetensors").read_bytes()).hexdigest(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "heldout": heldout,
        "max_new_tokens": MAX_NEW_TOKENS,
        "greedy": [greedy(model, tok, m) for m in PROMPTS],
    }
    if device == "cuda":
        cpu_model = load("cpu")
        result["max_abs_logprob_diff_cuda_vs_cpu"] = max(
            abs(a - b)
            for h in heldout
            for a, b in zip(h["logprobs"], token_logprobs(cpu_model, h["token_ids"]), strict=True)
        )
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    for g in result["greedy"]:
        print(
            f"{g['messages'][-1]['content']!r} -> {g['output_text']!r} "
            f"(margin {g['min_top2_margin']:.3g})"
        )
    for h in heldout:
        mean = -sum(h["logprobs"]) / len(h["logprobs"])
        print(f"{h['name']}: {len(h['token_ids'])} tokens, mean loss {mean:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
