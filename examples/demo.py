"""Run: make demo        (or: OMP_NUM_THREADS=1 .venv/bin/python examples/demo.py)

Starts a Mooncake master, the pool owner, one prefill and one decode worker of the packaged
demo model (a small Llama trained on the Python documentation, workers/models/demo/) and the
router, all on free loopback ports; sends one streamed chat request through the official
`openai` client, greedy, so the answer is the one the model card and tests record; prints the
answer as it streams, its time to first token, the decode speed and the bytes that went through
the pool; stops everything (also on failure) and exits non-zero on failure.
"""

from __future__ import annotations

import sys
import time

import httpx
import openai

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec


def _counter(metrics_text: str, name: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(f"{name} not in the router's /metrics")


MODEL = "demo"
QUESTION = "What does the json module do?"


def main() -> int:
    # The question is 14 tokens: the router's default would have D prefill a prompt that short
    # itself (conditional disaggregation, --local-prefill-below-tokens). The demo shows the
    # whole PD path, so every prompt goes through P and the pool here.
    spec = ClusterSpec(
        model=MODEL,
        num_prefill=1,
        num_decode=1,
        pool_size="256MiB",
        router_args=("--local-prefill-below-tokens", "0"),
    )
    cluster = Cluster(spec)
    print(f"starting master, pool owner, 1 prefill, 1 decode, router (logs: {cluster.log_dir})")
    try:
        t0 = time.monotonic()
        cluster.start()
        print(f"cluster up in {time.monotonic() - t0:.1f} s; router at {cluster.router_url}")
        api = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="demo", max_retries=0)
        print(f"\nuser: {QUESTION}\nassistant: ", end="", flush=True)
        t_send = time.monotonic()
        ttft_s = None
        stream = api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=64,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        for chunk in stream:
            if chunk.choices and ttft_s is None:
                ttft_s = time.monotonic() - t_send
            for choice in chunk.choices:
                print(choice.delta.content or "", end="", flush=True)
            usage = chunk.usage or usage
        total_s = time.monotonic() - t_send
        metrics = httpx.get(f"{cluster.router_url}/metrics", timeout=10).text
        written = _counter(metrics, "pdrouter_pool_bytes_written_total")
        read = _counter(metrics, "pdrouter_pool_bytes_read_total")
        # Tokens after the first come from the decode worker, streamed through the router.
        decode_rate = (usage.completion_tokens - 1) / max(total_s - ttft_s, 1e-9)
        print(f"\n\nusage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion "
              "tokens")  # fmt: skip
        print(f"time to first token: {ttft_s * 1000:.1f} ms; whole answer: {total_s * 1000:.1f} ms"
              f" ({decode_rate:.0f} tokens/s after the first)")  # fmt: skip
        print(f"KV through the pool: {written:.0f} bytes written by prefill, "
              f"{read:.0f} bytes read by decode")  # fmt: skip
        if written <= 0 or read != written:
            print("error: the KV did not go through the pool as expected", file=sys.stderr)
            return 1
        return 0
    except Exception as exc:
        print(f"demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        print("stopped everything")


if __name__ == "__main__":
    sys.exit(main())
