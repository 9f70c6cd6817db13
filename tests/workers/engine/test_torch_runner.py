"""TorchModelRunner (fp32) equals the Paddle ModelRunner step for step: logits within 1e-4 on
the CPU (1e-3 on a GPU, marker gpu) and greedy tokens exactly, on the tiny model and the
packaged demo model, through chunked prefill, a prefix-cache hit (a chunk starting
mid-sequence over blocks another sequence computed), decode batches of mixed lengths, a fork's
copy_blocks, prompt logprobs rows and a sliding window; its cache has the Paddle cache's
layout, is written only where scheduled and updated in place. Runs wherever torch is installed
(make test leaves it out: marker torch); where Paddle is not (the GPU machine) the reference is
the torch runner on the CPU (twin_runners.py)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from tests.workers.engine.twin_runners import TwinRunners, paddle_installed
from workers.engine.batch import ScheduledBatch, ScheduledChunk
from workers.engine.loader import load_model
from workers.engine.tiny import TinySpec, write_checkpoint

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

BLOCK_SIZE = 4
NUM_BLOCKS = 96
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def _prompt(n: int, vocab: int, seed: int) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(0, vocab, size=n).tolist())


def _blocks(i: int) -> tuple[int, ...]:
    return tuple(range(i * 12, i * 12 + 12))  # 48 positions per sequence


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("tiny", "cpu"), id="tiny-cpu"),
        pytest.param(("demo", "cpu"), id="demo-cpu"),
        pytest.param(("tiny", "gpu"), id="tiny-gpu", marks=pytest.mark.gpu),
        pytest.param(("demo", "gpu"), id="demo-gpu", marks=pytest.mark.gpu),
    ],
)
def twins(request, tmp_path_factory) -> TwinRunners:
    model, device = request.param
    if device == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU visible to torch")
    cache_dir = str(tmp_path_factory.mktemp("cache"))
    return TwinRunners.load(model, cache_dir, NUM_BLOCKS, BLOCK_SIZE, device)


def _fresh(twins: TwinRunners) -> TwinRunners:
    """The module's runners with zeroed caches (weights are shared, loading is slow)."""
    twins.zero_caches()
    return twins


def test_chunked_prefill_then_mixed_length_decode(twins):
    twins = _fresh(twins)
    vocab = twins.reference.vocab_size
    prompts = [_prompt(n, vocab, seed) for seed, n in enumerate((23, 5, 12, 1))]
    seqs = [list(p) for p in prompts]
    computed = [0, 0, 0, 0]

    def step(plan: list[tuple[int, int, bool]]) -> None:
        """plan: (sequence, end position of its chunk, whether it samples)."""
        chunks = []
        for i, end, need in plan:
            tokens = tuple(seqs[i][computed[i] : end])
            chunks.append(ScheduledChunk(str(i), tokens, computed[i], _blocks(i), need))
            computed[i] = end
        out = twins.run(ScheduledBatch(tuple(chunks)))
        sampled = [i for i, _, need in plan if need]
        assert out.logits.shape == (len(sampled), vocab)
        for row, i in enumerate(sampled):
            seqs[i].append(int(np.argmax(out.logits[row])))

    # Prompt 0 in three chunks (8, 8, 7 tokens: the later ones start mid-sequence over its
    # cached first ones) beside whole prompts 1 and 2, then prompt 3 and decodes.
    step([(0, 8, False), (1, 5, True), (2, 12, True)])
    step([(0, 16, False), (1, 6, True), (2, 13, True), (3, 1, True)])
    step([(0, 23, True), (1, 7, True), (2, 14, True), (3, 2, True)])
    for _ in range(6):  # four decodes of four different lengths in one group
        step([(i, len(seqs[i]), True) for i in range(4)])
    assert [len(s) - len(p) for s, p in zip(seqs, prompts, strict=True)] == [7, 9, 9, 8]
    twins.assert_caches_agree()


def test_prefix_cache_hit_attends_to_blocks_another_sequence_computed(twins):
    twins = _fresh(twins)
    vocab = twins.reference.vocab_size
    shared = _prompt(8, vocab, 7)  # two full blocks
    a = shared + _prompt(5, vocab, 8)
    b = shared + _prompt(6, vocab, 9)
    twins.run(ScheduledBatch((ScheduledChunk("a", a, 0, _blocks(0), True),)))
    # b's table starts with a's two blocks (a device prefix hit); only tokens 8.. are computed.
    table = (*_blocks(0)[:2], *_blocks(1)[2:])
    hit = twins.run(ScheduledBatch((ScheduledChunk("b", b[8:], 8, table, True),)))
    # The same logits as b computed whole, on its own blocks.
    whole = twins.run(ScheduledBatch((ScheduledChunk("b2", b, 0, _blocks(2), True),)))
    np.testing.assert_allclose(hit.logits, whole.logits, atol=twins.bound, rtol=0)
    twins.assert_caches_agree()


