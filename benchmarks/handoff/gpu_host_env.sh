# Source this on a GPU host whose image lacks the pool's Python packages and libraries:
#     source benchmarks/handoff/gpu_host_env.sh DIR
# DIR holds the wheels (mooncake-transfer-engine-non-cuda 0.3.13.post1 for the host's Python,
# pydantic, pydantic_core, annotated-types, typing-inspection) and debs/ with libibverbs1 and
# librdmacm1 (.deb). Installs the wheels under /tmp/site and unpacks the .debs under /tmp/debs
# (never into /), then points PYTHONPATH, PATH and LD_LIBRARY_PATH at them and at this checkout.
# docs/benchmarks/handoff.md and tests/workers/pool/test_handoff_gpu.py were run this way.
dir=${1:?usage: source benchmarks/handoff/gpu_host_env.sh DIR}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$dir"/*.whl || return 1
mkdir -p /tmp/debs && for f in "$dir"/debs/*.deb; do dpkg -x "$f" /tmp/debs; done
chmod +x /tmp/site/mooncake/mooncake_* 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR
export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
