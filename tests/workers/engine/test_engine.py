"""LLMEngine: the step loop, preemption and the PD shapes, first over the numpy stand-in
runner (exact token checks against a reference), then end to end on the tiny Paddle model.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.workers.engine.char_tokenizer import CharTokenizer
from tests.workers.engine.numpy_runner import NumpyRunner, reference_greedy
from tests.workers.engine.tiny_engine import encoded, real_engine, tokens_of
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def make_engine(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 32,
    prefix_cache: bool = True,
) -> LLMEngine:
    config = EngineConfig(
        model="numpy-stand-in",
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=min(64, num_blocks * block_size),
        enable_prefix_cache=prefix_cache,
    )
    return LLMEngine(NumpyRunner(num_blocks, block_size), CharTokenizer(), config, vocab_size=128)


def prompt(n: int, offset: int = 0) -> tuple[int, ...]:
    return tuple(97 + (i * 7 + offset) % 26 for i in range(n))


def test_idle_step_does_nothing() -> None:
    engine = make_engine()
    assert engine.step() == []
    assert engine.last_step_num_tokens == 0
    assert engine.runner.num_runs == 0


def test_greedy_tokens_match_the_reference_through_chunking_and_preemption() -> None:
    engine = make_engine(num_blocks=10, block_size=4, budget=8)
    requests = [EngineRequest(f"r{i}", prompt(3 + 2 * i, i), GREEDY) for i in range(6)]
    results = engine.generate(requests)
    for request in requests:
        outputs = results[request.request_id]
        expected = reference_greedy(list(request.prompt_token_ids), 12)
        assert tokens_of(outputs) == expected
        assert "".join(o.new_text for o in outputs) == "".join(chr(t) for t in expected)
        assert [o.num_output_tokens for o in outputs] == list(range(1, 13))
        assert outputs[-1].finish_reason == "length"
    stats = engine.stats()
    assert stats.num_preemptions_total == 4
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
    assert stats.num_prompt_tokens_total == sum(3 + 2 * i for i in range(6))
    assert stats.num_generation_tokens_total == 6 * 12
    engine.pool.check_integrity()


def test_seeded_sampling_is_the_same_alone_and_in_a_crowd() -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=77)
    alone = make_engine().generate([EngineRequest("s", prompt(5), params)])
    crowded_engine = make_engine(num_blocks=9, block_size=4, budget=6)
    crowd = [EngineRequest(f"c{i}", prompt(4 + i, 3 * i), GREEDY) for i in range(5)]
    crowded = crowded_engine.generate([*crowd, EngineRequest("s", prompt(5), params)])
    assert crowded_engine.stats().num_preemptions_total > 0
    assert tokens_of(crowded["s"]) == tokens_of(alone["s"])
    # The sampled sequence is not simply the greedy one (the sampler did draw).
    assert tokens_of(alone["s"]) != reference_greedy(list(prompt(5)), 12)


@pytest.mark.parametrize("num_computed", [9, 6, 0])
def test_prefill_on_one_engine_decode_on_another(num_computed: int) -> None:
    request_prompt = prompt(9)
    mixed = make_engine().generate([EngineRequest("m", request_prompt, GREEDY)])["m"]

    prefill = make_engine()
    prefill.add_request(EngineRequest("p", request_prompt, GREEDY, prefill_only=True))
    (first,) = prefill.step()
    assert (first.finish_reason, first.block_ids, first.num_output_tokens) == (
        "prefill_done",
        (0, 1, 2),
        1,
    )

    decode = make_engine()
    decode.allocate_blocks(5)  # so that the decode side's block ids differ from P's
    block_ids = decode.allocate_blocks(-(-num_computed // 4))
    # The pool read: copy the KV of positions [0, num_computed) from P's blocks.
    decode.runner.write(block_ids, prefill.runner.read(first.block_ids, num_computed))
    decode.add_request(
        EngineRequest(
            "d",
            request_prompt,
            GREEDY,
            output_token_ids=first.new_token_ids,
            preallocated_block_ids=tuple(block_ids),
            num_computed_tokens=num_computed,
        )
    )
    rest = _drain(decode, "d")
    assert tokens_of([first]) + tokens_of(rest) == tokens_of(mixed)
    assert "".join(o.new_text for o in [first, *rest]) == "".join(o.new_text for o in mixed)
    assert rest[-1].num_output_tokens == 12
    assert decode.pool.num_used == 5
    assert prefill.pool.num_used == 3
    assert prefill.release("p") is True
    assert prefill.pool.num_used == 0


def _drain(engine: LLMEngine, request_id: str) -> list:
    outputs = []
    while engine.has_unfinished():
        outputs.extend(o for o in engine.step() if o.request_id == request_id)
    return outputs


def test_abort_mid_generation_frees_blocks_and_others_continue() -> None:
    engine = make_engine()
    engine.add_request(EngineRequest("a", prompt(6), GREEDY))
    engine.add_request(EngineRequest("b", prompt(7, 1), GREEDY))
    engine.step()
    engine.step()
    out = engine.abort("a")
    assert (out.request_id, out.finish_reason, out.num_output_tokens) == ("a", "abort", 2)
    assert engine.pool.num_used == 2
    rest = _drain(engine, "b")
    assert len(rest) == 10 and rest[-1].finish_reason == "length"
    assert engine.pool.num_used == 0
    assert engine.abort("a") is None


def test_generate_reports_a_blocked_engine() -> None:
    engine = make_engine(num_blocks=4, block_size=4)
    engine.add_request(EngineRequest("p", prompt(12), GREEDY, prefill_only=True))
    engine.step()
    # (Not prompt(8): that is a prefix of "p"'s prompt, whose held blocks it would share.)
    with pytest.raises(RuntimeError, match="engine is blocked"):
        engine.generate([EngineRequest("r", prompt(8, 1), SamplingParams(max_tokens=2))])
    assert engine.release("p")
    outputs = engine.generate([])  # runs "r", queued before the engine blocked
    assert [len(o.new_token_ids) for o in outputs["r"]] == [1, 1]
    assert outputs["r"][-1].finish_reason == "length"
    assert list(outputs) == ["r"]


def test_validate_uses_the_model_vocabulary() -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="token id 128 outside the vocabulary"):
        engine.validate(EngineRequest("v", (1, 128), GREEDY))


def test_free_blocks_returns_unused_preallocation() -> None:
    engine = make_engine(num_blocks=4)
    block_ids = engine.allocate_blocks(3)
    assert block_ids == [0, 1, 2]
    assert engine.allocate_blocks(2) is None
    engine.free_blocks(block_ids)
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_exact_tokens_and_leaks_nothing(
    seed: int, prefix_cache: bool
) -> None:
    """Random arrivals, aborts, prefill-only requests released late, decode-role requests
    with preallocated blocks and requests through prefix leases (device hits, blocks filled
    "from the pool", the rest given back), on a pool small enough to preempt and evict, with
    prompts that share prefixes: every finished request has the reference tokens, the pool
    stays consistent, and every block comes back."""
    rng = np.random.default_rng(seed)
    engine = make_engine(
        num_blocks=10, block_size=4, max_num_seqs=6, budget=10, prefix_cache=prefix_cache
    )
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    held: list[str] = []
    for step_index in range(400):
        if step_index < 120 and rng.random() < 0.4:
            rid = f"q{step_index}"
            kind = rng.choice(["mixed", "prefill", "decode", "lease"])
            request_prompt = prompt(int(rng.integers(1, 14)), int(rng.integers(0, 4)))
            max_tokens = int(rng.integers(1, 16))
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            reference = reference_greedy(list(request_prompt), max_tokens)
            if kind == "mixed":
                engine.add_request(EngineRequest(rid, request_prompt, params))
                expected[rid] = reference
            elif kind == "prefill":
                engine.add_request(EngineRequest(rid, request_prompt, params, prefill_only=True))
                expected[rid] = reference[:1]
            elif kind == "lease":
                if not _add_through_a_lease(engine, rng, rid, request_prompt, params):
                    continue
                expected[rid] = reference
            elif max_tokens > 1:
                num_computed = int(rng.integers(0, len(request_prompt) + 1))
                block_ids = engine.allocate_blocks(-(-num_computed // 4))
                if block_ids is None:
                    continue
                engine.runner.write(block_ids, list(request_prompt[:num_computed]))
                engine.add_request(
                    EngineRequest(
                        rid,
                        request_prompt,
                        params,
                        output_token_ids=(reference[0],),
                        preallocated_block_ids=tuple(block_ids),
                        num_computed_tokens=num_computed,
                    )
                )
                expected[rid] = reference
                got[rid] = [reference[0]]
        live = list(engine.scheduler.requests)
        if live and rng.random() < 0.05:
            victim = live[int(rng.integers(0, len(live)))]
            engine.abort(victim)
            for record in (expected, got, finish):
                record.pop(victim, None)
            if victim in held:
                held.remove(victim)
        if held and rng.random() < 0.2:
            assert engine.release(held.pop(0))
        for out in engine.step():
            if out.request_id not in expected:
                continue
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
                if out.finish_reason == "prefill_done" or out.block_ids:
                    held.append(out.request_id)
        engine.pool.check_integrity()
        if step_index >= 120 and not engine.has_unfinished() and not held:
            break
    assert not engine.has_unfinished() and not held
    assert engine.pool.num_used == 0
    stats = engine.stats()
    assert stats.num_preemptions_total > 0  # the workload does exercise preemption
    # ... and the cache: device hits, and lease blocks filled "from the pool".
    assert (stats.num_prompt_tokens_device_hit_total > 0) is prefix_cache
    assert stats.num_prompt_tokens_given_cached_total > 0
    assert (stats.num_kv_blocks_cached > 0) is prefix_cache
    assert set(finish) == set(expected)
    for rid, tokens in expected.items():
        assert got[rid] == tokens, rid


def _add_through_a_lease(
    engine: LLMEngine, rng: np.random.Generator, rid: str, request_prompt, params
) -> bool:
    """What a prefill worker with a pool does: take the device hits and fresh blocks, fill
    some of those from the pool, give back the rest, add. Sometimes it gives up instead."""
    lease = engine.acquire_prefix(request_prompt, int(rng.integers(0, 4)))
    if lease is None:
        return False
    if rng.random() < 0.2:
        engine.release_lease(lease)
        return False
    lease = engine.trim_lease(lease, int(rng.integers(0, len(lease.extra_block_ids) + 1)))
    filled = list(request_prompt[: lease.num_computed_tokens])
    engine.runner.write(list(lease.block_ids), filled, start_pos=lease.num_device_cached_tokens)
    engine.add_request(
        EngineRequest(
            rid,
            request_prompt,
            params,
            preallocated_block_ids=lease.block_ids,
            num_computed_tokens=lease.num_computed_tokens,
            num_cached_tokens=lease.num_computed_tokens,
        )
    )
    return True


# ---- end to end on the tiny Paddle model -----------------------------------------------


LONG = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TEXTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog",
    "a",
    "Paged attention reads blocks",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "tiny",
    "What is the capital of France? It is",
    "zz",
]


def test_real_model_greedy_alone_equals_in_a_batch_of_8(loaded) -> None:
    requests = [EngineRequest(f"r{i}", encoded(loaded, t), LONG) for i, t in enumerate(TEXTS)]
    together = real_engine(loaded, budget=24).generate(requests)
    for request in requests:
        alone = real_engine(loaded).generate([request])
        assert tokens_of(together[request.request_id]) == tokens_of(alone[request.request_id])
        assert len(tokens_of(alone[request.request_id])) == 16


def test_real_model_preemption_resumes_with_the_same_tokens(loaded) -> None:
    requests = [EngineRequest(f"r{i}", encoded(loaded, t), LONG) for i, t in enumerate(TEXTS)]
    roomy = real_engine(loaded).generate(requests)
    tight_engine = real_engine(loaded, num_blocks=24, budget=16)
    tight = tight_engine.generate(requests)
    assert tight_engine.stats().num_preemptions_total > 0
    for request in requests:
        rid = request.request_id
        assert tokens_of(tight[rid]) == tokens_of(roomy[rid])
        assert "".join(o.new_text for o in tight[rid]) == "".join(o.new_text for o in roomy[rid])
    tight_engine.pool.check_integrity()
    assert tight_engine.pool.num_used == 0


@pytest.mark.parametrize(
    "params",
    [LONG, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)],
    ids=["greedy", "seeded"],
)
def test_real_model_prefill_and_decode_on_two_engines(loaded, params) -> None:
    import paddle

    request_prompt = encoded(loaded, "Disaggregated serving splits prefill from decode")
    mixed = real_engine(loaded).generate([EngineRequest("m", request_prompt, params)])["m"]

    prefill = real_engine(loaded)
    prefill.add_request(EngineRequest("p", request_prompt, params, prefill_only=True))
    (first,) = prefill.step()
    assert first.finish_reason == "prefill_done"
    assert len(first.block_ids) == -(-len(request_prompt) // 4)

    decode = real_engine(loaded)
    decode.allocate_blocks(3)  # different block ids on the decode side
    block_ids = decode.allocate_blocks(len(first.block_ids))
    src = paddle.to_tensor(list(first.block_ids), dtype="int64")
    dst = paddle.to_tensor(block_ids, dtype="int64")
    for src_cache, dst_cache in zip(prefill.kv_caches, decode.kv_caches, strict=True):
        # [num_blocks, kv_heads, bs, dim]: what the pool read does through swap_cache_layout
        paddle.scatter_(dst_cache, dst, paddle.gather(src_cache, src))
    decode.add_request(
        EngineRequest(
            "d",
            request_prompt,
            params,
            output_token_ids=first.new_token_ids,
            preallocated_block_ids=tuple(block_ids),
            num_computed_tokens=len(request_prompt),
        )
    )
    rest = _drain(decode, "d")
    assert tokens_of([first, *rest]) == tokens_of(mixed)
    assert first.new_text + "".join(o.new_text for o in rest) == "".join(o.new_text for o in mixed)
    assert prefill.release("p") and prefill.pool.num_used == 0


def test_real_model_stop_string_cuts_the_text(loaded) -> None:
    request_prompt = encoded(loaded, "The quick brown fox")
    full = real_engine(loaded).generate([EngineRequest("f", request_prompt, LONG)])["f"]
    text = "".join(o.new_text for o in full)
    stop = text[5:8]
    assert len(stop) == 3
    cut_at = text.find(stop)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,))
    stopped = real_engine(loaded).generate([EngineRequest("s", request_prompt, params)])["s"]
    assert "".join(o.new_text for o in stopped) == text[:cut_at]
    assert stopped[-1].finish_reason == "stop"
