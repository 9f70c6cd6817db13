# Every target installs what it needs first: `make demo` and `make test` work as the first
# command on a fresh Debian machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS ?= cpu,dev
# Several Paddle processes on 2 cores oversubscribe threads: one thread each unless told otherwise.
export OMP_NUM_THREADS ?= 1
export MC_LOG_LEVEL ?= ERROR
export GLOG_minloglevel ?= 2

.PHONY: install install-gpu install-torch test-gpu sysdeps sysdeps-gpu test test-fast test-soak test-all test-clients lint format demo bench bench-storage bench-kernels \
	bench-handoff bench-engine bench-server bench-pd bench-multihost bench-pool-sizing bench-router \
	bench-router-path bench-upstream bench-serving bench-cache bench-cache-skew bench-cache-defaults \
	bench-host-tier-gpu bench-gpu \
	bench-pd-paths bench-serving-matrix bench-priority bench-structured test-litellm clean

install: $(STAMP)

# Mooncake needs libibverbs1 and librdmacm1 even for TCP.
sysdeps:
	@if ldconfig -p | grep -q 'libibverbs.so.1' && ldconfig -p | grep -q 'librdmacm.so.1'; then \
		true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian packages libibverbs1 librdmacm1"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 librdmacm1; \
	else \
		echo "Mooncake needs libibverbs1 and librdmacm1; run: sudo apt-get install -y libibverbs1 librdmacm1"; \
		exit 1; \
	fi

$(STAMP): pyproject.toml | sysdeps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@touch $(STAMP)

# A GPU host (NVIDIA driver for CUDA 12.6 or newer). Paddle publishes its 3.x GPU wheels on its
# own index (PyPI has paddlepaddle-gpu 2.6 at most), so the `gpu` extra does not name it: it is
# installed from PADDLE_GPU_INDEX first. Then the `gpu` extra: Mooncake's CUDA wheel (the
# device-pointer handoff), CuPy, and libcudart.so.12 (nvidia-cuda-runtime-cu12), which the
# Mooncake binaries load by name: its folder is registered with ldconfig (as root) unless the
# system has one already. The Debian libraries the CUDA wheel links come from sysdeps-gpu.
PADDLE_GPU_VERSION ?= 3.2.0
PADDLE_GPU_INDEX ?= https://www.paddlepaddle.org.cn/packages/stable/cu126/
GPU_EXTRAS ?= gpu,dev
# The model runner's framework on the GPU (--engine-backend): paddle (paddlepaddle-gpu from
# Paddle's index, as above) or torch (PyTorch's CUDA wheel from PyPI, or from TORCH_INDEX, e.g.
# https://download.pytorch.org/whl/cu126 for an older driver; no Paddle GPU wheel needed).
BACKEND ?= paddle
TORCH_INDEX ?=
install-gpu: sysdeps-gpu
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@case '$(BACKEND)' in \
	paddle) $(PY) -m pip install -q 'paddlepaddle-gpu==$(PADDLE_GPU_VERSION)' -i $(PADDLE_GPU_INDEX) ;; \
	torch) $(PY) -m pip install -q 'torch>=2.4' $(if $(TORCH_INDEX),-i $(TORCH_INDEX)) ;; \
	*) echo "BACKEND must be paddle or torch, got '$(BACKEND)'"; exit 2 ;; \
	esac
	$(PY) -m pip install -q -e '.[$(GPU_EXTRAS)$(if $(filter torch,$(BACKEND)),$(comma)torch)]'
	@lib=$$($(PY) -c 'import nvidia.cuda_runtime, os; print(os.path.join(nvidia.cuda_runtime.__path__[0], "lib"))'); \
	if ldconfig -p | grep -q 'libcudart.so.12 '; then \
		true; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "$$lib" > /etc/ld.so.conf.d/pdrouter-cudart12.conf && ldconfig; \
	else \
		echo "Mooncake's CUDA wheel loads libcudart.so.12: export LD_LIBRARY_PATH=$$lib:\$$LD_LIBRARY_PATH"; \
	fi
	@touch $(STAMP)

comma := ,

