# Source this on a GPU host to run the pool with Mooncake's CUDA wheel (the device-pointer
# path) when the image lacks it and has no network:
#     source benchmarks/handoff/gpu_host_cuda_env.sh DIR
# DIR/mc is what ../shared/tools/gpu/pack_cuda_mooncake.sh packs (mc.tar.xz: the CUDA wheel's
# store files; cudart/: libcudart.so.12; debs/: libibverbs1, librdmacm1, libnl, ibverbs-
# providers, libnuma1); DIR/wheels holds the pure-Python wheels the code imports that the
# image lacks (pydantic, pydantic_core, annotated-types, typing-inspection, fastapi,
# starlette, uvicorn, httptools, prometheus_client, pytest-asyncio). Nothing goes into /:
# the wheels under /tmp/site, the store under /tmp/mc, the libraries under /tmp/debs and
# /tmp/cudart. gpu_host_env.sh is the same for the CPU wheel (the host-staging path only).
dir=${1:?usage: source benchmarks/handoff/gpu_host_cuda_env.sh DIR}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$dir"/wheels/*.whl || return 1
mkdir -p /tmp/mc /tmp/debs /tmp/cudart && tar -xJf "$dir"/mc/mc.tar.xz -C /tmp/mc
for f in "$dir"/mc/debs/*.deb; do dpkg -x "$f" /tmp/debs; done
cp "$dir"/mc/cudart/* /tmp/cudart/
chmod +x /tmp/mc/mooncake/mooncake_* 2>/dev/null
export PYTHONPATH=/tmp/mc:/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export MC_LOG_LEVEL=ERROR
export LD_LIBRARY_PATH=/tmp/cudart:/tmp/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
