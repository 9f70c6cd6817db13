"""Prometheus metrics of one worker, in a registry owned by its app (no process globals).

Engine state (running/waiting requests, KV blocks) is read from engine.stats() at scrape time,
so a scrape always shows the engine as it is now; per-request facts (tokens, latencies,
outcomes) are recorded by the service as requests end.

    pdworker_num_requests_running / _waiting     gauges, from the engine
    pdworker_kv_blocks_used / _total             gauges, from the engine
    pdworker_num_preemptions_total               counter, from the engine
    pdworker_engine_ready                        1 once the engine serves
    pdworker_num_requests_in_flight              gauge, requests the server holds
    pdworker_prompt_tokens_total                 counter
    pdworker_prompt_tokens_by_source_total{source}  device|host|pool|handoff|computed
    pdworker_kv_blocks_cached                    gauge, blocks carrying a prefix hash
    pdworker_host_tier_*                         the host tier, from the engine (host_tier_metrics)
    pdworker_generation_tokens_total             counter
    pdworker_requests_total{endpoint,status}     counter; status success|aborted|rejected|error
    pdworker_time_to_first_token_seconds         histogram
    pdworker_time_per_output_token_seconds       histogram
    pdworker_e2e_request_latency_seconds         histogram
    pdworker_grammar_compiles_total{outcome}     counter   compiled | cache_hit | rejected |
                                                           over_budget
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workers.engine.api import EngineStats
from workers.engine.grammar_compiler import GrammarCounts
from workers.server.host_tier_metrics import host_tier_metrics

PREFIX = "pdworker"
RequestStatus = Literal["success", "aborted", "rejected", "error"]
PROMPT_SOURCES = ("device", "host", "pool", "handoff", "computed")
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _EngineStatsCollector(Collector):
    """Reads engine.stats() when Prometheus scrapes; zeros while the engine is loading."""

    def __init__(self, stats_fn: Callable[[], EngineStats | None]) -> None:
        self._stats_fn = stats_fn

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_fn()
        ready = stats is not None
        yield GaugeMetricFamily(f"{PREFIX}_engine_ready", "1 once the engine serves", int(ready))
        values = (
            ("num_requests_running", "Requests in the running batch", "num_running"),
            ("num_requests_waiting", "Requests queued for the batch", "num_waiting"),
            ("kv_blocks_used", "KV cache blocks in use", "num_kv_blocks_used"),
            ("kv_blocks_total", "KV cache blocks in the pool", "num_kv_blocks_total"),
            ("kv_blocks_cached", "KV blocks carrying a prefix hash", "num_kv_blocks_cached"),
        )
        for name, doc, attr in values:
            value = getattr(stats, attr) if ready else 0
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value)
        preemptions = stats.num_preemptions_total if ready else 0
        yield CounterMetricFamily(
            f"{PREFIX}_num_preemptions",
            "Requests preempted: for KV blocks, or for a more urgent request",
            preemptions,
        )
        if ready and stats.host_tier is not None:
            yield from host_tier_metrics(stats.host_tier)


class _GrammarCollector(Collector):
    """pdworker_grammar_compiles_total{outcome}: compiled (a child compiled it), cache_hit (a
    schema seen before), rejected (llguidance refused it), over_budget (size or time)."""

    def __init__(self, counts_fn: Callable[[], GrammarCounts]) -> None:
        self._counts_fn = counts_fn

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            f"{PREFIX}_grammar_compiles",
            "JSON schemas asked of the grammar compiler, by outcome",
            labels=["outcome"],
        )
        for outcome, value in dataclasses.asdict(self._counts_fn()).items():
            family.add_metric([outcome], value)
        yield family


class ServerMetrics:
    """All metrics of one worker app; render() is the /metrics body."""

    def __init__(self, stats_fn: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats_fn))
        reg = self.registry
        self.in_flight = Gauge(
            f"{PREFIX}_num_requests_in_flight", "Requests the server holds now", registry=reg
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of requests served", registry=reg
        )
        self.prompt_tokens_by_source = Counter(
            f"{PREFIX}_prompt_tokens_by_source",
            "Prompt tokens by where their KV came from: device (prefix cache), host (swapped "
            "in from the host tier), pool (prefix read from the pool), handoff (D's load of "
            "P's blocks), computed",
            ["source"],
            registry=reg,
        )
        for source in PROMPT_SOURCES:
            self.prompt_tokens_by_source.labels(source=source)
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Tokens generated", registry=reg
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests by endpoint and outcome",
            ["endpoint", "status"],
            registry=reg,
        )
        self.ttft_s = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_TTFT_BUCKETS_S,
            registry=reg,
        )
        self.tpot_s = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean gap between generated tokens after the first, per request",
            buckets=_TPOT_BUCKETS_S,
            registry=reg,
        )
        self.e2e_s = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=_E2E_BUCKETS_S,
            registry=reg,
        )

    def observe_request(
        self,
        endpoint: str,
        status: RequestStatus,
        num_prompt_tokens: int = 0,
        num_generated_tokens: int = 0,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        e2e_s: float | None = None,
    ) -> None:
        """Record one finished request (served, aborted, rejected or failed)."""
        self.requests.labels(endpoint=endpoint, status=status).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated_tokens)
        if ttft_s is not None:
            self.ttft_s.observe(ttft_s)
        if tpot_s is not None:
            self.tpot_s.observe(tpot_s)
        if e2e_s is not None:
            self.e2e_s.observe(e2e_s)

    def count_prompt_sources(self, **num_tokens: int) -> None:
        """Add prompt tokens by source (keywords from PROMPT_SOURCES)."""
        for source, n in num_tokens.items():
            assert source in PROMPT_SOURCES, f"unknown prompt token source {source!r}"
            if n:
                self.prompt_tokens_by_source.labels(source=source).inc(n)

    def watch_grammars(self, counts_fn: Callable[[], GrammarCounts]) -> None:
        """Export the engine's grammar compiles by outcome (workers.engine.grammar_compiler)."""
        self.registry.register(_GrammarCollector(counts_fn))

    def render(self) -> bytes:
        return generate_latest(self.registry)
