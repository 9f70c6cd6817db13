"""The GPU handoff through the real pool: P's write path and D's load path, the functions the
workers run (workers.handoff.writer.write_blocks, workers.handoff.reader.load_blocks), on CuPy
KV caches standing in for Paddle GPU tensors (the kernel takes both through the same raw pointers).

Real mooncake_master and pool owner, two pool clients over shared memory whose staging is
page-locked the way a GPU worker's is (PoolClientConfig.page_lock, cudaHostRegister); blocks
scattered on both sides, the last one partial; D's cache must equal P's byte for byte.

Beside the model's compute: the copies go on a stream of their own, so a write
completes while a long GEMM still runs on a blocking stream (what a framework's compute stream
may be; the legacy default stream the copies once used would have waited for it); and
ChunkedWrite, the prefill worker's writer, puts each chunk's blocks while the next chunk
computes: the first chunk's blocks are in the pool before the last chunk's compute ends, and
D's cache equals P's byte for byte.

Needs an NVIDIA GPU, CuPy and the Mooncake wheel; skipped elsewhere. Run on the GPU host:
    python -m pytest -q -m gpu tests/workers/handoff/test_handoff_gpu.py tests/kernels
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kernels.tensor_refs import describe_cache
from workers.handoff import reader, writer
from workers.handoff.writer import ChunkedWrite
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.keys import block_keys, is_partial_key, model_fingerprint

pytestmark = pytest.mark.gpu

# Llama-3-8B's per-layer KV geometry, fewer layers: 256 KiB a block at block size 16.
LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM = 4, 8, 16, 128
CACHE_BLOCKS = 160
PROMPT_TOKENS = 100 * BLOCK_SIZE - 5  # 100 blocks, the last one holding 11 tokens
GROUP_BLOCKS = 16  # --transfer-batch-blocks: 7 groups, the pipeline overlaps
STAGING_SLOTS = 64


WAIT_S = 30.0


@dataclass(frozen=True)
class Side:
    """What write_blocks / load_blocks take: the pool client and the engine's cache."""

    pool: KVPoolClient
    kv_caches: list[Any]


def write_blocks(side: Side, keys, block_ids, pipelined: bool = True) -> tuple[int, int, int]:
    """(written, skipped, bytes) of writer.write_blocks, as P's worker calls it."""
    out = writer.write_blocks(
        side.pool,
        side.kv_caches,
        keys,
        block_ids,
        group_blocks=GROUP_BLOCKS,
        wait_s=WAIT_S,
        pipelined=pipelined,
    )
    return out.num_written, out.num_skipped, out.num_bytes


def load_blocks(side: Side, keys, block_ids, pipelined: bool = True) -> tuple[int, list, int]:
    """(loaded, missing keys, bytes) of reader.load_blocks, as D's worker calls it."""
    out = reader.load_blocks(
        side.pool,
        side.kv_caches,
        keys,
        block_ids,
        group_blocks=GROUP_BLOCKS,
        wait_s=WAIT_S,
        pipelined=pipelined,
    )
    return out.num_loaded, list(out.missing_keys), out.num_bytes


def make_cache(cp: Any, seed: int | None) -> list[Any]:
    """[K0, V0, ...], each [num_blocks, kv_heads, block_size, head_dim] (bf16 bits as uint16):
    random for P, a poison value for D."""
    shape = (CACHE_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    if seed is None:
        return [cp.full(shape, 0xDEAD, dtype=cp.uint16) for _ in range(2 * LAYERS)]
    rng = cp.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, shape, dtype=cp.uint16) for _ in range(2 * LAYERS)]


def connect(addr: Any, caches: list[Any]) -> KVPoolClient:
    """As pd_worker connects a worker's client: slot = one block, page-locked for a GPU."""
    cache = describe_cache(caches)
    config = PoolClientConfig(
        master_addr=addr.master_addr,
        metadata_url=addr.metadata_url,
        owner_addr=addr.owner_addr,
        num_slots=STAGING_SLOTS,
        slot_bytes=cache.geometry.slot_bytes,
        page_lock=cache.on_gpu,
    )
    return KVPoolClient(config).connect()


