"""`pdrouter launch`: a whole PD cluster on this host (Cluster), printed and supervised.

    pdrouter launch --prefill N --decode M [--mixed K] --model tiny|PATH --port 8000

Prints the Mooncake sockets no key protects (pdrouter.launch.exposure), where the cluster's
admin key is (LOG_DIR/admin_key, mode 0600), every process (name, pid, URL), the router's URL
and a curl line, then supervises
until Ctrl-C / SIGTERM (exit 0) or an essential process dies (exit 1, naming it).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading

from pdrouter.common.cli_args import ConfigError, add_flag
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.exposure import launch_warnings
from pdrouter.launch.spec import ClusterSpec, check_model

_DEFAULTS = ClusterSpec()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--prefill",
        type=int,
        default=_DEFAULTS.num_prefill,
        help="prefill workers to start",
    )
    add_flag(
        parser, "--decode", type=int, default=_DEFAULTS.num_decode, help="decode workers to start"
    )
    add_flag(
        parser,
        "--mixed",
        type=int,
        default=_DEFAULTS.num_mixed,
        help="mixed (colocated) workers to start",
    )
    add_flag(
        parser,
        "--model",
        default=_DEFAULTS.model,
        help="'tiny', 'demo' or a Hugging Face checkpoint folder",
    )
    add_flag(parser, "--port", type=int, default=8000, help="router port")
    add_flag(
        parser, "--pool-size", default=_DEFAULTS.pool_size, help="KV pool memory of the pool owner"
    )
    add_flag(
        parser,
        "--worker-args",
        default="",
        help="extra flags for every `pdworker serve`, e.g. '--block-size 16'",
    )
    add_flag(parser, "--router-args", default="", help="extra flags for `pdrouter serve`")
    add_flag(
        parser,
        "--api-key",
        default=None,
        help="API key the router and the workers' /v1/* require; with it every other door is "
        "locked too (docs/security.md). Prefer PDROUTER_API_KEY: argv is public",
    )
    add_flag(
        parser,
        "--admin-key",
        default=None,
        help="admin key of the router's admin API, /metrics and detailed /health (and the "
        "workers' and pool owner's); default: a random one per launch, written to "
        "LOG_DIR/admin_key (mode 0600). Prefer PDROUTER_ADMIN_KEY: argv is public",
    )
    add_flag(
        parser,
        "--internal-secret",
        default=None,
        help="secret the router sends and the workers require on /internal/* (default: a "
        "random one per launch; children get it through their environment)",
    )
    add_flag(parser, "--log-dir", default=None, help="where child logs go (default: a temp dir)")
    add_flag(
        parser,
        "--max-restarts",
        type=int,
        default=_DEFAULTS.max_restarts,
        help="restarts per dead worker",
    )
    add_flag(
        parser,
        "--pool-tcp",
        action="store_true",
        help="workers reach the pool over TCP instead of same-host shared memory",
    )


def run(args: argparse.Namespace) -> int:
    spec = ClusterSpec(
        model=args.model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        num_mixed=args.mixed,
        router_port=args.port,
        pool_size=args.pool_size,
        worker_args=tuple(shlex.split(args.worker_args)),
        router_args=tuple(shlex.split(args.router_args)),
        log_dir=args.log_dir,
        max_restarts=args.max_restarts,
        api_key=args.api_key,
        shared_memory=not args.pool_tcp,
        internal_secret=args.internal_secret,
        admin_key=args.admin_key,
    )
    try:
        check_model(spec.model)
    except ConfigError as exc:
        print(f"pdrouter launch: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if not (spec.num_prefill and spec.num_decode) and not spec.num_mixed:
        print("pdrouter launch: nothing to serve; give --prefill N --decode M (both >= 1) "
              "or --mixed K", file=sys.stderr)  # fmt: skip
        return 2
    cluster = Cluster(spec)
    for line in launch_warnings(spec.host, pool_tcp=not spec.shared_memory):
        print(line, file=sys.stderr, flush=True)
    print(f"admin key (admin API, /metrics, detailed /health): {cluster.admin_key_path}",
          flush=True)  # fmt: skip
    print(f"starting {spec.num_prefill} prefill, {spec.num_decode} decode, {spec.num_mixed} "
          f"mixed workers of {spec.model}; logs in {cluster.log_dir}", flush=True)  # fmt: skip
    try:
        cluster.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"pdrouter launch: start-up failed: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        for line in cluster.describe():
            print(line, flush=True)
        # Never the key itself: this output ends up in logs.
        auth = ' -H "Authorization: Bearer $API_KEY"' if spec.api_key else ""
        model = args.model
        # Without a prefill/decode pair there is no router: serve from the first mixed worker.
        url = cluster.router_url or cluster.mixed_urls[0]
        what = "router" if cluster.router_url else "mixed worker (no router: no P/D pair)"
        print(f"\n{what} ready: {url}/v1  (Ctrl-C stops everything)\n", flush=True)
        print(f"curl -N {url}/v1/chat/completions -H 'Content-Type: "
              f"application/json'{auth} -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": "
              f"\"user\", \"content\": \"Hello\"}}], \"max_tokens\": 16, \"stream\": true}}'\n",
              flush=True)  # fmt: skip
        return cluster.supervise(stop, report=lambda m: print(m, flush=True))
    finally:
        cluster.stop()
        print("stopped", flush=True)
