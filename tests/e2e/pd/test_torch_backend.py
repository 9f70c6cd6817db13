"""Workers on the PyTorch backend (`pdworker serve --engine-backend torch`, started where
Paddle cannot be imported) serve the demo model through the official openai client exactly as
the Paddle workers do: a torch mixed worker answers as transformers and as the Paddle mixed
worker, and PD pairs of mixed backends (torch P -> Paddle D, Paddle P -> torch D) answer as
both, through the pool: the KV bytes one backend writes are the bytes the other reads.

One Paddle cluster (`pdrouter launch` shape: P, D, mixed, router, pool) plus three torch
workers on its pool and two routers pairing them across backends; every process is stopped
by PID whether the tests pass or not.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.cluster_fixture import QUIET_ENV, THROUGH_P
from tests.e2e.pd.clients import chat, client
from tests.metrics_scrape import metrics_of
from tests.repo import REPO_ROOT
from tests.workers.models.test_demo_model import REFERENCE

pytest.importorskip("torch")
pytest.importorskip("paddle", reason="pairs torch workers with Paddle ones (not installed)")
pytestmark = [pytest.mark.slow, pytest.mark.torch]

MODEL = "demo"
WORKER_ARGS = ("--block-size", "16", "--num-kv-blocks", "64")
WITHOUT_PADDLE = str(REPO_ROOT / "tests" / "e2e" / "without_paddle.py")


@dataclass
class Backends:
    cluster: Cluster  # Paddle P, D and mixed, and the router pairing them
    torch_mixed: str
    torch_p_to_paddle_d: str  # a router's URL
    paddle_p_to_torch_d: str


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backends]:
    log_dir: Path = tmp_path_factory.mktemp("torch-backend-logs")
    spec = ClusterSpec(
        model=MODEL, num_prefill=1, num_decode=1, num_mixed=1, pool_size="256MiB",
        worker_args=(*WORKER_ARGS, "--engine-backend", "paddle"), router_args=THROUGH_P,
        env=QUIET_ENV, log_dir=str(log_dir), startup_timeout_s=240.0,
    )  # fmt: skip
    cluster = Cluster(spec)
    procs: list[ManagedProcess] = []
    secret = ("--internal-secret", cluster.internal_secret)

    def start(name: str, argv: list[str], health: str) -> str:
        port = find_free_port()
        url = f"http://127.0.0.1:{port}"
        proc = ManagedProcess(name, [*argv, "--port", str(port)], env=dict(QUIET_ENV),
                              log_path=log_dir / f"{name}.log", cwd=str(REPO_ROOT))  # fmt: skip
        procs.append(proc)
        wait_for_http(f"{url}{health}", 240.0, proc)
        return url

    def torch_worker(role: str) -> str:
        argv = [
            sys.executable,
            WITHOUT_PADDLE,
            "serve",
            "--role",
            role,
            "--model",
            MODEL,
            "--host",
            "127.0.0.1",
            *WORKER_ARGS,
            "--engine-backend",
            "torch",
            *secret,
        ]
        if role != "mixed":
            pool = cluster.pool_addresses
            assert pool is not None
            argv += ["--master", pool.master_addr, "--metadata", pool.metadata_url,
                     "--pool-owner", pool.owner_addr]  # fmt: skip
        return start(f"torch-{role}", argv, "/health")

    def router(name: str, prefill: str, decode: str) -> str:
        argv = [sys.executable, "-m", "pdrouter.cli", "serve", "--host", "127.0.0.1",
                "--prefill", prefill, "--decode", decode, *secret, *THROUGH_P]  # fmt: skip
        return start(name, argv, "/health")

    try:
        cluster.start()
        urls = {role: torch_worker(role) for role in ("mixed", "prefill", "decode")}
        yield Backends(
            cluster,
            urls["mixed"],
            router("router-torch-p", urls["prefill"], cluster.decode_urls[0]),
            router("router-torch-d", cluster.prefill_urls[0], urls["decode"]),
        )
    finally:
        for proc in reversed(procs):
            proc.stop()
        cluster.stop()


def _ask(url: str, case: dict, stream: bool):
    return chat(client(url), stream, model=MODEL, messages=case["messages"], temperature=0,
                max_tokens=REFERENCE["max_new_tokens"])  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_torch_mixed_answers_as_transformers_and_the_paddle_mixed(backends, stream):
    for case in REFERENCE["greedy"]:
        answer = _ask(backends.torch_mixed, case, stream)
        assert answer.text == case["output_text"], case["messages"][-1]["content"]
        assert answer.completion_tokens == len(case["output_token_ids"])
        assert answer.prompt_tokens == len(case["prompt_token_ids"])
        assert _ask(backends.cluster.mixed_urls[0], case, stream) == answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("pair", ["torch_p_to_paddle_d", "paddle_p_to_torch_d"])
def test_pd_across_backends_answers_as_mixed_through_the_pool(backends, pair, stream):
    router_url = getattr(backends, pair)
    for case in REFERENCE["greedy"][:4]:
        before = metrics_of(router_url)
        answer = _ask(router_url, case, stream)
        after = metrics_of(router_url)
        assert answer == _ask(backends.cluster.mixed_urls[0], case, stream)
        assert answer.text == case["output_text"]
        read = (after["pdrouter_pool_bytes_read_total"]
                - before["pdrouter_pool_bytes_read_total"])  # fmt: skip
        assert read > 0  # D read the prompt's KV that P (the other backend) wrote


def test_n3_groups_fork_alike_on_both_backends(backends):
    """n=3 with a seed: the torch worker's forks (copy_blocks of the prompt's partial block)
    sample the same three answers as the Paddle worker's."""
    kwargs = {"model": MODEL, "messages": REFERENCE["greedy"][0]["messages"], "n": 3,
              "seed": 5, "temperature": 1.5, "max_tokens": 12}  # fmt: skip
    answers = []
    for url in (backends.torch_mixed, backends.cluster.mixed_urls[0]):
        r = client(url).chat.completions.create(**kwargs)
        answers.append(sorted((c.index, c.message.content) for c in r.choices))
    assert answers[0] == answers[1] and [i for i, _ in answers[0]] == [0, 1, 2]
    assert len({text for _, text in answers[0]}) > 1  # three samples, not one repeated
