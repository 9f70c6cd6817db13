"""The PyTorch runner on one GPU against the same run's limits: prefill MFU, decode step time.

    python -m benchmarks.gpu.checkpoint /tmp/llama8b
    python -m benchmarks.gpu.runner_bench --model /tmp/llama8b [--output docs/benchmarks/gpu.md]

One process, one TorchModelRunner (workers/engine/torch_runner.py) of the checkpoint in bf16
with its paged cache, driven by ScheduledBatch as the engine drives it, beside the limits
measured in the same run on the same device:

    GEMM peak    the mean of ten 8192^3 bf16 matmuls (after three warm-ups)
    weight read  half of one device-to-device copy of as many bytes as the weights: a copy
                 reads and writes each byte once, and a decode step must read every weight
                 once at least (the copy's bandwidth counting both directions, ~4.3 TB/s)

Prefill: one fresh prompt of 1K/4K/16K tokens in one chunk; MFU counts the matmuls
(2 x non-embedding parameters x tokens, the LM head for the one sampled row) and causal
attention (2 x 2 x layers x heads x head_dim x n(n+1)/2), against the GEMM peak.
Decode: a step of batch 1/8/32/64 sequences at 4K context each (their own last block, a
shared 4K prefix), against the weight read, for each way the runner can take a decode step:
eager with SDPA over gathered blocks (the default), captured as CUDA graphs (--cuda-graphs),
the Triton paged kernel reading blocks in place (--decode-attention triton), and both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from benchmarks.gpu.checkpoint import prompt_ids
from benchmarks.table_file import publish_section
from workers.engine.batch import ScheduledBatch, ScheduledChunk

BLOCK_SIZE = 64
PREFILL_TOKENS = (1024, 4096, 16384)
DECODE_BATCHES = (1, 8, 32, 64)
DECODE_CONTEXT = 4096
SECTION = "runner"
# (label, cuda_graphs, decode_attention): the runner's ways through a decode step
DECODE_WAYS = (
    ("eager, SDPA", False, "sdpa"),
    ("CUDA graphs, SDPA", True, "sdpa"),
    ("eager, Triton", False, "triton"),
    ("CUDA graphs, Triton", True, "triton"),
)


def cuda_ms(fn: Any, reps: int, warmup: int = 3) -> list[float]:
    """Each rep's time in ms by CUDA events around fn() (synchronized after each)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def gemm_peak_tflops() -> float:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = statistics.mean(cuda_ms(lambda: a @ b, reps=10))
    return 2 * n**3 / (ms / 1000) / 1e12


