"""`pdrouter launch` on one GPU with the PyTorch runner: P, D and a mixed worker on that GPU,
the pool owner on Mooncake's CUDA wheel, the official openai client in front.

    python -m pytest -m gpu tests/e2e/gpu        # a GPU host with torch and the CUDA wheel

What the CPU suite cannot show: the handoff through device pointers (each P's and D's
/health and metrics say so), a trained model's greedy answers equal through PD and mixed
(streamed and not), and a group of n=3 forked on D's GPU (copy_blocks). The rest of the end-to-end
suite runs on the GPU with PDROUTER_TEST_WORKER_ARGS="--engine-backend torch --device gpu"
(tests/conftest.py): the command is in docs/operations.md.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.cluster_fixture import QUIET_ENV, THROUGH_P, started_cluster
from tests.e2e.pd.clients import chat, client
from tests.metrics_scrape import metrics_of
from tests.workers.models.test_demo_model import REFERENCE

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.torch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MODEL = "demo"


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(
        model=MODEL,
        num_prefill=1,
        num_decode=1,
        num_mixed=1,
        pool_size="1GiB",
        worker_args=(
            "--engine-backend",
            "torch",
            "--device",
            "gpu",
            "--block-size",
            "16",
            "--num-kv-blocks",
            "256",
            "--handoff-path",
            "device",
        ),
        router_args=THROUGH_P,
        env=QUIET_ENV,
        log_dir=str(tmp_path_factory.mktemp("gpu-logs")),
        startup_timeout_s=300.0,
    )
    yield from started_cluster(spec)


def test_every_p_and_d_hands_off_through_device_pointers(gpu_cluster: Cluster) -> None:
    c = gpu_cluster
    for url in c.prefill_urls + c.decode_urls:
        worker = httpx.get(f"{url}/health", timeout=10).json()
        assert worker["handoff_path"] == "device", (url, worker.get("handoff_path_reason"))
        paths = metrics_of(url)
        assert (
            paths['pdworker_handoff_path{path="host"}'],
            paths['pdworker_handoff_path{path="device"}'],
        ) == (0, 1)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_answers_equal_through_pd_and_mixed(gpu_cluster: Cluster, stream: bool) -> None:
    for case in REFERENCE["greedy"][:4]:
        kwargs = {
            "model": MODEL,
            "messages": case["messages"],
            "temperature": 0,
            "max_tokens": REFERENCE["max_new_tokens"],
        }
        pd = chat(client(gpu_cluster.router_url), stream, **kwargs)
        mixed = chat(client(gpu_cluster.mixed_urls[0]), stream, **kwargs)
        assert pd == mixed
        assert pd.text == case["output_text"]


def test_n_3_forks_on_the_gpu_and_equals_mixed(gpu_cluster: Cluster) -> None:
    kwargs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about prefill and decode."}],
        "n": 3,
        "seed": 7,
        "temperature": 1.0,
        "max_tokens": 24,
    }
    answers = {}
    for url in (gpu_cluster.router_url, gpu_cluster.mixed_urls[0]):
        r = client(url).chat.completions.create(**kwargs)
        answers[url] = [(ch.index, ch.message.content, ch.finish_reason) for ch in r.choices]
    pd, mixed = answers.values()
    assert pd == mixed
    assert len({text for _, text, _ in pd}) > 1, "three seeded samples, all equal"
