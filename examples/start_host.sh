#!/usr/bin/env bash
# Start one host's share of a multi-host cluster: bash examples/start_host.sh ROLE [EXTRA FLAGS]
#
#   ROLE     what it starts on this host (the process replaces this script: its PID is the
#            service's, stop it by PID; run one role per line of your service manager)
#   master   the Mooncake master (RPC, admin)                      one host in the cluster
#   metadata the transfer-metadata store (HTTP), bound to HOST_ADDR  the master's host
#   pool     a pool owner mounting POOL_SIZE of this host's memory  any number of hosts
#   prefill  a prefill worker, registering with every router in ROUTERS
#   decode   a decode worker, registering with every router in ROUTERS
#   router   a router (workers register with it; put several behind one load balancer)
#
# Settings come from the environment (docs/deploy.md explains each):
#   HOST_ADDR        this host's address, which every process here binds and advertises (required)
#   MASTER_ADDR      the master host's address (roles master, pool, prefill, decode)
#   ROUTERS          router URLs, comma-separated (roles prefill, decode)
#   ADMIN_KEY        the routers' admin key (registration; roles router, prefill, decode)
#   INTERNAL_SECRET  shared by routers and workers for /internal/* (roles router, prefill, decode)
#   MODEL            tiny | demo | checkpoint folder (default demo)
#   POOL_SIZE        memory a pool owner mounts (default 2GiB)
#   PORT             HTTP port (default: 8000 router, 8100 worker, 8090 pool owner)
# Fixed ports (the firewall table in docs/deploy.md): master RPC 50051, metadata 8080,
# master admin 9003, pool owner 17000, Mooncake's transfer engine 16000-16099 (MC_MIN_RPC_PORT
# .. MC_MAX_RPC_PORT).
# Example, host B of docs/deploy.md:
#   HOST_ADDR=10.0.0.2 MASTER_ADDR=10.0.0.1 bash examples/start_host.sh pool
#   HOST_ADDR=10.0.0.2 MASTER_ADDR=10.0.0.1 ROUTERS=http://10.0.0.4:8000,http://10.0.0.4:8001 \
#     ADMIN_KEY=... INTERNAL_SECRET=... bash examples/start_host.sh prefill
set -euo pipefail
cd "$(dirname "$0")/.."

ROLE=${1:?usage: start_host.sh master|metadata|pool|prefill|decode|router [extra flags]}
shift
PY=${PY:-.venv/bin/python}
need() {  # VAR...: stop with a message naming each required variable that is unset
  local missing=()
  for var in "$@"; do [[ -n ${!var:-} ]] || missing+=("$var"); done
  if ((${#missing[@]})); then
    echo "start_host.sh $ROLE: set ${missing[*]} (see the top of this script)" >&2; exit 2
  fi
}
need HOST_ADDR
MODEL=${MODEL:-demo}
MASTER_RPC_PORT=50051 METADATA_PORT=8080 MASTER_ADMIN_PORT=9003 OWNER_PORT=17000
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
# Mooncake's transfer engine (in every owner and worker) listens on ports from this range:
# the only ports besides the fixed ones that must be open between pool and worker hosts.
export MC_MIN_RPC_PORT=${MC_MIN_RPC_PORT:-16000} MC_MAX_RPC_PORT=${MC_MAX_RPC_PORT:-16099}

pool_flags() {
  POOL_FLAGS=(--master "$MASTER_ADDR:$MASTER_RPC_PORT"
              --metadata "http://$MASTER_ADDR:$METADATA_PORT/metadata")
}
worker() {  # ROLE [FLAGS]: reaches the pool over TCP, registers with each router in ROUTERS
  need MASTER_ADDR ROUTERS ADMIN_KEY INTERNAL_SECRET
  pool_flags
  local routers=() urls
  IFS=, read -ra urls <<< "$ROUTERS"
  for url in "${urls[@]}"; do routers+=(--router "$url"); done
  # Secrets through the environment (PDWORKER_* mirrors), never argv: `ps` shows argv to all.
  PDWORKER_ADMIN_KEY=$ADMIN_KEY PDWORKER_INTERNAL_SECRET=$INTERNAL_SECRET \
    exec $PY -m workers.cli serve --role "$1" --model "$MODEL" --host "$HOST_ADDR" \
    --port "${PORT:-8100}" "${POOL_FLAGS[@]}" --pool-hostname "$HOST_ADDR" "${routers[@]}" "${@:2}"
}

case $ROLE in
  master)
    # No --metadata-port: the master's built-in metadata server binds every interface
    # whatever it is told; the metadata role serves the store on HOST_ADDR alone.
    exec $PY -m workers.cli master --host "$HOST_ADDR" --rpc-port $MASTER_RPC_PORT \
      --admin-port $MASTER_ADMIN_PORT "$@" ;;
  metadata)
    exec $PY -m workers.cli metadata --host "$HOST_ADDR" --port $METADATA_PORT "$@" ;;
  pool)
    need MASTER_ADDR
    pool_flags
    exec $PY -m workers.cli pool --size "${POOL_SIZE:-2GiB}" "${POOL_FLAGS[@]}" --host "$HOST_ADDR" \
      --port "${PORT:-8090}" --owner-port $OWNER_PORT "$@" ;;
  prefill|decode)
    worker "$ROLE" "$@" ;;
  router)
    need ADMIN_KEY INTERNAL_SECRET
    PDROUTER_ADMIN_KEY=$ADMIN_KEY PDROUTER_INTERNAL_SECRET=$INTERNAL_SECRET \
      exec $PY -m pdrouter.cli serve --host "$HOST_ADDR" --port "${PORT:-8000}" "$@" ;;
  *)
    echo "unknown role $ROLE (master|metadata|pool|prefill|decode|router)" >&2; exit 2 ;;
esac