def weight_copy_ms(num_bytes: int) -> float:
    import torch

    src_dst = [torch.empty(num_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    ms = statistics.median(cuda_ms(lambda: src_dst[1].copy_(src_dst[0]), reps=5, warmup=1))
    src_dst.clear()
    torch.cuda.empty_cache()
    return ms


def prefill_flops(config: Any, num_tokens: int) -> float:
    c = config
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    matmuls = 2 * per_layer * c.num_layers * num_tokens + 2 * c.hidden_size * c.vocab_size
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * num_tokens * (num_tokens + 1) / 2
    return matmuls + attention


def prefill_row(runner: Any, num_tokens: int, peak: float, salt: int) -> dict[str, float]:
    blocks = tuple(range(-(-num_tokens // BLOCK_SIZE)))
    ids = tuple(prompt_ids(num_tokens, salt))
    batch = ScheduledBatch((ScheduledChunk("p", ids, 0, blocks, need_logits=True),))
    ms = statistics.median(cuda_ms(lambda: runner.run(batch), reps=5, warmup=2))
    tflops = prefill_flops(runner.config, num_tokens) / (ms / 1000) / 1e12
    return {"tokens": num_tokens, "ms": ms, "tok_s": num_tokens / ms * 1000, "mfu": tflops / peak}


def decode_batch(num_seqs: int, context: int) -> ScheduledBatch:
    """num_seqs sequences at position `context`: the blocks of a shared prefix, then each
    its own last block (so the step writes num_seqs distinct rows)."""
    prefix = tuple(range(context // BLOCK_SIZE))
    first_own = len(prefix)
    return ScheduledBatch(
        tuple(
            ScheduledChunk(f"d{i}", (5 + i,), context, (*prefix, first_own + i), need_logits=True)
            for i in range(num_seqs)
        )
    )


def decode_ms(runner: Any, num_seqs: int) -> float | None:
    """The median step time, or None when this way fails (printed: the table says so)."""
    batch = decode_batch(num_seqs, DECODE_CONTEXT)
    try:
        return statistics.median(cuda_ms(lambda: runner.run(batch), reps=20, warmup=3))
    except Exception as exc:  # a way that cannot run here is a row, not a lost table
        print(f"decode batch {num_seqs}: {type(exc).__name__}: {exc}", flush=True)
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (benchmarks.gpu.checkpoint)")
    ap.add_argument("--output", default="")
    args = ap.parse_args(argv)
    import torch

    from workers.engine.loader import load_model
    from workers.engine.torch_runner import TorchModelRunner

    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype="bfloat16", framework="torch", device="cuda:0")
    load_s = time.perf_counter() - t0
    weight_bytes = sum(t.numel() * t.element_size() for t in loaded.weights.values())
    num_blocks = max(PREFILL_TOKENS) // BLOCK_SIZE + DECODE_CONTEXT // BLOCK_SIZE + 128
    runner = TorchModelRunner(loaded, num_blocks, BLOCK_SIZE, device="gpu")
    peak = gemm_peak_tflops()
    copy_ms = weight_copy_ms(weight_bytes)
    read_ms = copy_ms / 2
    prefill = [prefill_row(runner, n, peak, salt=i) for i, n in enumerate(PREFILL_TOKENS)]
    # Decode reads a zeroed cache: the time depends on the shapes, not on what the KV holds.
    del runner
    decode: dict[str, list[float | None]] = {}
    for label, graphs, attention in DECODE_WAYS:
        try:
            way = TorchModelRunner(
                loaded,
                num_blocks,
                BLOCK_SIZE,
                "gpu",
                cuda_graphs=graphs,
                decode_attention=attention,
            )
        except Exception as exc:  # a way that cannot start here is a row too
            print(f"{label}: {type(exc).__name__}: {exc}", flush=True)
            decode[label] = [None] * len(DECODE_BATCHES)
            continue
        decode[label] = [decode_ms(way, n) for n in DECODE_BATCHES]
        print(label, decode[label], flush=True)
        del way
        torch.cuda.empty_cache()
    head = (
        f"Generated by `python -m benchmarks.gpu.runner_bench {' '.join(argv or sys.argv[1:])}` "
        f"on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; weights "
        f"{weight_bytes / 1e9:.2f} GB bf16 (loaded in {load_s:.1f} s), block {BLOCK_SIZE}. "
        f"Same-run limits: bf16 GEMM peak {peak:.0f} TFLOP/s; one copy of the weights' bytes "
        f"{copy_ms:.2f} ms, so one read of them {read_ms:.2f} ms."
    )
    lines = [head, "", "| prefill tokens | ms | tokens/s | MFU |", "|---:|---:|---:|---:|"]
    for r in prefill:
        lines.append(
            f"| {r['tokens']} | {r['ms']:.1f} | {r['tok_s']:.0f} | {100 * r['mfu']:.1f}% |"
        )
    lines += ["", f"Decode step ms at context {DECODE_CONTEXT} (x one weight read):", ""]
    lines.append("| decode way | " + " | ".join(f"batch {n}" for n in DECODE_BATCHES) + " |")
    lines.append("|---|" + "---:|" * len(DECODE_BATCHES))
    for label, times in decode.items():
        cells = [f"{t:.2f} ({t / read_ms:.2f}x)" if t else "failed" for t in times]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.output:
        publish_section(args.output, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
