"""Prometheus metrics of the prefix cache's pool tier and of decode's write-back.

pdworker_prompt_tokens_by_source_total{source}   (ServerMetrics, every role)
    device    the device prefix cache held them
    pool      read from the pool (a prefix another request computed, on any worker)
    handoff   D's load of P's handoff (not a cache hit)
    computed  computed here
pdworker_pool_prefix_lookups_total               exists() batches after the device match
pdworker_pool_prefix_hit_tokens_total            tokens those lookups found
pdworker_pool_prefix_loads_skipped_total{reason} threshold | timeout | no_blocks
pdworker_pool_prefix_errors_total                pool errors turned into a recompute
pdworker_pool_prefix_load_bytes_total            bytes read into the cache
pdworker_pool_prefix_load_seconds                one load (get + host->device), histogram
pdworker_writeback_blocks_total                  blocks D wrote back after a request
pdworker_writeback_skipped_total{reason}         busy | error
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram

_LOAD_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5)


class CacheMetrics:
    """The pool tier's counters, on the worker's own registry."""

    def __init__(self, registry: Any) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"pdworker_{name}", doc, labels, registry=registry)

        self.lookups = counter("pool_prefix_lookups", "pool lookups after the device match")
        self.hit_tokens = counter("pool_prefix_hit_tokens", "prompt tokens the lookups found")
        self.loads_skipped = counter(
            "pool_prefix_loads_skipped",
            "pool hits not loaded: under --pool-prefix-min-tokens (threshold), past "
            "--pool-load-timeout-s (timeout), or no free KV blocks (no_blocks)",
            ("reason",),
        )
        self.errors = counter("pool_prefix_errors", "pool errors turned into a recompute")
        self.load_bytes = counter("pool_prefix_load_bytes", "KV bytes read from the pool")
        self.load_s = Histogram(
            "pdworker_pool_prefix_load_seconds",
            "one pool prefix load: get + host -> device",
            buckets=_LOAD_BUCKETS_S,
            registry=registry,
        )
        self.writeback_blocks = counter(
            "writeback_blocks", "blocks of prompt + output written back after a request"
        )
        self.writeback_skipped = counter(
            "writeback_skipped",
            "write-backs not done: --writeback-max-in-flight reached (busy) or failed (error)",
            ("reason",),
        )
