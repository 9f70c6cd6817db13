#!/usr/bin/env bash
# What this project runs on a GPU host with PyTorch but without network or Paddle (the device
# machine here), in three parts that each fit one 10-minute call. From the repository root:
#     bash benchmarks/gpu/pack.sh .gpu               # here, once (the carry folder)
#     bash benchmarks/gpu/run_on_gpu.sh tests OUT    # there: every gpu/torch test
#     bash benchmarks/gpu/run_on_gpu.sh e2e OUT      # there: the e2e suite on torch + GPU
#     bash benchmarks/gpu/run_on_gpu.sh bench OUT    # there: runner, handoff, serving tables
# OUT receives the logs and the tables (docs/benchmarks/gpu.md sections).
set -uo pipefail
step=${1:?usage: run_on_gpu.sh quick|tests|e2e|bench OUT}
out=${2:?usage: run_on_gpu.sh quick|tests|e2e|bench OUT}
mkdir -p "$out"
source benchmarks/gpu/env.sh .gpu || exit 1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 MC_LOG_LEVEL=ERROR GLOG_minloglevel=2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__)' | tee -a "$out/gpu.txt"
model=/tmp/llama8b
case $step in
quick)
    # The torch engine's gpu/torch tests, the runner table, and the e2e modules that start a
    # reference worker of their own (auto backend) plus tests/e2e/gpu.
    python3 -m pytest -q -p no:randomly -p no:cacheprovider -m "gpu or torch" \
        tests/workers/engine tests/e2e/gpu 2>&1 | tee "$out/tests.log"
    python3 -m benchmarks.gpu.checkpoint "$model" 2>&1 | tee "$out/bench.log"
    python3 -m benchmarks.gpu.runner_bench --model "$model" --output "$out/gpu.md" 2>&1 \
        | tee -a "$out/bench.log"
    PDROUTER_TEST_WORKER_ARGS="--engine-backend torch --device gpu" python3 -m pytest -q \
        -p no:randomly -p no:cacheprovider -m "not soak" --timeout 300 \
        tests/e2e/cache/test_cache_exact.py tests/e2e/cache/test_cache_host_tier.py 2>&1 \
        | tee "$out/e2e.log"
    ;;
tests)
    python3 -m pytest -q -p no:randomly -p no:cacheprovider -m "gpu or torch" --continue-on-collection-errors \
        tests/kernels tests/workers/engine tests/workers/handoff tests/e2e/gpu \
        tests/e2e/pd/test_torch_backend.py 2>&1 | tee "$out/tests.log"
    ;;
e2e)
    # The CPU suite's clusters with every worker on the torch runner on this GPU; the one test
    # that asserts CPU workers' host path is left out (tests/e2e/gpu asserts the device path).
    PDROUTER_TEST_WORKER_ARGS="--engine-backend torch --device gpu" python3 -m pytest -q \
        -p no:randomly -p no:cacheprovider -m "not soak" --timeout 300 \
        --deselect tests/e2e/pd/test_pd_handoff.py::test_router_models_and_health_reflect_the_cluster \
        tests/e2e/pd/test_demo_model_pd.py tests/e2e/pd/test_pd_equivalence.py \
        tests/e2e/pd/test_pd_choices.py tests/e2e/pd/test_pd_handoff.py \
        tests/e2e/cache/test_cache_exact.py tests/e2e/cache/test_cache_host_tier.py \
        tests/e2e/chaos/test_worker_faults.py 2>&1 | tee "$out/e2e.log"
    ;;
bench)
    python3 -m benchmarks.gpu.checkpoint "$model" 2>&1 | tee "$out/bench.log"
    python3 -m benchmarks.gpu.runner_bench --model "$model" --output "$out/gpu.md" 2>&1 \
        | tee -a "$out/bench.log"
    python3 -m benchmarks.gpu.serving --model "$model" --reps 2 --log-dir /tmp/serving-logs \
        --output "$out/gpu.md" 2>&1 | tee -a "$out/bench.log" \
        || tail -n 40 /tmp/serving-logs/*.log > "$out/serving_tail.txt"
    python3 -m benchmarks.handoff.chunked --model "$model" --tokens 4096,16384 --chunks 512 \
        --block-sizes 64 --paths device --reps 2 --output "$out/handoff_model.md" 2>&1 \
        | tee -a "$out/bench.log"
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
