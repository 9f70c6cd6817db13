"""Train the demo model: a small Llama (transformers' LlamaForCausalLM) on the corpus, in PyTorch.

    python -m workers.models.training.train --corpus /tmp/demo-corpus.jsonl.gz \\
        --tokenizer workers/models/demo --out workers/models/demo --seed 0

Needs torch and transformers (not project dependencies: `pip install torch transformers`).
The tokenizer folder must hold tokenizer.json (tokenizer_training.py writes it); --out gets
config.json, generation_config.json, model.safetensors (float16), train_result.json.

Every document of the split is encoded and the documents are concatenated into one token
stream; a step trains on random windows of seq_len + 1 tokens of it (inputs and shifted
targets). The validation split is scored every eval_every steps. The weights written are the
last step's (--keep last: a model that knows its training text by heart, which is what the
demo asks of it) or those of the best validation score (--keep best). Dropout (residual, on
each attention and MLP output) is added by forward hooks, so the module stays transformers'
own and the checkpoint plain Llama.
Randomness (init, windows, dropout) all comes from --seed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workers.models.training.chat_format import SPECIAL_TOKENS
from workers.models.training.corpus import read_corpus
from workers.models.training.tokenizer_training import MAX_LENGTH

BOS_ID, EOS_ID, END_ID = 0, 1, SPECIAL_TOKENS.index("<|end|>")
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    # architecture
    num_layers: int = 6
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 768
    # optimization
    steps: int = 2000
    batch_size: int = 64
    seq_len: int = MAX_LENGTH
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    dropout: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    time_limit_s: float = 480.0  # stop early past this (a safety net; the log says so)
    keep: str = "last"  # "last" or "best" (validation loss)


def _lazy_torch() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise SystemExit(
            f"training needs PyTorch and transformers ({exc}); install them with: "
            "pip install torch transformers (they are not dependencies of pdrouter)"
        ) from exc
    return torch, transformers


def vocab_size_of(tokenizer_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()


def encode_split(rows: list[dict[str, str]], tokenizer_dir: Path, split: str) -> Any:
    """One int64 tensor: every document of `split` encoded, concatenated in corpus order."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = [r["text"] for r in rows if r["split"] == split]
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    return torch.from_numpy(np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings]))


def llama_config(cfg: TrainConfig, vocab_size: int) -> Any:
    _, transformers = _lazy_torch()
    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=MAX_LENGTH,
        rms_norm_eps=1e-5,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=True,
        hidden_act="silu",
        bos_token_id=BOS_ID,
        eos_token_id=[EOS_ID, END_ID],
        pad_token_id=EOS_ID,
    )


def add_residual_dropout(model: Any, p: float) -> None:
    """Dropout on each attention and MLP output before it joins the residual stream (training
    only: the hooks read module.training)."""
    import torch.nn.functional as F

    def on_attention(module: Any, _inputs: Any, output: Any) -> Any:
        return (F.dropout(output[0], p, module.training), *output[1:])

    def on_mlp(module: Any, _inputs: Any, output: Any) -> Any:
        return F.dropout(output, p, module.training)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(on_attention)
        layer.mlp.register_forward_hook(on_mlp)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at the last step."""
    import math

    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def evaluate(model: Any, tokens: Any, seq_len: int, device: str, autocast: bool) -> float:
    """Mean next-token loss (nats) over `tokens` cut into consecutive windows: every token
    after the first is predicted exactly once."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    num_full = (len(tokens) - 1) // seq_len
    full = tokens[: num_full * seq_len + 1]
    inputs = full[:-1].reshape(num_full, seq_len)
    targets = full[1:].reshape(num_full, seq_len)
    batches = [(inputs[i : i + 32], targets[i : i + 32]) for i in range(0, num_full, 32)]
    if len(tokens) - 1 > num_full * seq_len:  # the tail, shorter than a window
        tail = tokens[num_full * seq_len :]
        batches.append((tail[None, :-1], tail[None, 1:]))
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        for x, y in batches:
            logits = model(input_ids=x.to(device)).logits.float()
            loss = F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="sum")
            total, count = total + float(loss), count + y.numel()
    model.train()
    assert count == len(tokens) - 1
    return total / count


def log(message: str) -> None:
    print(message, flush=True)


