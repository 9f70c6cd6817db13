"""A JSON schema costs a worker at most its grammar budget, on a real cluster (P, D,
router, the demo model's tokenizer) with a 1.5 s compile budget and a 32 KiB size budget.

A 300-key `patternProperties` schema takes seconds to compile (tens on a loaded machine); it
compiled on D's event loop, whose /health went silent until the router marked D down. Now it
compiles in a child process killed at the budget: each such request is a 400 naming the
budget, within it, while /health of every process and a bystander's request answer at once,
and no worker is marked down. A repeated schema is answered from the cache (counted in
pdworker_grammar_compiles_total); a schema no output can match is a 400, not an empty answer.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest

from pdrouter.common.auth import INTERNAL_SECRET_HEADER
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from pdrouter.wire.pd import DecodeRequest
from tests.e2e.cluster_fixture import QUIET_ENV, THROUGH_P, started_cluster
from tests.e2e.pd.clients import client

pytestmark = pytest.mark.slow
MODEL = "demo"
BUDGET_S = 1.5
MAX_SCHEMA_BYTES = 32768
QUESTION = [{"role": "user", "content": "Name a pet."}]
PET = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"],
       "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(
        model=MODEL,
        num_prefill=1,
        num_decode=1,
        pool_size="128MiB",
        worker_args=(
            "--num-kv-blocks",
            "64",
            "--grammar-compile-timeout-s",
            str(BUDGET_S),
            "--grammar-max-schema-bytes",
            str(MAX_SCHEMA_BYTES),
        ),
        router_args=("--health-interval-s", "0.5", *THROUGH_P),
        env=QUIET_ENV,
        log_dir=str(tmp_path_factory.mktemp("grammar-budget-logs")),
        startup_timeout_s=240.0,
    )
    yield from started_cluster(spec)


def _slow_schema(salt: int, num_keys: int = 300) -> dict:
    """Seconds of compile: every pattern property's key regex against all the others."""
    key, value = f"^k{salt}_{{}}_[a-z]{{{{2,9}}}}[0-9]*$", "^v{}[a-f0-9]{{3,12}}$"
    properties = {key.format(i): {"type": "string", "pattern": value.format(i)}
                  for i in range(num_keys)}  # fmt: skip
    return {"type": "object", "patternProperties": properties}


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}