# The PyTorch backend beside Paddle on a CPU host (PyPI's torch wheel, a few GB): what the
# `torch`-marked tests need (make test leaves them out; run them with make test-gpu or
# pytest -m torch).
install-torch: $(STAMP)
	$(PY) -m pip install -q -e '.[$(EXTRAS),torch]'

sysdeps-gpu:
	@if ldconfig -p | grep -q 'libibverbs.so.1' && ldconfig -p | grep -q 'librdmacm.so.1' \
		&& ldconfig -p | grep -q 'libnuma.so.1' && ls /usr/lib/x86_64-linux-gnu/libibverbs/*.so >/dev/null 2>&1; then \
		true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian packages libibverbs1 librdmacm1 ibverbs-providers libnuma1"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			libibverbs1 librdmacm1 ibverbs-providers libnuma1; \
	else \
		echo "Mooncake's CUDA wheel needs: sudo apt-get install -y libibverbs1 librdmacm1 ibverbs-providers libnuma1"; \
		exit 1; \
	fi

# Tests run in a random order (pytest-randomly), modules shuffled, then the tests of each
# module: a test that needs another to run first fails. Replay an order: make test SEED=N.
ifndef SEED
SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif

# Two pytest workers (pytest-xdist), each taking whole modules (--dist loadfile): one
# module's cluster starts once and is shared by its tests (the multi-host modules, which share
# the machine's network namespaces, take turns by pdrouter/launch/netns.py's lock). make test
# XDIST= runs in one process.
XDIST ?= -n 2 --dist loadfile

test: install sysdeps
	@echo "test order: --randomly-seed=$(SEED) (replay: make test SEED=$(SEED))"
	$(PY) -m pytest -q -p randomly --randomly-seed=$(SEED) --durations=20 -m "not soak and not torch" $(XDIST)

# A GPU host (make install-gpu, BACKEND=torch for the PyTorch runner): every `gpu` test (CuPy
# caches, the swap kernel, the device-pointer handoff) and every `torch` test (the PyTorch
# runner against the Paddle one, its engine and workers; on the GPU too where marked gpu).
test-gpu: sysdeps
	$(PY) -m pytest -q -p no:randomly --durations=20 -m "gpu or torch"

# Faults held for 20 s or more (a pool owner or a worker SIGSTOPped past the owner's client
# TTL), kept out of make test so that it stays under 15 minutes on 2 cores; the pool's own
# tests pause past the TTL too (tests/workers/pool/test_self_heal.py), inside make test.
test-soak: install sysdeps
	$(PY) -m pytest -q -m soak

test-all: install sysdeps
	$(PY) -m pytest -q -p randomly --randomly-seed=$(SEED) --durations=20

test-fast: install sysdeps
	$(PY) -m pytest -q -m "not slow"

# litellm against the router (one structured answer, one tool call): in a venv of its own, as
# litellm and its dependencies are too heavy for make test's (make test skips the module).
LITELLM_VENV ?= .venv-litellm
test-litellm: sysdeps
	@test -f $(LITELLM_VENV)/.installed || { $(PYTHON) -m venv $(LITELLM_VENV) && \
		$(LITELLM_VENV)/bin/pip install -q -e '.[$(EXTRAS)]' 'litellm>=1.50' && \
		touch $(LITELLM_VENV)/.installed; }
	$(LITELLM_VENV)/bin/python -m pytest -q -p no:randomly tests/e2e/pd/test_litellm_client.py

# lm-eval, a client the field uses for scoring, in a virtualenv of its own (datasets,
# pyarrow, scikit-learn: too heavy for make test's), against a PD cluster and its mixed
# worker: tests/e2e/pd/test_lm_eval.py (make test skips it while this venv is absent).
LM_EVAL_VENV ?= .venv-lmeval
LM_EVAL_VERSION ?= 0.4.13
test-clients: install sysdeps
	@test -x $(LM_EVAL_VENV)/bin/lm_eval || { $(PYTHON) -m venv $(LM_EVAL_VENV) && \
		$(LM_EVAL_VENV)/bin/pip install -q 'lm-eval[api]==$(LM_EVAL_VERSION)'; }
	PDROUTER_LM_EVAL=$(LM_EVAL_VENV)/bin/lm_eval $(PY) -m pytest -q tests/e2e/pd/test_lm_eval.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

demo: install sysdeps
	$(PY) examples/demo.py

# Each writes its table under docs/benchmarks/ (kernels: only where a GPU is present). Every
# module of benchmarks/ is reached from one of the bench-* targets below (checked by
# tests/test_benchmarks_reachable.py); docs/benchmarks/README.md maps them to their tables.
bench: bench-storage bench-kernels bench-handoff bench-engine bench-pd bench-multihost \
	bench-pool-sizing bench-router bench-upstream bench-serving bench-cache bench-cache-defaults \
	bench-pd-paths bench-serving-matrix bench-priority bench-structured

bench-storage: install sysdeps
	$(PY) -m benchmarks.pool.storage

bench-kernels: install
	$(PY) -m benchmarks.kernels.bench  # on a GPU host: add --output docs/benchmarks/kernels.md

# A GPU host without the pool's packages: `source benchmarks/handoff/gpu_host_cuda_env.sh DIR`
# first (Mooncake's CUDA wheel; benchmarks/handoff/gpu_host_env.sh: the CPU wheel, host path).
bench-handoff: install sysdeps
	$(PY) -m benchmarks.handoff  # GPU hosts (elsewhere a note): device pointers; --path host too
	$(PY) -m benchmarks.handoff.chunked  # GPU hosts: the handoff left after a chunked prefill
	$(PY) -m benchmarks.handoff.integrity  # GPU hosts: --pool-integrity on against off
	$(PY) -m benchmarks.handoff.tp  # hosts with 2 GPUs: a 2-rank P -> a 1-rank D

# GPU hosts (source gpu_host_cuda_env.sh as above): a 4K-token prefix from the host tier, the
# pool and a recompute (docs/benchmarks/host_tier_gpu.md).
# The PyTorch runner and PD on one GPU (a GPU host with torch: make install-gpu BACKEND=torch),
# against the same run's limits: an 8B-shaped random bf16 checkpoint written on the device
# (benchmarks/gpu/checkpoint.py), the runner's prefill and decode, the handoff left after a
# real chunked prefill, and PD vs mixed through a launched cluster: docs/benchmarks/gpu.md.
# A GPU host without network or Paddle (this project's lent H200) runs the same steps through
# benchmarks/gpu/run_on_gpu.sh after benchmarks/gpu/pack.sh here and benchmarks/gpu/env.sh there.
GPU_MODEL ?= /tmp/llama8b
bench-gpu: install sysdeps
	$(PY) -m benchmarks.gpu.checkpoint $(GPU_MODEL)
	$(PY) -m benchmarks.gpu.runner_bench --model $(GPU_MODEL) --output docs/benchmarks/gpu.md
	$(PY) -m benchmarks.gpu.serving --model $(GPU_MODEL) --reps 2 \
		--worker-flags "--cuda-graphs --decode-attention triton" --output docs/benchmarks/gpu.md
	$(PY) -m benchmarks.handoff.chunked --model $(GPU_MODEL) --tokens 4096,16384 --chunks 512 \
		--block-sizes 64 --paths device --reps 2 --output docs/benchmarks/handoff_model.md
	$(PY) -m benchmarks.handoff.chunked_model --help >/dev/null

bench-host-tier-gpu: install sysdeps
	$(PY) -m benchmarks.cache.host_tier_gpu --output docs/benchmarks/host_tier_gpu.md

bench-engine: install
	$(PY) -m benchmarks.engine

.PHONY: bench-sampling
bench-sampling: install
	$(PY) -m benchmarks.sampling_controls

bench-server: install
	$(PY) -m benchmarks.server

# Two sections of docs/benchmarks/pd.md: PD vs mixed, then P's write while computing on/off.
bench-pd: install sysdeps
	$(PY) -m benchmarks.pd
	$(PY) -m benchmarks.pd --overlap-compare
	$(PY) -m benchmarks.pd_tp

# Two more sections of docs/benchmarks/pd.md: the crossover that sets the router's
# --local-prefill-below-tokens (demo model), then TTFT and the first-to-second token gap of
# PD's paths (early decode on and off, --no-early-decode, and the threshold) against the mixed worker.
bench-pd-paths: install sysdeps
	$(PY) -m benchmarks.pd_matrix --crossover $(BENCH_CROSSOVER_ARGS)
	$(PY) -m benchmarks.pd_matrix $(BENCH_PD_PATHS_ARGS)

# The PD benchmark over network namespaces (TCP between hosts) next to one host; needs root.
bench-multihost: install sysdeps
	$(PY) -m benchmarks.pd_multihost

# D's handoff hit rate against pool size (docs/deploy.md's sizing section cites it).
bench-pool-sizing: install sysdeps
	$(PY) -m benchmarks.pool_sizing

# Compares with the SGLang gateway (extra `bench`) and vLLM's toy proxy (in the mooncake wheel).
# A change before and after, in the same rounds: BENCH_ROUTER_ARGS="--baseline WORKTREE" (a
# checkout of the older commit with its own .venv).
bench-router: install
	$(PY) -m pip install -q -e '.[$(EXTRAS),bench]'
	$(PY) -m benchmarks.router.bench_router $(BENCH_ROUTER_ARGS)

# The pool as a prefix cache: 4 cases x 3 workloads, 2 P + 2 D (matplotlib: extra `bench`);
# then eviction pressure: the host tier's write policies against device and device+pool.
bench-cache: install sysdeps
	$(PY) -m pip install -q -e '.[$(EXTRAS),bench]'
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.cache
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.cache.eviction
	$(MAKE) bench-cache-skew

# Skew and scale: round robin vs the load-aware cache policy (docs/benchmarks/cache_skew.md).
bench-cache-skew: install sysdeps
	$(PY) -m pip install -q -e '.[$(EXTRAS),bench]'
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.cache_skew

# The pool prefix read's defaults (docs/design/cache_tiers.md cites the table).
bench-cache-defaults: install sysdeps
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.cache.defaults

# Where the router's own time goes, per segment of a request (printed; docs/benchmarks/router.md).
# High-priority TTFT under a low-priority flood against idle (docs/benchmarks/priority.md).
bench-priority: install
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.priority $(BENCH_PRIORITY_ARGS)

bench-router-path: install
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.router.path

bench-upstream: install
	$(PY) -m benchmarks.router.upstream

# aiperf, a serving benchmark client the field uses, in a virtualenv of its own (it is heavy
# and pins its own dependencies), against a 1P1D cluster and its mixed worker.
AIPERF_VENV ?= .venv-aiperf
AIPERF_VERSION ?= 0.13.0
# 100 varied JSON schemas through a demo PD cluster, each answer checked with jsonschema, and
# the inter-token latency with and without a schema: docs/benchmarks/structured.md.
bench-structured: install sysdeps
	$(PY) -m benchmarks.structured

bench-serving: install sysdeps
	@test -x $(AIPERF_VENV)/bin/aiperf || { $(PYTHON) -m venv $(AIPERF_VENV) && \
		$(AIPERF_VENV)/bin/pip install -q 'aiperf==$(AIPERF_VERSION)'; }
	$(PY) -m benchmarks.serving --aiperf $(AIPERF_VENV)/bin/aiperf $(BENCH_SERVING_ARGS)

# The same client over PD's paths (pd, +early, +local, both) and the mixed worker at 128, 512
# and 2048 prompt tokens: a section of docs/benchmarks/serving.md.
bench-serving-matrix: install sysdeps
	@test -x $(AIPERF_VENV)/bin/aiperf || { $(PYTHON) -m venv $(AIPERF_VENV) && \
		$(AIPERF_VENV)/bin/pip install -q 'aiperf==$(AIPERF_VERSION)'; }
	$(PY) -m benchmarks.serving_matrix --aiperf $(AIPERF_VENV)/bin/aiperf $(BENCH_SERVING_ARGS)

clean:
	rm -rf $(VENV) $(AIPERF_VENV) $(LM_EVAL_VENV) .pytest_cache .ruff_cache *.egg-info
