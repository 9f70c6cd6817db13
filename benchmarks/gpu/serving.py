"""PD against a mixed worker on one GPU, through `pdrouter launch`: TTFT, ITL and the handoff.

    python -m benchmarks.gpu.checkpoint /tmp/llama8b
    python -m benchmarks.gpu.serving --model /tmp/llama8b [--output docs/benchmarks/gpu.md]

One cluster (master, pool owner, 1 P, 1 D, 1 mixed, router), every worker on the same GPU with
the PyTorch runner in bf16. For each prompt length and concurrency, fresh prompts (no shared
prefix) go through the mixed worker and then through the router (P -> pool -> D), streamed
with the official openai client, 32 tokens each with ignore_eos. P and D share the GPU's SMs,
so PD here pays its handoff without the separation that pays for it on two GPUs.

Columns: TTFT and ITL medians over the streams (client clock; a stream's ITL is its time from
the first token to the last over the tokens after the first), and the handoff per request
from the workers' /metrics histograms (their sums' growth over a level, divided by its
requests): P's compute, P's pool write left after its compute (write wait), and D's read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from benchmarks.gpu.checkpoint import prompt_ids
from benchmarks.pd import histogram_sums
from benchmarks.table_file import publish_section
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec

SERVED_NAME = "llama8b-shape"
BLOCK_SIZE = 64
MAX_TOKENS = 32
LENGTHS = (1024, 4096, 16384)
CONCURRENCY = (1, 8)
SECTION = "serving"
HANDOFF = {  # column -> (role, histogram)
    "P compute": ("prefill", "pdworker_prefill_compute_seconds"),
    "P write wait": ("prefill", "pdworker_pool_write_wait_seconds"),
    "D read": ("decode", "pdworker_pool_get_seconds"),
}


@dataclass(frozen=True)
class Stream:
    ttft_s: float
    # (last token - first token) / (tokens - 1): the mean gap per token, whatever the relay
    # packed into one event (a D that runs ahead sends several tokens per SSE event).
    itl_s: float


def stream_once(base_url: str, prompt: list[int]) -> Stream:
    import openai

    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    times: list[float] = []
    num_tokens = 0
    for chunk in api.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage:
            num_tokens = chunk.usage.completion_tokens
    assert num_tokens == MAX_TOKENS, num_tokens
    return Stream(times[0] - t0, (times[-1] - times[0]) / (num_tokens - 1))


def run_level(url: str, length: int, concurrency: int, salt: int) -> list[Stream]:
    prompts = [prompt_ids(length, salt + i) for i in range(concurrency)]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: stream_once(url, p), prompts))


def spec_for(model: str, log_dir: str | None, flags: tuple[str, ...] = ()) -> ClusterSpec:
    # 8 MiB a block (32 layers x K,V x 8 heads x 64 tokens x 128 x bf16): room for c=8 at 16K.
    num_blocks = max(CONCURRENCY) * (max(LENGTHS) + MAX_TOKENS) // BLOCK_SIZE + 64
    return ClusterSpec(
        model=model,
        num_prefill=1,
        num_decode=1,
        num_mixed=1,
        pool_size="24GiB",
        worker_args=(
            "--engine-backend",
            "torch",
            "--device",
            "gpu",
            "--dtype",
            "bfloat16",
            "--served-model-name",
            SERVED_NAME,
            "--block-size",
            str(BLOCK_SIZE),
            "--num-kv-blocks",
            str(num_blocks),
            "--max-model-len",
            str(max(LENGTHS) + 256),
            "--max-num-batched-tokens",
            "4096",
            "--max-num-seqs",
            "64",
            *flags,
        ),
        router_args=("--local-prefill-below-tokens", "0"),
        log_dir=log_dir,
        startup_timeout_s=900.0,
    )


def med_ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f}" if values else "-"


def run(model: str, reps: int, log_dir: str | None, flags: tuple[str, ...] = ()) -> list[str]:
    rows = []
    with Cluster(spec_for(model, log_dir, flags)) as cluster:
        mixed_url, router = cluster.mixed_urls[0], cluster.router_url
        p_url, d_url = cluster.prefill_urls[0], cluster.decode_urls[0]
        for url in (mixed_url, router):  # warm-up: kernels, allocator, staging
            for length in LENGTHS:
                stream_once(url, prompt_ids(length, 10_000 + length))
        salt = 0
        for length in LENGTHS:
            for c in CONCURRENCY:
                got: dict[str, list[Stream]] = {"mixed": [], "pd": []}
                handoff: dict[str, list[float]] = {k: [] for k in HANDOFF}
                for _ in range(reps):
                    got["mixed"] += run_level(mixed_url, length, c, salt)
                    before = {"prefill": histogram_sums(p_url), "decode": histogram_sums(d_url)}
                    got["pd"] += run_level(router, length, c, salt + 100)
                    after = {"prefill": histogram_sums(p_url), "decode": histogram_sums(d_url)}
                    for column, (role, name) in HANDOFF.items():
                        grown = after[role].get(name, 0.0) - before[role].get(name, 0.0)
                        handoff[column].append(grown / c)
                    salt += 1000
                rows.append((length, c, got, handoff))
                print(length, c, {k: med_ms([s.ttft_s for s in v]) for k, v in got.items()})
    return render(rows)


def render(rows: list) -> list[str]:
    lines = [
        "| prompt | c | TTFT mixed ms | TTFT PD ms | PD/mixed | ITL mixed ms | ITL PD ms | "
        "PD/mixed | P compute ms | P write left ms | D read ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length, c, got, handoff in rows:
        ttft = {k: statistics.median(s.ttft_s for s in v) for k, v in got.items()}
        itl = {k: statistics.median(s.itl_s for s in v) for k, v in got.items()}
        cells = [
            str(length),
            str(c),
            f"{1000 * ttft['mixed']:.1f}",
            f"{1000 * ttft['pd']:.1f}",
            f"{ttft['pd'] / ttft['mixed']:.2f}",
            f"{1000 * itl['mixed']:.2f}",
            f"{1000 * itl['pd']:.2f}",
            f"{itl['pd'] / itl['mixed']:.2f}",
            *(med_ms(handoff[k]) for k in HANDOFF),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--worker-flags", default="", help="more flags for every worker")
    ap.add_argument("--output", default="")
    args = ap.parse_args(argv)
    table = run(args.model, args.reps, args.log_dir, tuple(args.worker_flags.split()))
    head = (
        f"Generated by `python -m benchmarks.gpu.serving {' '.join(argv or sys.argv[1:])}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device "
        f"{torch.cuda.get_device_name()}; 1 P, 1 D, 1 mixed on that one GPU, torch runner, "
        f"bf16, block {BLOCK_SIZE}, {MAX_TOKENS} tokens a stream, {args.reps} reps a row, "
        f"worker flags: {args.worker_flags or 'none beyond the defaults'}."
    )
    text = "\n".join([head, "", *table]) + "\n"
    print(text, flush=True)
    if args.output:
        publish_section(args.output, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