def test_fork_copies_the_partial_block_before_writing(twins):
    """n > 1: sequence 1 forks from the prompt's blocks; its first chunk copies the prompt's
    partial last block (block_copy) and decodes into the copy."""
    twins = _fresh(twins)
    vocab = twins.reference.vocab_size
    prompt = _prompt(10, vocab, 3)  # blocks of 4: the third is partial (2 tokens)
    parent = _blocks(0)[:3]
    twins.run(ScheduledBatch((ScheduledChunk("p", prompt, 0, parent, True),)))
    child = (*parent[:2], 50)
    batch = ScheduledBatch((
        ScheduledChunk("p", (11,), 10, parent, True),
        ScheduledChunk("c", (12,), 10, child, True, block_copy=(parent[2], 50)),
    ))  # fmt: skip
    out = twins.run(batch)
    assert out.logits.shape == (2, vocab)
    for cache in twins.torch.kv_caches:  # rows 0-1 copied from the parent's block, row 2 its own
        assert torch.equal(cache[50, :, :2], cache[parent[2], :, :2])
        assert not torch.equal(cache[50, :, 2], cache[parent[2], :, 2])
    twins.assert_caches_agree()


def test_prompt_logprobs_rows(twins):
    twins = _fresh(twins)
    vocab = twins.reference.vocab_size
    p, q = _prompt(9, vocab, 4), _prompt(6, vocab, 5)
    batch = ScheduledBatch((
        ScheduledChunk("p", p, 0, _blocks(0), True, prompt_logprobs=True),
        ScheduledChunk("q", q, 0, _blocks(1), True),
    ))  # fmt: skip
    out = twins.run(batch)
    assert out.logits.shape == (2, vocab)
    assert [r.shape for r in out.prompt_logits] == [(9, vocab)]
    # The prompt's last row is the sampled row (one GEMM of more rows: the last bits may differ).
    np.testing.assert_allclose(out.prompt_logits[0][-1], out.logits[0], atol=1e-5, rtol=0)
    # A later chunk of a prompt with logprobs: its rows only (chunked prefill).
    out = twins.run(ScheduledBatch((
        ScheduledChunk("p", (3, 4, 5), 9, _blocks(0), True, prompt_logprobs=True),
    )))  # fmt: skip
    assert [r.shape for r in out.prompt_logits] == [(3, vocab)]


def test_cache_layout_placement_and_in_place_updates(twins):
    twins = _fresh(twins)
    runner = twins.torch
    c = runner.config
    assert len(runner.kv_caches) == 2 * c.num_layers
    for t in runner.kv_caches:
        assert tuple(t.shape) == (NUM_BLOCKS, c.num_kv_heads, BLOCK_SIZE, c.head_dim)
        assert t.dtype == torch.float32 and t.is_contiguous()
    assert t.device.type == ("cpu" if runner.device == "cpu" else "cuda")
    assert runner.kv_cache.total_bytes == twins.reference.kv_cache.total_bytes
    before = [t.data_ptr() for t in runner.kv_caches]
    out = runner.run(ScheduledBatch((ScheduledChunk("r", (1, 2, 3, 4, 5, 6), 0, (5, 2), False),)))
    assert out.logits.shape == (0, runner.vocab_size)
    assert [t.data_ptr() for t in runner.kv_caches] == before
    for t in runner.kv_caches:
        written = {(b, r) for b in range(NUM_BLOCKS) for r in range(BLOCK_SIZE)
                   if bool(t[b, :, r, :].any())}  # fmt: skip
        assert written == {(5, 0), (5, 1), (5, 2), (5, 3), (2, 0), (2, 1)}


def test_errors_name_the_request(twins):
    runner = twins.torch
    with pytest.raises(ValueError, match="'r1': 1 blocks cannot hold"):
        runner.run(ScheduledBatch((ScheduledChunk("r1", (1, 2, 3, 4, 5), 0, (0,), True),)))
    positions = NUM_BLOCKS * BLOCK_SIZE
    chunk = ScheduledChunk("r", (1,), positions, (*range(NUM_BLOCKS), 0), True)
    with pytest.raises(ValueError, match=f"position {positions} beyond the {positions} positions"):
        runner.run(ScheduledBatch((chunk,)))
    empty = runner.run(ScheduledBatch(()))
    assert empty.logits.shape == (0, runner.vocab_size) and empty.logits.dtype == np.float32


