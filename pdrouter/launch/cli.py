"""`pdrouter launch`: a whole PD cluster on this host (Cluster), printed and supervised.

    pdrouter launch --prefill N --decode M [--mixed K] --model tiny|PATH --port 8000

Prints the Mooncake sockets no key protects (pdrouter.launch.exposure), where the cluster's
admin key is (LOG_DIR/admin_key, mode 0600), every process (name, pid, URL), the router's URL
and a curl line, then supervises
until Ctrl-C / SIGTERM (exit 0) or an essential process dies (exit 1, naming it).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from pdrouter.common.cli_args import ConfigError
from pdrouter.common.flags import add_flags, from_args
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.exposure import launch_warnings
from pdrouter.launch.spec import ClusterSpec, check_model

# The launcher's --api-key from the environment (the flag's PDROUTER_* mirror).
API_KEY_ENV = "PDROUTER_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pdrouter launch`, one per flag()-marked field of ClusterSpec."""
    add_flags(parser, ClusterSpec)


def run(args: argparse.Namespace) -> int:
    spec: ClusterSpec = from_args(ClusterSpec, args)
    try:
        check_model(spec.model)
    except ConfigError as exc:
        print(f"pdrouter launch: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if not (spec.num_prefill and spec.num_decode) and not spec.num_mixed:
        print(
            "pdrouter launch: nothing to serve; give --prefill N --decode M (both >= 1) "
            "or --mixed K",
            file=sys.stderr,
        )
        return 2
    cluster = Cluster(spec)
    for line in launch_warnings(spec.host, pool_tcp=not spec.shared_memory):
        print(line, file=sys.stderr, flush=True)
    print(
        f"admin key (admin API, /metrics, detailed /health): {cluster.admin_key_path}", flush=True
    )
    print(
        f"starting {spec.num_prefill} prefill, {spec.num_decode} decode, {spec.num_mixed} "
        f"mixed workers of {spec.model}; logs in {cluster.log_dir}",
        flush=True,
    )
    try:
        cluster.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"pdrouter launch: start-up failed: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        for line in cluster.describe():
            print(line, flush=True)
        # Without a prefill/decode pair there is no router: serve from the first mixed worker.
        url = cluster.router_url or cluster.mixed_urls[0]
        what = "router" if cluster.router_url else "mixed worker (no router: no P/D pair)"
        print(f"\n{what} ready: {url}/v1  (Ctrl-C stops everything)\n", flush=True)
        print(curl_line(url, spec.model, bool(spec.api_key)) + "\n", flush=True)
        return cluster.supervise(stop, report=lambda m: print(m, flush=True))
    finally:
        cluster.stop()
        print("stopped", flush=True)


def curl_line(url: str, model: str, keyed: bool) -> str:
    """The curl command the launcher prints: with a key, the variable the key is given in
    (never the key itself: this output ends up in logs)."""
    auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if keyed else ""
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], '
        '"max_tokens": 16, "stream": true}'
    )
    return (
        f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
    )
