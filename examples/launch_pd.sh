#!/usr/bin/env bash
# Run: bash examples/launch_pd.sh            (Ctrl-C stops everything)
#
# What `pdrouter launch --prefill 1 --decode 1 --model tiny --port 8000` does, one process per
# line with every flag spelled out, for deployments driven by scripts. Each process runs in
# the background; the script waits for each /health before starting what depends on it, and
# stops all of them (by PID) when one exits or on Ctrl-C. Secrets go through the environment
# (never a command line, which `ps` shows); set API_KEY to lock every door (docs/security.md).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-tiny}
HOST=127.0.0.1
# Mooncake wants ports below 32768; change these if they are taken.
MASTER_PORT=${MASTER_PORT:-21001}     # master RPC      (--master HOST:PORT)
METADATA_PORT=${METADATA_PORT:-21002} # HTTP metadata   (--metadata URL)
ADMIN_PORT=${ADMIN_PORT:-21003}       # master /metrics /health /get_all_keys
OWNER_HTTP_PORT=${OWNER_HTTP_PORT:-21004}
OWNER_PORT=${OWNER_PORT:-21005}       # pool owner's shared-memory port (--pool-owner)
PREFILL_PORT=${PREFILL_PORT:-21100}
DECODE_PORT=${DECODE_PORT:-21200}
ROUTER_PORT=${ROUTER_PORT:-8000}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
# The router <-> worker secret and the admin key: random per run, in the environment only.
SECRET=$($PY -c 'import secrets; print(secrets.token_urlsafe(32))')
ADMIN_KEY=${ADMIN_KEY:-$($PY -c 'import secrets; print(secrets.token_urlsafe(32))')}
WORKER_ENV=(PDWORKER_INTERNAL_SECRET="$SECRET" PDWORKER_ADMIN_KEY="$ADMIN_KEY")
ROUTER_ENV=(PDROUTER_INTERNAL_SECRET="$SECRET" PDROUTER_ADMIN_KEY="$ADMIN_KEY")
if [[ -n "${API_KEY:-}" ]]; then
  WORKER_ENV+=(PDWORKER_API_KEY="$API_KEY"); ROUTER_ENV+=(PDROUTER_API_KEY="$API_KEY")
fi

PIDS=()
stop_all() { trap - EXIT INT TERM; kill "${PIDS[@]}" 2>/dev/null || true; wait || true; }
trap stop_all EXIT INT TERM
wait_health() {  # URL: poll until it answers 200, for at most 5 minutes
  for _ in $(seq 1 3000); do
    curl -fs "$1" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "timed out waiting for $1" >&2; return 1
}
MASTER=$HOST:$MASTER_PORT
METADATA=http://$HOST:$METADATA_PORT/metadata

# The metadata store on $HOST alone (the master's embedded one would bind 0.0.0.0).
$PY -m workers.cli metadata --host $HOST --port $METADATA_PORT & PIDS+=($!)
$PY -m workers.cli master --host $HOST --rpc-port $MASTER_PORT --admin-port $ADMIN_PORT & PIDS+=($!)
wait_health http://$HOST:$METADATA_PORT/health
wait_health http://$HOST:$ADMIN_PORT/health

env PDWORKER_ADMIN_KEY="$ADMIN_KEY" $PY -m workers.cli pool --size 1GiB --master $MASTER --metadata $METADATA --host $HOST --port $OWNER_HTTP_PORT --owner-port $OWNER_PORT --threads 2 & PIDS+=($!)
wait_health http://$HOST:$OWNER_HTTP_PORT/health

env "${WORKER_ENV[@]}" $PY -m workers.cli serve --role prefill --model $MODEL --host $HOST --port $PREFILL_PORT --master $MASTER --metadata $METADATA --pool-owner $HOST:$OWNER_PORT --block-size 16 --staging-slots 256 --transfer-batch-blocks 64 --pool-wait-s 30 & PIDS+=($!)
env "${WORKER_ENV[@]}" $PY -m workers.cli serve --role decode --model $MODEL --host $HOST --port $DECODE_PORT --master $MASTER --metadata $METADATA --pool-owner $HOST:$OWNER_PORT --block-size 16 --staging-slots 256 --transfer-batch-blocks 64 --pool-wait-s 30 --missing-kv-policy recompute & PIDS+=($!)
wait_health http://$HOST:$PREFILL_PORT/health
wait_health http://$HOST:$DECODE_PORT/health

env "${ROUTER_ENV[@]}" $PY -m pdrouter.cli serve --host $HOST --port $ROUTER_PORT --prefill http://$HOST:$PREFILL_PORT --decode http://$HOST:$DECODE_PORT --prefill-policy round_robin --decode-policy round_robin --connect-timeout-s 2 --prefill-timeout-s 300 --decode-timeout-s 300 --max-prefill-attempts 3 --max-decode-attempts 3 --health-interval-s 1 & PIDS+=($!)
wait_health http://$HOST:$ROUTER_PORT/health

echo
echo "router ready: http://$HOST:$ROUTER_PORT/v1   (Ctrl-C stops everything)"
echo "admin API (/instances, /metrics): run this script with ADMIN_KEY=... to choose its key"
echo "curl -N http://$HOST:$ROUTER_PORT/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 16, \"stream\": true}'"
wait -n "${PIDS[@]}"
echo "a process exited; stopping everything" >&2
