"""The packaged demo model served by `pdrouter launch --model demo`: through P, the pool and D,
and by a colocated `pdworker serve --model demo`, greedy chat answers equal transformers' own
continuations (recorded in tests/workers/models/demo_reference.json), word for word.

The handoff (prompt KV written by P, read back by D, decode continued there) is only right if
every bit of the KV survives it: a trained model turns any corruption into different words.
"""

from __future__ import annotations

import pytest

from pdrouter.launch.cluster import Cluster
from tests.e2e.pd.clients import chat, client
from tests.metrics_scrape import metrics_of
from tests.workers.models.test_demo_model import REFERENCE
from workers.engine.config import ModelConfig
from workers.models.packaged import packaged_model_dir

pytestmark = pytest.mark.slow
MODEL = "demo"
EOS_TOKEN_IDS = ModelConfig.from_dir(packaged_model_dir(MODEL), model_id=MODEL).eos_token_ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", REFERENCE["greedy"], ids=lambda c: c["messages"][-1]["content"])
def test_pd_and_mixed_answer_as_transformers(demo_cluster: Cluster, case: dict, stream: bool):
    kwargs = {"model": MODEL, "messages": case["messages"], "temperature": 0,
              "max_tokens": REFERENCE["max_new_tokens"]}  # fmt: skip
    expected_finish = "stop" if case["output_token_ids"][-1] in EOS_TOKEN_IDS else "length"
    for url in (demo_cluster.router_url, demo_cluster.mixed_urls[0]):
        answer = chat(client(url), stream, **kwargs)
        assert answer.text == case["output_text"], url
        assert answer.completion_tokens == len(case["output_token_ids"]), url
        assert answer.prompt_tokens == len(case["prompt_token_ids"]), url
        assert answer.finish_reason == expected_finish, url


def test_answer_went_through_the_pool(demo_cluster: Cluster):
    # A question no other test asks: P finds none of its blocks in the pool and writes them
    # all, D reads exactly those.
    before = metrics_of(demo_cluster.router_url)
    messages = [{"role": "user", "content": "What does zlib do?"}]
    answer = chat(
        client(demo_cluster.router_url), False, model=MODEL, max_tokens=4, temperature=0,
        messages=messages,
    )  # fmt: skip
    after = metrics_of(demo_cluster.router_url)
    written, read = (
        after[f"pdrouter_pool_bytes_{kind}_total"] - before[f"pdrouter_pool_bytes_{kind}_total"]
        for kind in ("written", "read")
    )
    assert answer.completion_tokens == 4
    assert written > 0 and read == written