@pytest.mark.parametrize(
    "spec",
    [
        TinySpec(model_type="qwen2", tie_word_embeddings=True, num_kv_heads=1),
        TinySpec(attention_bias=True, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        TinySpec(model_type="mistral", head_dim=32, rope_scaling={"type": "linear", "factor": 2.0}),
        TinySpec(model_type="mistral", extra_config={"sliding_window": 5}),
    ],
    ids=["qwen2_tied_mqa", "llama3_rope_bias", "mistral_linear_headdim", "mistral_window"],
)  # fmt: skip
@pytest.mark.parametrize("device", DEVICES)
def test_architectures_agree(spec, device, tmp_path):
    if device == "cpu" and not paddle_installed():
        pytest.skip("compares with the Paddle runner (not installed)")
    if device == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU visible to torch")
    write_checkpoint(tmp_path, spec, seed=5)
    twins = TwinRunners.load(str(tmp_path), str(tmp_path), 32, BLOCK_SIZE, device)
    vocab = twins.reference.vocab_size
    a, b = _prompt(11, vocab, 1), _prompt(7, vocab, 2)
    out = twins.run(ScheduledBatch((
        ScheduledChunk("a", a[:6], 0, tuple(range(0, 8)), True),
        ScheduledChunk("b", b, 0, tuple(range(8, 16)), True),
    )))  # fmt: skip
    twins.run(ScheduledBatch((
        ScheduledChunk("a", a[6:], 6, tuple(range(0, 8)), True),
        ScheduledChunk("b", (int(np.argmax(out.logits[1])),), 7, tuple(range(8, 16)), True),
    )))  # fmt: skip
    twins.assert_caches_agree()


def test_half_precision_on_cpu_keeps_the_layout(tmp_path):
    """bf16 runs on torch's CPU (Paddle's CPU kernels refuse it): the cache is bf16 in the
    same layout, and greedy tokens mostly agree with fp32 (a smoke check; exactness is fp32's)."""
    from workers.engine.torch_runner import TorchModelRunner

    runners = {
        dtype: TorchModelRunner(load_model("demo", dtype=dtype, framework="torch"), 16, 16)
        for dtype in ("float32", "bfloat16")
    }
    assert runners["bfloat16"].kv_caches[0].dtype == torch.bfloat16
    assert runners["bfloat16"].kv_cache.total_bytes * 2 == runners["float32"].kv_cache.total_bytes
    prompt = _prompt(20, runners["float32"].vocab_size, 0)
    argmax = {}
    for dtype, runner in runners.items():
        out = runner.run(ScheduledBatch((ScheduledChunk("r", prompt, 0, (0, 1), True,
                                                        prompt_logprobs=True),)))  # fmt: skip
        argmax[dtype] = np.argmax(out.prompt_logits[0], axis=-1)
    assert float(np.mean(argmax["float32"] == argmax["bfloat16"])) >= 0.8


def test_torch_runner_refuses_paddle_weights(tmp_path):
    from workers.engine.torch_runner import TorchModelRunner

    pytest.importorskip("paddle")
    loaded = load_model("tiny", cache_dir=str(tmp_path))
    with pytest.raises(TypeError, match=re.escape("load_model(..., framework='torch')")):
        TorchModelRunner(loaded, 4, 4)
    assert dataclasses.replace(loaded, weights={}).weights == {}


def test_causal_paths_never_build_the_explicit_mask(twins):
    """A fresh prompt and a later chunk go through SDPA's causal kernels: their groups' masks
    (S * L * ctx entries: 1 GiB of floats for a 16K prompt) are never built; a decode's is,
    as booleans only (the float mask_bias is the Paddle decoder's)."""
    from workers.engine.step_input import build_step_input

    batch = ScheduledBatch((
        ScheduledChunk("fresh", tuple(range(1, 12)), 0, _blocks(0), True),
        ScheduledChunk("tail", tuple(range(1, 6)), 8, _blocks(1), True),
        ScheduledChunk("decode", (7,), 20, _blocks(2), True),
    ))  # fmt: skip
    step = build_step_input(batch, BLOCK_SIZE, NUM_BLOCKS)
    prepared = twins.torch.model.prepare(step)
    assert [(g.query_len, g.path) for g in prepared.groups] == [
        (1, "masked"), (5, "tail"), (11, "fresh")]  # fmt: skip
    built = ["allowed" in vars(g) for g in step.groups]
    assert built == [True, False, False]
    assert not any("mask_bias" in vars(g) for g in step.groups)