def _chat(url: str, **body: object) -> httpx.Response:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def _grammar_counts(cluster: Cluster, url: str) -> dict[str, float]:
    admin = {"Authorization": f"Bearer {cluster.admin_key}"}
    text = httpx.get(f"{url}/metrics", headers=admin, timeout=10).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("pdworker_grammar_compiles_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = float(line.rsplit(" ", 1)[1])
    return counts


def _timed(fn, *args, **kwargs) -> tuple[float, object]:
    t0 = time.monotonic()
    result = fn(*args, **kwargs)
    return time.monotonic() - t0, result


def test_a_schema_past_the_time_budget_is_a_400_while_everyone_else_is_served(cluster: Cluster):
    start = _grammar_counts(cluster, cluster.prefill_urls[0])
    secret = {INTERNAL_SECRET_HEADER: cluster.internal_secret}
    decode = DecodeRequest(request_id="slow-on-d", endpoint="chat", prompt_token_ids=[5, 6, 7],
                           output_token_ids=[8],
                           body={"model": MODEL, "messages": QUESTION, "max_tokens": 8,
                                 "response_format": _format(_slow_schema(0))})  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # Through the router (P compiles before any prefill) and straight at D.
        slow = [
            pool.submit(
                _timed, _chat, cluster.router_url, response_format=_format(_slow_schema(salt))
            )
            for salt in (1, 2)
        ]
        slow.append(
            pool.submit(
                _timed,
                httpx.post,
                f"{cluster.decode_urls[0]}/internal/decode",
                json=decode.model_dump(),
                headers=secret,
                timeout=120,
            )
        )
        urls = [cluster.prefill_urls[0], cluster.decode_urls[0], cluster.router_url]
        while not all(f.done() for f in slow):
            for url in urls:
                took_s, health = _timed(httpx.get, f"{url}/health", timeout=30)
                assert health.status_code == 200 and took_s < 0.5, (url, took_s)
            took_s, bystander = _timed(_chat, cluster.router_url)
            assert bystander.status_code == 200 and took_s < 5.0, (took_s, bystander.text)
        answers = [f.result() for f in slow]
    for took_s, response in answers:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "grammar_budget_exceeded"
        assert error["param"] == "response_format.json_schema.schema"
        assert f"time budget of {BUDGET_S:g} s (--grammar-compile-timeout-s)" in error["message"]
        assert took_s < BUDGET_S + 3.0, took_s
    # No worker was marked down; the same schema again is refused at once, from the cache.
    admin = {"Authorization": f"Bearer {cluster.admin_key}"}
    instances = httpx.get(f"{cluster.router_url}/instances", headers=admin, timeout=10).json()
    assert sorted(i["healthy"] for i in instances["instances"]) == [True, True], instances
    before = _grammar_counts(cluster, cluster.prefill_urls[0])
    took_s, again = _timed(_chat, cluster.router_url, response_format=_format(_slow_schema(1)))
    assert again.status_code == 400 and took_s < 1.0, (took_s, again.text)
    after = _grammar_counts(cluster, cluster.prefill_urls[0])
    assert after["cache_hit"] - before["cache_hit"] == 1
    assert after["over_budget"] == before["over_budget"] == start["over_budget"] + 2


def test_a_schema_past_the_size_budget_is_a_400_naming_it(cluster: Cluster):
    big = {"enum": [f"value-{i:06d}" for i in range(3000)]}
    size = len(json.dumps(big, separators=(",", ":")))
    response = _chat(cluster.router_url, response_format=_format(big))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "grammar_budget_exceeded"
    assert error["message"] == (
        f"response_format.json_schema.schema: the schema is {size} bytes, over the grammar size "
        f"budget of {MAX_SCHEMA_BYTES} bytes (--grammar-max-schema-bytes)"
    )


def test_a_repeated_schema_is_compiled_once_per_worker(cluster: Cluster):
    schema = {**PET, "title": "repeated"}  # a schema no other test sends
    before = {
        url: _grammar_counts(cluster, url) for url in cluster.prefill_urls + cluster.decode_urls
    }
    api = client(cluster.router_url)
    for _ in range(3):
        r = api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                        temperature=0, response_format=_format(schema))  # fmt: skip
        assert json.loads(r.choices[0].message.content)["pet"] in ("cat", "dog")
    for url in cluster.prefill_urls + cluster.decode_urls:
        after = _grammar_counts(cluster, url)
        assert after["compiled"] - before[url]["compiled"] == 1, url
        assert after["cache_hit"] - before[url]["cache_hit"] == 2, url


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},  # answered "" with finish_reason stop before
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    ],
    ids=["self-ref", "ref-cycle"],
)
def test_a_schema_no_output_can_match_is_a_400(cluster: Cluster, schema: dict):
    api = client(cluster.router_url)
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                    response_format=_format(schema))  # fmt: skip
    error = info.value.body
    assert error["param"] == "response_format.json_schema.schema", error
    assert "Unsatisfiable schema" in error["message"], error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_answer_that_reaches_a_dead_end_says_so(cluster: Cluster, stream: bool):
    # A list of at least one item that can never be written: compiles, and its first token
    # ("[") is allowed; the next has no way on. It answered "[" with finish_reason "stop".
    schema = {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1,
              "$defs": {"a": {"$ref": "#/$defs/a"}}}  # fmt: skip
    api = client(cluster.router_url)
    kwargs = {"model": MODEL, "messages": QUESTION, "max_tokens": 16, "temperature": 0,
              "response_format": _format(schema)}  # fmt: skip
    if stream:
        chunks = list(api.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = api.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert (text, finish) == ("[", "grammar_error")
    if not stream:  # the Responses API: incomplete, and why
        fmt = {"type": "json_schema", "name": "a", "schema": schema}
        response = api.responses.create(model=MODEL, input="Name a pet.", max_output_tokens=16,
                                        temperature=0, text={"format": fmt})  # fmt: skip
        assert (response.output_text, response.status) == ("[", "incomplete")
        assert response.incomplete_details.reason == "grammar_error"