@pytest.fixture(scope="module")
def sides(cp: Any, running_pool: Any) -> Iterator[tuple[Side, Side]]:
    p_cache = make_cache(cp, seed=7)
    p = Side(connect(running_pool, p_cache), p_cache)
    d_cache = make_cache(cp, None)
    d = Side(connect(running_pool, d_cache), d_cache)
    yield p, d
    cp.cuda.runtime.deviceSynchronize()
    p.pool.close()
    d.pool.close()


def prompt_keys(salt: int) -> list[str]:
    fingerprint = model_fingerprint("gpu-test", "bf16", LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    tokens = [(salt * 7919 + i * 31) % 32000 for i in range(PROMPT_TOKENS)]
    return block_keys(fingerprint, tokens, BLOCK_SIZE)


def scattered(num: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).permutation(CACHE_BLOCKS)[:num].tolist()


def same_blocks(cp: Any, a: list[Any], a_ids: list[int], b: list[Any], b_ids: list[int]) -> bool:
    ai, bi = cp.asarray(a_ids), cp.asarray(b_ids)
    return all(bool(cp.array_equal(x[ai], y[bi])) for x, y in zip(a, b, strict=True))


def test_staging_is_page_locked_for_the_gpu(cp: Any, sides: tuple[Side, Side]) -> None:
    for side in sides:
        attrs = cp.cuda.runtime.pointerGetAttributes(side.pool.buffer.ptr)
        assert attrs.type == 1, "cudaMemoryTypeHost: registered with cudaHostRegister"


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "serialized"])
def test_scattered_prompt_with_partial_tail_arrives_byte_exact(
    cp: Any, sides: tuple[Side, Side], pipelined: bool
) -> None:
    p, d = sides
    keys = prompt_keys(salt=1 if pipelined else 2)
    assert is_partial_key(keys[-1]) and len(keys) == 100
    p_ids, d_ids = scattered(len(keys), seed=1), scattered(len(keys), seed=2)
    d.kv_caches[:] = make_cache(cp, None)
    slot_bytes = p.pool.config.slot_bytes

    written, skipped, num_bytes = write_blocks(p, keys, p_ids, pipelined=pipelined)
    assert (written, skipped, num_bytes) == (len(keys), 0, len(keys) * slot_bytes)
    loaded, missing, got_bytes = load_blocks(d, keys, d_ids, pipelined=pipelined)
    cp.cuda.runtime.deviceSynchronize()
    assert (loaded, missing, got_bytes) == (len(keys), [], len(keys) * slot_bytes)
    assert same_blocks(cp, p.kv_caches, p_ids, d.kv_caches, d_ids)
    others = sorted(set(range(CACHE_BLOCKS)) - set(d_ids))
    assert all(bool((t[cp.asarray(others)] == 0xDEAD).all()) for t in d.kv_caches)
    # A second write finds every block in the pool and copies nothing.
    assert write_blocks(p, keys, p_ids, pipelined=pipelined) == (0, len(keys), 0)
    for side in sides:
        side.pool.slots.check_integrity()
        assert side.pool.slots.num_free == STAGING_SLOTS


def test_load_stops_at_the_first_block_the_pool_lacks(cp: Any, sides: tuple[Side, Side]) -> None:
    p, d = sides
    keys = prompt_keys(salt=3)
    p_ids, d_ids = scattered(len(keys), seed=3), scattered(len(keys), seed=4)
    d.kv_caches[:] = make_cache(cp, None)
    assert write_blocks(p, keys, p_ids)[0] == len(keys)
    assert p.pool.remove([keys[37]]).ok
    loaded, missing, _ = load_blocks(d, keys, d_ids)
    cp.cuda.runtime.deviceSynchronize()
    assert (loaded, missing) == (37, [keys[37]])
    assert same_blocks(cp, p.kv_caches, p_ids[:37], d.kv_caches, d_ids[:37])
    rest = cp.asarray(d_ids[37:])
    assert all(bool((t[rest] == 0xDEAD).all()) for t in d.kv_caches)


