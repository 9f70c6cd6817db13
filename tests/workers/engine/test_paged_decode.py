"""The Triton paged decode kernel (--decode-attention triton) equals SDPA over the gathered
context, alone and inside the torch runner (eager and through DecodeGraphs' padded steps): on
the CPU under Triton's interpreter (a subprocess: TRITON_INTERPRET must be set before triton
is imported), on a GPU compiled (marker gpu), bfloat16 there too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.repo import REPO_ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.torch


def test_interpreted_on_the_cpu():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "tests.workers.engine.paged_decode_check"],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["kernel_float32"]) == 4 and max(report["kernel_float32"]) < 1e-5
    for run in ("runner", "runner_padded"):
        assert report[run]["tokens_agree"] is True
        assert report[run]["max_logits_diff"] < 1e-4  # measured 1.4e-5


@pytest.mark.gpu
def test_compiled_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU visible to torch")
    from tests.workers.engine.paged_decode_check import kernel_errors, runner_agreement

    assert max(kernel_errors("cuda", torch.float32)) < 1e-4
    assert max(kernel_errors("cuda", torch.bfloat16)) < 5e-2  # bf16 inputs vs an fp32 reference
    for graphs in (False, True):
        report = runner_agreement("gpu", cuda_graphs=graphs)
        assert report["tokens_agree"] is True, graphs
        assert report["max_logits_diff"] < 1e-3, (graphs, report)


def test_unsupported_shapes_are_refused_by_name(tmp_path):
    from workers.engine.loader import load_model
    from workers.engine.torch_runner import TorchModelRunner

    loaded = load_model("tiny", cache_dir=str(tmp_path), framework="torch")
    with pytest.raises(ValueError) as err:
        TorchModelRunner(loaded, 8, 4, decode_attention="triton")
    assert str(err.value) == (
        "--decode-attention triton needs a power-of-two --block-size >= 16 (got 4), a "
        "power-of-two head_dim (got 16) and no sliding window (got None)"
    )
