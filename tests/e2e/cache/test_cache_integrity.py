"""Corrupt pool blocks under the prefix cache, end to end, with --pool-integrity on: a prompt
computed on one P is in the pool; one of its blocks is then replaced in the pool (payload
bytes overwritten, payload truncated, another model's block under the forged key, the
prompt's partial tail presented as a full block); the same prompt on the other P reads the
pool, finds the bad block, counts it by reason, recomputes from there and answers exactly as a
worker that caches nothing. The bad block is gone: the P that recomputed it wrote it again, and
what the pool then holds proves its content.

The corruptions are made by a pool client of the test's own (header and payload objects:
workers/pool/checked_pool.py), as a stale, foreign or broken writer would leave them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from pdrouter.launch.cluster import Cluster
from tests.e2e.cache.conftest import BLOCK_SIZE, MODEL, ask, by_source, cache_spec, delta
from tests.e2e.cluster_fixture import started_cluster
from tests.e2e.pd.clients import prompt_ids
from tests.metrics_scrape import metrics_of
from tests.workers.server.conftest import WorkerHandle
from workers.pool.client import KVPoolClient
from workers.pool.client_config import PoolClientConfig
from workers.pool.keys import block_keys, header_key, shard_key
from workers.pool.object_header import ExpectedObject, decode
from workers.pool.payload_checksum import xxh3

pytestmark = pytest.mark.slow
PROMPT_TOKENS = 3 * BLOCK_SIZE + 12  # three full blocks and a partial tail
FAILURES = "pdworker_pool_integrity_failures_total"
SLOT_BYTES = 1 << 20  # at least a worker's slot: a get returns the object's length


@pytest.fixture(scope="module")
def checked_cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path
) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("cache-integrity-logs")
    yield from started_cluster(cache_spec(log_dir, tiny_cache_dir, "--pool-integrity=on"))


@pytest.fixture(scope="module")
def pool_client(checked_cluster: Cluster) -> Iterator[KVPoolClient]:
    a = checked_cluster.pool_addresses
    assert a is not None
    config = PoolClientConfig(
        master_addr=a.master_addr, metadata_url=a.metadata_url, owner_addr=a.owner_addr,
        num_slots=2, slot_bytes=SLOT_BYTES, warm_staging=False, probe_interval_s=0,
    )  # fmt: skip
    with KVPoolClient(config) as client:
        yield client


def _read(client: KVPoolClient, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(payload, header) of the block under key, as stored."""
    slot = client.slots.allocate(1)
    assert slot is not None
    try:
        got = client.get_into([key], slot)
        assert client.get_into([header_key(key)], slot, headers=True).ok and got.ok
        return client.buffer.view[slot[0], : got.codes[0]].copy(), client.buffer.headers[
            slot[0]
        ].copy()
    finally:
        client.slots.free(slot)


def _write(client: KVPoolClient, key: str, payload: np.ndarray, header: np.ndarray) -> None:
    slot = client.slots.allocate(1)
    assert slot is not None
    try:
        client.buffer.view[slot[0], : payload.size] = payload
        client.buffer.headers[slot[0]] = header
        assert client.remove([key, header_key(key)], force=True).ok  # a read may lease it
        assert client.put_from([key], slot, [payload.size]).ok
        assert client.put_from([header_key(key)], slot, [64], headers=True).ok
    finally:
        client.slots.free(slot)


def _sealed_as(other_key: str, payload: np.ndarray) -> np.ndarray:
    header = ExpectedObject.for_key(other_key, BLOCK_SIZE, payload.size).header(xxh3(payload), 1)
    return np.frombuffer(header.encode(), np.uint8)


Corrupt = Callable[[KVPoolClient, list[str]], None]


def _overwritten(client: KVPoolClient, keys: list[str]) -> None:
    payload, header = _read(client, keys[1])
    payload[len(payload) // 2 :] ^= 0x5A  # other bytes, the header left as it was
    _write(client, keys[1], payload, header)


def _truncated(client: KVPoolClient, keys: list[str]) -> None:
    payload, header = _read(client, keys[1])
    _write(client, keys[1], payload[: len(payload) // 2], header)


def _other_model(client: KVPoolClient, keys: list[str]) -> None:
    payload, _ = _read(client, keys[1])
    other = _objects(block_keys("feedfacecafebeef", prompt_ids(PROMPT_TOKENS, salt=7), BLOCK_SIZE))[
        1
    ]
    foreign = np.random.default_rng(1).integers(0, 256, payload.size, dtype=np.uint8)
    _write(client, keys[1], foreign, _sealed_as(other, foreign))


def _partial_as_full(client: KVPoolClient, keys: list[str]) -> None:
    payload, header = _read(client, keys[-1])  # the tail's block, sealed as the tail
    _write(client, keys[1], payload, header)


CASES: dict[str, tuple[Corrupt, str]] = {
    "overwritten": (_overwritten, "checksum"),
    "truncated": (_truncated, "length"),
    "another model": (_other_model, "fingerprint"),
    "partial as full": (_partial_as_full, "tokens"),
}


def _objects(keys: list[str]) -> list[str]:
    """The pool objects of a TP size 1 worker's blocks: one shard of both of the tiny
    model's KV heads each (workers.pool.keys.shard_key)."""
    return [shard_key(key, 0, 2, 2) for key in keys]


def _failures(c: Cluster) -> dict[str, float]:
    out: dict[str, float] = {}
    for url in c.prefill_urls + c.decode_urls:
        for name, value in metrics_of(url).items():
            if name.startswith(FAILURES):
                reason = name.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] = out.get(reason, 0.0) + value
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_a_corrupt_block_is_recomputed_exactly_counted_and_replaced(
    checked_cluster: Cluster, reference: WorkerHandle, pool_client: KVPoolClient, case: str
) -> None:
    c = checked_cluster
    corrupt, reason = CASES[case]
    prompt = prompt_ids(PROMPT_TOKENS, salt=3100 + list(CASES).index(case))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    want = ask(reference.base_url, False, False, **body).answer
    assert ask(c.router_url, False, False, **body).answer == want  # computed, then written

    fingerprint = httpx.get(f"{c.prefill_urls[0]}/health", timeout=10).json()["fingerprint"]
    keys = _objects(block_keys(fingerprint, prompt, BLOCK_SIZE))
    corrupt(pool_client, keys)
    before_failures, before_source = _failures(c), by_source(c.router_url)
    assert ask(c.router_url, False, False, **body).answer == want  # the other P: a pool read
    counted = delta(_failures(c), {k: 0.0 for k in _failures(c)} | before_failures)
    # Counted by the P whose prefix read met it, or by the D following P's writes, which may
    # read the block first (then P finds it gone, a plain miss), or by both at once.
    assert {k for k, v in counted.items() if v} == {reason} and counted[reason] in (1.0, 2.0)
    assert delta(by_source(c.router_url), before_source)["pool"] == BLOCK_SIZE  # block 0 only

    payload, header = _read(pool_client, keys[1])  # written again by the P that recomputed it
    sound = decode(header.tobytes())
    assert sound is not None and sound.checksum == xxh3(payload)
    assert sound.num_tokens == BLOCK_SIZE and payload.size == sound.payload_bytes
