"""Cross-check the Paddle decoder and tokenizer against Hugging Face transformers.

Not a pytest module: transformers and torch are not dependencies of this project, so the check
runs in two halves, possibly on two machines:

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python tests/workers/engine/hf_crosscheck.py prep DIR
        writes one checkpoint per model variant into DIR, with the paged decoder's logits
        (prefill of 12 tokens, then 28 decode steps) and our tokenizer's outputs
    python3 tests/workers/engine/hf_crosscheck.py check DIR       (where torch + transformers exist)
        loads each checkpoint with AutoModelForCausalLM / AutoTokenizer and compares

Last run (transformers 5.17.0, torch 2.11.0, float32 on CPU): all 7 variants, a Mistral sliding
window included, within 2e-5 of transformers' logits (logits up to ~64), the same argmax at
every position, and identical chat templates and token ids.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

MESSAGES = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "héllo 🎉"}]
TEXT = "héllo 🎉 <|user|>"
PREFILL_LEN, TOTAL_LEN = 12, 40


def prep(out: Path) -> None:
    import numpy as np

    from tests.workers.engine.test_paged_attention import SPECS
    from workers.engine.batch import ScheduledBatch, ScheduledChunk
    from workers.engine.loader import load_model
    from workers.engine.runner import ModelRunner
    from workers.engine.tiny import PRESETS, write_checkpoint

    specs = {**SPECS, "tiny": PRESETS["tiny"], "tiny_large": PRESETS["tiny-large"]}
    manifest = {}
    for i, (name, spec) in enumerate(specs.items()):
        folder = out / name
        shutil.rmtree(folder, ignore_errors=True)
        write_checkpoint(folder, spec, seed=100 + i)
        loaded = load_model(str(folder))
        tokens = np.random.default_rng(i).integers(0, loaded.config.vocab_size, TOTAL_LEN).tolist()
        runner = ModelRunner(loaded, num_blocks=16, block_size=8)
        blocks = tuple(range(16))
        first = ScheduledChunk("a", tuple(tokens[:PREFILL_LEN]), 0, blocks, True)
        logits = [runner.run(ScheduledBatch((first,))).logits[0]]
        for pos in range(PREFILL_LEN, TOTAL_LEN):
            step = ScheduledChunk("a", (tokens[pos],), pos, blocks, True)
            logits.append(runner.run(ScheduledBatch((step,))).logits[0])
        np.save(folder / "pd_logits.npy", np.stack(logits))  # positions 11 .. 39
        tok = loaded.tokenizer
        manifest[name] = {
            "tokens": tokens,
            "chat": tok.apply_chat_template(MESSAGES),
            "enc": tok.encode(TEXT),
            "enc_special": tok.encode("ab", add_special_tokens=True),
        }
    (out / "manifest.json").write_text(json.dumps(manifest))


def check(root: Path) -> int:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    failures = 0
    manifest = json.loads((root / "manifest.json").read_text())
    for name, m in manifest.items():
        folder = root / name
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        with torch.no_grad():
            hf = model(torch.tensor([m["tokens"]])).logits[0].double().numpy()[PREFILL_LEN - 1 :]
        ours = np.load(folder / "pd_logits.npy")
        diff = float(np.abs(hf - ours).max())
        same_argmax = bool((hf.argmax(-1) == ours.argmax(-1)).all())
        tok = AutoTokenizer.from_pretrained(str(folder))
        chat = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        tok_ok = (
            chat == m["chat"]
            and tok.encode(TEXT, add_special_tokens=False) == m["enc"]
            and tok.encode("ab", add_special_tokens=True) == m["enc_special"]
        )
        ok = diff < 1e-4 and same_argmax and tok_ok
        failures += not ok
        print(f"{name}: max|hf - ours| {diff:.3g}, argmax equal {same_argmax}, tokenizer {tok_ok}")
    return 1 if failures else 0


if __name__ == "__main__":
    mode, folder = sys.argv[1], Path(sys.argv[2])
    folder.mkdir(parents=True, exist_ok=True)
    if mode == "prep":
        prep(folder)
    else:
        sys.exit(check(folder))
