#!/usr/bin/env bash
# Packs what the GPU machine (Python 3.12, PyTorch, no network) needs to run pdrouter there,
# into a folder that travels with the working tree (about 45 MB):
#     bash benchmarks/gpu/pack.sh .gpu          # here, once; .gpu is in .git/info/exclude
#     source benchmarks/gpu/env.sh .gpu         # there, first thing of every command
# DIR/mc: Mooncake's CUDA wheel's store files and the libraries it links
# (../shared/tools/gpu/pack_cuda_mooncake.sh); DIR/wheels: the pure and binary wheels the
# project imports that the GPU image lacks, at the versions this machine's .venv runs.
set -euo pipefail
out=$(realpath -m "${1:?usage: pack.sh DIR}")
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out/wheels"
[ -f "$out/mc/mc.tar.xz" ] || bash "$here/../shared/tools/gpu/pack_cuda_mooncake.sh" "$out/mc"
# Everything the router, the workers and the tests import beyond what the image has (torch,
# numpy, safetensors, tokenizers, jinja2, httpx, pytest), pinned to this machine's versions.
pins=$("$here/.venv/bin/python" -m pip freeze 2>/dev/null | grep -i -E '^(fastapi|starlette|uvicorn|uvloop|httptools|aiohttp|aiohappyeyeballs|aiosignal|attrs|frozenlist|multidict|propcache|yarl|pydantic|pydantic_core|annotated-types|typing-inspection|typing_extensions|prometheus_client|xxhash|llguidance|openai|jiter|distro|httpx-sse|pytest-asyncio|pytest-timeout|jsonschema|jsonschema-specifications|referencing|rpds-py|anyio|h11|httpcore|httpx|sniffio|httpx2|httpcore2|opentelemetry-api|annotated-doc|click|truststore|idna|certifi)==')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$out/wheels" $pins
du -sh "$out"
