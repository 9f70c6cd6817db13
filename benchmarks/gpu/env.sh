# Source on the GPU machine, from the repository root, before any pdrouter command there:
#     source benchmarks/gpu/env.sh .gpu
# Installs nothing into /: the wheels go under /tmp/site, Mooncake's store under /tmp/mc,
# its libraries under /tmp/debs and /tmp/cudart (benchmarks/handoff/gpu_host_cuda_env.sh).
dir=${1:?usage: source benchmarks/gpu/env.sh DIR}
source benchmarks/handoff/gpu_host_cuda_env.sh "$dir" || return 1
# The pdrouter and pdworker commands, as the project's console scripts would be.
mkdir -p /tmp/site/bin
for cmd in pdrouter:pdrouter.cli pdworker:workers.cli; do
    printf '#!/bin/sh\nexec python3 -c "import sys; from %s import main; sys.exit(main())" "$@"\n' \
        "${cmd#*:}" > "/tmp/site/bin/${cmd%%:*}"
    chmod +x "/tmp/site/bin/${cmd%%:*}"
done
