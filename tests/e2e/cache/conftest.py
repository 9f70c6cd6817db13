"""The pool as a shared prefix cache, end to end: master + pool owner + 2 P + 2 D + router
(`pdrouter.launch.cluster.Cluster`), and a mixed worker with `--no-prefix-cache`, the reference
every answer is compared with. Real processes on loopback, stopped by PID in the finalizers.

P's pool hits count from one block (`--pool-prefix-min-tokens 16`), so that short prompts
exercise the load path. The router's prefill policy is round robin: two requests in a row go
to the two Ps, which is how a test makes "computed on one P, a pool hit on the other".
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.cluster_fixture import QUIET_ENV, THROUGH_P, started_cluster
from tests.e2e.pd.clients import Answer
from tests.e2e.pd.conftest import wait_blocks_free
from tests.metrics_scrape import metrics_of
from tests.workers.server.conftest import WorkerHandle, start_worker

MODEL = "tiny"
BLOCK_SIZE = 16  # the reference worker's (tests/workers/server/conftest.py) as well
MIN_HIT_TOKENS = 16
BY_SOURCE = "pdrouter_prompt_tokens_by_source_total"


def cache_spec(log_dir: Path, cache_dir: Path, *extra: str) -> ClusterSpec:
    return ClusterSpec(
        model=MODEL,
        num_prefill=2,
        num_decode=2,
        pool_size="256MiB",
        worker_args=(
            f"--block-size={BLOCK_SIZE}",
            "--num-kv-blocks=128",
            "--max-model-len=1024",
            f"--model-cache-dir={cache_dir}",
            "--staging-slots=64",
            "--transfer-batch-blocks=8",
            f"--pool-prefix-min-tokens={MIN_HIT_TOKENS}",
            *extra,
        ),
        router_args=(
            "--health-interval-s=0.5",
            "--decode-timeout-s=30",
            "--prefill-timeout-s=60",
            *THROUGH_P,
        ),
        env=QUIET_ENV,
        log_dir=str(log_dir),
        startup_timeout_s=240.0,
    )


@pytest.fixture(scope="module")
def cache_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path):
    yield from started_cluster(cache_spec(tmp_path_factory.mktemp("cache-logs"), tiny_cache_dir))


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path
) -> Iterator[WorkerHandle]:
    """A mixed worker that caches nothing: every prompt block computed."""
    handle = start_worker(
        tmp_path_factory.mktemp("cache-ref-logs"), tiny_cache_dir, "--no-prefix-cache",
        name="pdworker-mixed-nocache",
    )  # fmt: skip
    try:
        yield handle
    finally:
        assert handle.proc is not None
        handle.proc.stop()


@dataclass(frozen=True)
class Cached:
    answer: Answer
    cached_tokens: int


def api(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(base_url: str, chat: bool, stream: bool, **kwargs: Any) -> Cached:
    """One request through the openai client: the answer and usage's cached_tokens."""
    client = api(base_url)
    create = client.chat.completions.create if chat else client.completions.create
    if not stream:
        r = create(**kwargs)
        choice = r.choices[0]
        text = (choice.message.content or "") if chat else choice.text
        u = r.usage
        answer = Answer(text, choice.finish_reason, u.prompt_tokens, u.completion_tokens)
        return Cached(answer, u.prompt_tokens_details.cached_tokens)
    texts, finish, usage = [], None, None
    for chunk in create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            texts.append((choice.delta.content or "") if chat else choice.text)
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert usage is not None, "no usage chunk"
    answer = Answer("".join(texts), finish, usage.prompt_tokens, usage.completion_tokens)
    return Cached(answer, usage.prompt_tokens_details.cached_tokens)


def by_source(router_url: str) -> dict[str, float]:
    m = metrics_of(router_url)
    return {s: m.get(f'{BY_SOURCE}{{source="{s}"}}', 0.0) for s in ("device", "pool", "computed")}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def assert_no_blocks_held(c: Cluster, timeout_s: float = 30.0) -> None:
    """Every worker idle with no KV block referenced (cached, evictable blocks are not held)."""
    for url in c.prefill_urls + c.decode_urls:
        assert wait_blocks_free(url, timeout_s) == 0, f"{url} leaked KV blocks"