def train(cfg: TrainConfig, corpus: Path, tokenizer_dir: Path, out: Path) -> dict[str, Any]:
    """Train, write the weights cfg.keep names to `out`."""
    torch, transformers = _lazy_torch()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else platform.processor()
    rows = read_corpus(corpus)
    train_tokens = encode_split(rows, tokenizer_dir, "train")
    val_tokens = encode_split(rows, tokenizer_dir, "val")
    config = llama_config(cfg, vocab_size_of(tokenizer_dir))
    model = transformers.LlamaForCausalLM(config).to(device)
    add_residual_dropout(model, cfg.dropout)
    num_params = sum(p.numel() for p in model.parameters())
    train_tokens = train_tokens.to(device)
    log(
        f"{device} ({device_name}), torch {torch.__version__}, transformers "
        f"{transformers.__version__}; {num_params} parameters; train {len(train_tokens)} "
        f"tokens, val {len(val_tokens)}"
    )
    run = run_steps(model, cfg, train_tokens, val_tokens, device)
    # The checkpoint is float16: score exactly those weights, in float32, as they are served.
    final = run.best_state if cfg.keep == "best" else model.state_dict()
    model.load_state_dict({k: v.half().float() for k, v in final.items()})
    val_loss = evaluate(model, val_tokens, cfg.seq_len, device, autocast=False)
    # The same measure on as many training tokens, for comparison (no dropout here either).
    train_eval_loss = evaluate(
        model, train_tokens[: len(val_tokens)].cpu(), cfg.seq_len, device, autocast=False
    )
    write_checkpoint(model, config, out)
    result = {
        "config": asdict(cfg),
        "num_params": num_params,
        "train_tokens": len(train_tokens),
        "val_tokens": len(val_tokens),
        "steps_run": run.steps_run,
        "best_val_step": run.best_val_step,
        "best_val_loss": run.best_val_loss,
        "train_s": round(run.train_s, 1),
        "val_loss": val_loss,
        "train_eval_loss": train_eval_loss,
        "history": run.history,
        "device": device_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (out / "train_result.json").write_text(json.dumps(result, indent=2) + "\n")
    log(
        f"kept the {cfg.keep} weights (best validation loss {run.best_val_loss:.4f} at step "
        f"{run.best_val_step}): held-out loss {val_loss:.4f} nats/token, training text "
        f"{train_eval_loss:.4f} (float16 weights, float32 math); {run.train_s:.0f} s"
    )
    return result


@dataclass
class TrainRun:
    """What the step loop leaves: its validation history and the best weights it saw."""

    steps_run: int = 0
    train_s: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)
    best_val_loss: float = float("inf")
    best_val_step: int = 0
    best_state: dict[str, Any] | None = None  # on the CPU, copied at best_val_step


def make_optimizer(model: Any, cfg: TrainConfig) -> Any:
    """AdamW with weight decay on the matrices only (not on norms)."""
    import torch

    return torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        weight_decay=cfg.weight_decay,
    )


def run_steps(
    model: Any, cfg: TrainConfig, train_tokens: Any, val_tokens: Any, device: str
) -> TrainRun:
    """cfg.steps steps (fewer past cfg.time_limit_s), scoring the validation split every
    cfg.eval_every steps and at the last one."""
    import torch

    optimizer = make_optimizer(model, cfg)
    # Window starts are drawn on the CPU (one seeded stream whatever the device); the tokens
    # live on the device, so a batch is one gather there.
    windows = torch.Generator().manual_seed(cfg.seed + 1)
    offsets = torch.arange(cfg.seq_len + 1, device=device)
    run = TrainRun()
    t0 = time.monotonic()
    step = 0
    while step < cfg.steps:
        starts = torch.randint(
            0, len(train_tokens) - cfg.seq_len - 1, (cfg.batch_size,), generator=windows
        ).to(device)
        batch = train_tokens[starts[:, None] + offsets]  # [batch_size, seq_len + 1]
        loss = train_step(model, optimizer, batch, lr_at(step, cfg), cfg.grad_clip)
        step += 1
        out_of_time = time.monotonic() - t0 > cfg.time_limit_s
        if step % cfg.eval_every == 0 or step == cfg.steps or out_of_time:
            val = evaluate(model, val_tokens, cfg.seq_len, device, autocast=device == "cuda")
            elapsed = time.monotonic() - t0
            run.history.append(
                {"step": step, "train_loss": float(loss), "val_loss": val, "s": elapsed}
            )
            log(f"step {step} train {float(loss):.4f} val {val:.4f} {elapsed:.0f} s")
            if val < run.best_val_loss:
                run.best_val_loss, run.best_val_step = val, step
                run.best_state = {
                    k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()
                }
        if out_of_time:
            log(f"time limit {cfg.time_limit_s} s reached after {step} steps")
            break
    run.steps_run, run.train_s = step, time.monotonic() - t0
    return run


def train_step(model: Any, optimizer: Any, batch: Any, lr: float, grad_clip: float) -> Any:
    """One AdamW step on a [batch, seq_len + 1] window batch (bf16 autocast on CUDA); returns
    the loss as a device scalar (reading it would wait for the GPU every step)."""
    import torch
    import torch.nn.functional as F

    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast("cuda", torch.bfloat16, enabled=batch.is_cuda):
        logits = model(input_ids=batch[:, :-1]).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.detach()


def write_checkpoint(model: Any, config: Any, out: Path) -> None:
    """config.json, generation_config.json, model.safetensors (float16; the tied lm_head is
    left out, as transformers does: the embedding serves as both)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to("cpu", torch.float16).contiguous()
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # Written by hand rather than by config.to_dict(): only the keys a Llama reader needs, with
    # rope_theta at the top level where every reader (ours, transformers 4 and 5) finds it.
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.hidden_size // config.num_attention_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": ROPE_THETA,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, END_ID],
        "pad_token_id": EOS_ID,
        "torch_dtype": "float16",
    }
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)
        f.write("\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_ID], "pad_token_id": EOS_ID}
    with open(out / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2, sort_keys=True)
        f.write("\n")


def parse_args(argv: list[str] | None) -> tuple[TrainConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, type=Path)
    parser.add_argument("--tokenizer", required=True, type=Path, help="folder with tokenizer.json")
    parser.add_argument("--out", required=True, type=Path)
    defaults = TrainConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{name: getattr(args, name) for name in asdict(defaults)})
    if cfg.keep not in ("last", "best"):
        parser.error(f"--keep must be 'last' or 'best', got {cfg.keep!r}")
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    train(cfg, args.corpus, args.tokenizer, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