GEMM_N = 8192
NUM_CHUNKS = 4


def busy(cp: Any, stream: Any, num_gemms: int) -> Any:
    """Queue num_gemms float32 GEMMs of GEMM_N^3 on stream; the event recorded after them."""
    with stream:
        a = cp.ones((GEMM_N, GEMM_N), dtype=cp.float32)
        for _ in range(num_gemms):
            a = a @ a * (1.0 / GEMM_N)
        done = cp.cuda.Event(disable_timing=True)
        done.record(stream)
    return done


def test_a_write_completes_while_the_model_stream_computes(
    cp: Any, sides: tuple[Side, Side]
) -> None:
    p, _ = sides
    keys = prompt_keys(salt=11)
    p_ids = scattered(len(keys), seed=11)
    cp.cuda.runtime.deviceSynchronize()
    model_stream = cp.cuda.Stream(non_blocking=False)  # blocking, like a framework's stream
    gemms_done = busy(cp, model_stream, num_gemms=60)  # about a second on an H100
    written, _, _ = write_blocks(p, keys, p_ids)
    assert written == len(keys)
    assert not gemms_done.done, "the write waited for the model's stream"
    gemms_done.synchronize()


def fill_chunk(cp: Any, stream: Any, cache: list[Any], source: list[Any], ids: list[int]) -> None:
    """A chunk's "prefill" on the model stream: GEMMs, then its blocks' KV written; returns
    when the stream is done, as ModelRunner.run does."""
    busy(cp, stream, num_gemms=8)
    index = cp.asarray(ids)
    with stream:
        for dst, src in zip(cache, source, strict=True):
            dst[index] = src[index]
    stream.synchronize()


def test_chunked_write_beside_the_chunks_compute_is_byte_exact(
    cp: Any, sides: tuple[Side, Side]
) -> None:
    # asyncio.run, not an async test: the GPU image may lack pytest-asyncio
    asyncio.run(chunked_write_beside_compute(cp, *sides))


async def chunked_write_beside_compute(cp: Any, p: Side, d: Side) -> None:
    keys = prompt_keys(salt=12)
    p_ids, d_ids = scattered(len(keys), seed=12), scattered(len(keys), seed=13)
    source = make_cache(cp, seed=12)  # what the prefill computes into P's blocks
    p.kv_caches[:] = make_cache(cp, None)
    d.kv_caches[:] = make_cache(cp, None)
    cp.cuda.runtime.deviceSynchronize()
    model_stream = cp.cuda.Stream(non_blocking=False)
    per_chunk = -(-len(keys) // NUM_CHUNKS)
    parts = [range(i, min(i + per_chunk, len(keys))) for i in range(0, len(keys), per_chunk)]
    chunked = ChunkedWrite(p.pool, p.kv_caches, keys, group_blocks=GROUP_BLOCKS, wait_s=WAIT_S)
    first_part_in_pool_before_last_compute = None
    for k, part in enumerate(parts):
        ids = [p_ids[j] for j in part]
        await asyncio.to_thread(fill_chunk, cp, model_stream, p.kv_caches, source, ids)
        if k == len(parts) - 1:
            first = [keys[j] for j in parts[0]]
            first_part_in_pool_before_last_compute = all(p.pool.exists(first))
        chunked.add(part[0], ids)
    out = await chunked.finish()
    assert (out.num_written, out.num_skipped, out.num_bytes) == (
        len(keys),
        0,
        len(keys) * p.pool.config.slot_bytes,
    )
    assert first_part_in_pool_before_last_compute, "chunk 0 was not written during the prefill"
    assert same_blocks(cp, source, p_ids, p.kv_caches, p_ids)
    loaded, missing, _ = load_blocks(d, keys, d_ids)
    cp.cuda.runtime.deviceSynchronize()
    assert (loaded, missing) == (len(keys), [])
    assert same_blocks(cp, source, p_ids, d.kv_caches, d_ids)
    others = sorted(set(range(CACHE_BLOCKS)) - set(d_ids))
    assert all(bool((t[cp.asarray(others)] == 0xDEAD).all()) for t in d.kv_caches)
