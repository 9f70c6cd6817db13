"""A Scheduler with prefix caching on over a tiny pool, and readers of its exact state, for the
device prefix cache tests (test_prefix_cache.py, test_prefix_lease.py)."""

from __future__ import annotations

from tests.workers.engine.char_tokenizer import CharDetokenizer
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.block_pool import BlockPool
from workers.engine.request_validation import RequestLimits
from workers.engine.scheduler import Scheduler
from workers.pool.keys import block_hashes

A, X = ord("a"), ord("x")
FP = "prefix-cache-test"


def make(
    num_blocks: int = 8, block_size: int = 4, budget: int = 64, caching: bool = True
) -> Scheduler:
    limits = RequestLimits(block_size, num_blocks, max_model_len=64, vocab_size=128)
    return Scheduler(
        BlockPool(num_blocks, enable_caching=caching),
        limits,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        eos_token_ids=(0,),
        new_detokenizer=CharDetokenizer,
        new_seed=lambda: 4242,
        fingerprint=FP if caching else "",
    )


def tokens(n: int, offset: int = 0) -> tuple[int, ...]:
    return tuple(A + (i + offset) % 26 for i in range(n))


def req(rid: str, prompt: tuple[int, ...], max_tokens: int = 8, **kwargs) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), **kwargs)


def full_hashes(sequence: tuple[int, ...], block_size: int = 4) -> list[str]:
    """The pool keys' hashes of the sequence's full blocks: what the device cache uses."""
    return block_hashes(FP, sequence, block_size)[: len(sequence) // block_size]


def view(batch) -> list[tuple]:
    return [(c.request_id, len(c.token_ids), c.start_pos, c.block_ids) for c in batch.chunks]


def step(s: Scheduler, token: int = X) -> tuple[list, dict]:
    batch = s.schedule()
    outputs = s.update(batch, [token] * sum(c.need_logits for c in batch.chunks))
    s.pool.check_integrity()
    return view(batch), {o.request_id: o for o in outputs}


def refs(s: Scheduler, block_ids) -> list[int]:
    return [s.pool.ref_count(b) for b in block_ids]


def sources(s: Scheduler) -> tuple[int, int, int, int]:
    t = s.prompt_token_sources
    return (t.device_hit, t.given_cached, t.loaded, t.computed)
