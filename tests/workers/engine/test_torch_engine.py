"""The whole LLMEngine (scheduler, block pool, prefix cache, host tier, sampler, penalties,
logprobs, groups) on the torch backend answers as on the Paddle backend: the same tokens, the
same cache hits, logprobs within 1e-4. Built through LLMEngine.from_config (the factory a
worker uses); a torch engine process never imports Paddle and a Paddle one never torch."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.repo import REPO_ROOT
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig

torch = pytest.importorskip("torch")
# Compares with the Paddle engine: skipped where Paddle is not installed (the GPU machine; there
# test_torch_demo_exactness.py holds the torch engine to recorded Paddle answers).
pytest.importorskip("paddle", reason="compares with the Paddle engine (not installed)")
pytestmark = pytest.mark.torch

BLOCK_SIZE = 4
NUM_BLOCKS = 24
SLOT_BYTES = 2 * 2 * 2 * BLOCK_SIZE * 16 * 4  # tiny: layers x (K, V) x kv heads x bs x dim x 4


def _engine(backend: str, cache_dir: str, swap_blocks: int = 0) -> LLMEngine:
    config = EngineConfig(
        model="tiny", cache_dir=cache_dir, engine_backend=backend, block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=16, max_num_seqs=8,
        swap_space_gib=swap_blocks * SLOT_BYTES / 2**30, write_policy="write_through",
    )  # fmt: skip
    return LLMEngine.from_config(config)


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(3, 200, size=n).tolist())


def _requests() -> list[EngineRequest]:
    greedy = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, num_logprobs=2)
    shared = _prompt(12, 1)
    return [
        EngineRequest("long", _prompt(37, 0), greedy),  # chunked: 16-token prefill budget
        EngineRequest("short", _prompt(3, 2), greedy),
        EngineRequest("prefix", shared, greedy),
        EngineRequest(
            "seeded",
            _prompt(9, 3),
            SamplingParams(
                max_tokens=6,
                temperature=0.8,
                top_p=0.9,
                seed=7,
                ignore_eos=True,
                presence_penalty=0.5,
                repetition_penalty=1.2,
            ),
        ),
        EngineRequest(
            "group",
            _prompt(10, 4),
            SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True),
            sequence_seeds=(11, 12, 13),  # n=3: forks copy the prompt's partial block
        ),
        EngineRequest(
            "scored",
            _prompt(8, 5),
            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
        ),
    ]


def _summary(outputs: dict) -> dict:
    return {
        rid: [(o.new_token_ids, o.finish_reason, o.num_cached_tokens) for o in outs]
        for rid, outs in outputs.items()
    }


def _logprobs(outputs: dict) -> list[float]:
    """Every sampled token's log probability and its top ones', then the prompt logprobs'."""
    sampled = [lp for outs in outputs.values() for o in outs for lp in o.new_logprobs]
    prompt = [lp for outs in outputs.values() for o in outs for lp in o.prompt_logprobs or ()]
    return [x for lp in sampled + prompt for x in (lp.logprob, *(v for _, v in lp.top))]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tiny-cache"))


def test_same_tokens_hits_and_logprobs_on_both_backends(cache_dir):
    results = {}
    for backend in ("paddle", "torch"):
        engine = _engine(backend, cache_dir)
        assert engine.runner.backend == backend
        first = engine.generate(_requests())
        # A second round of the shared prompt under a new id: a device prefix-cache hit.
        again = engine.generate([dataclasses.replace(_requests()[2], request_id="prefix2")])
        results[backend] = (first, again, engine.stats())
    (p_first, p_again, p_stats), (t_first, t_again, t_stats) = results["paddle"], results["torch"]
    assert _summary(t_first) == _summary(p_first)
    assert _summary(t_again) == _summary(p_again)
    # Two of its three full blocks from the device: the last token (in block 3) is computed.
    assert t_again["prefix2"][0].num_cached_tokens == 8
    np.testing.assert_allclose(_logprobs(t_first), _logprobs(p_first), atol=1e-4, rtol=0)
    # 3 greedy requests x 7 tokens x (sampled + top 2), then scored's 8 prompt tokens (the
    # first has no logprob; each other its own + top 2).
    assert len(_logprobs(t_first)) == 3 * 7 * 3 + 7 * 3
    assert t_stats.num_prompt_tokens_device_hit_total == p_stats.num_prompt_tokens_device_hit_total


def test_host_tier_swaps_torch_blocks_out_and_back(cache_dir):
    """Blocks copied to the host tier by the swap kernel from torch CPU tensors, evicted from
    the device, zeroed there, then swapped back in for the same prompt: the same answer."""
    answers = {}
    for backend in ("paddle", "torch"):
        engine = _engine(backend, cache_dir, swap_blocks=16)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        prompt = _prompt(13, 9)
        first = engine.generate([EngineRequest("a", prompt, params)])["a"]
        engine.pool.free(sorted(engine.pool.allocate(NUM_BLOCKS)))  # evict every cached block
        assert engine.pool.num_cached == 0
        for tensor in engine.kv_caches:
            tensor.zero_()  # torch and Paddle tensors alike
        second = engine.generate([EngineRequest("b", prompt, params)])["b"]
        assert [o.new_token_ids for o in second] == [o.new_token_ids for o in first]
        assert second[0].num_host_cached_tokens == 12
        answers[backend] = [o.new_token_ids for o in second]
    assert answers["torch"] == answers["paddle"]


_PROBE = textwrap.dedent(
    """
    import sys
    from workers.engine.engine import LLMEngine
    from workers.engine.engine_config import EngineConfig
    from workers.engine.api import EngineRequest, SamplingParams
    engine = LLMEngine.from_config(EngineConfig(model="tiny", cache_dir=sys.argv[2],
                                                engine_backend=sys.argv[1], num_kv_blocks=16))
    out = engine.generate([EngineRequest("r", (5, 6, 7), SamplingParams(max_tokens=3,
                                                                         temperature=0.0))])
    print(len(out["r"]), "paddle" in sys.modules, "torch" in sys.modules)
    """
)


@pytest.mark.parametrize(("backend", "expected"), [("torch", "3 False True"),
                                                   ("paddle", "3 True False")])  # fmt: skip
def test_a_process_imports_only_its_backends_framework(backend, expected, cache_dir):
    if backend == "paddle":
        pytest.importorskip("paddle")
    # The repository first, then whatever path this process was given (a GPU host's carried
    # wheels live there).
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, backend, cache_dir], capture_output=True, text=True,
        timeout=300, cwd=REPO_ROOT, env={"PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == expected
