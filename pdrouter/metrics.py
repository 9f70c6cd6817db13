"""The router's Prometheus metrics: one CollectorRegistry per app, no process globals."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from pdrouter.registry import Registry

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _InstanceCollector:
    """Reads instance health and in-flight counts from the registry at scrape time."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self):  # prometheus-client's collector protocol
        up = GaugeMetricFamily(
            "pdrouter_instance_up",
            "1 when the instance passes health checks",
            labels=["role", "url"],
        )
        in_flight = GaugeMetricFamily(
            "pdrouter_instance_in_flight",
            "requests this router has in flight on the instance",
            labels=["role", "url"],
        )
        for inst in self._registry.all():
            up.add_metric([inst.role, inst.url], 1.0 if inst.healthy else 0.0)
            in_flight.add_metric([inst.role, inst.url], float(inst.in_flight))
        yield up
        yield in_flight


class RouterMetrics:
    """Counters and histograms the orchestrator updates; render() for GET /metrics."""

    def __init__(self, registry: Registry) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "pdrouter_requests",
            "client requests by endpoint and final HTTP status",
            ["endpoint", "status"],
            registry=reg,
        )
        self.in_progress = Gauge(
            "pdrouter_requests_in_progress", "client requests being served", registry=reg
        )
        self.stage_failures = Counter(
            "pdrouter_stage_failures",
            "failed calls to a worker by stage and kind (retried or not)",
            ["stage", "kind"],
            registry=reg,
        )
        self.retries = Counter(
            "pdrouter_retries", "calls retried on another instance", ["stage"], registry=reg
        )
        self.ttft_s = Histogram(
            "pdrouter_time_to_first_token_seconds",
            "client request arrival to the first token leaving the router",
            buckets=_LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.tpot_s = Histogram(
            "pdrouter_time_per_output_token_seconds",
            "mean time between output tokens after the first, per request",
            buckets=_TPOT_BUCKETS_S,
            registry=reg,
        )
        self.prefill_s = Histogram(
            "pdrouter_prefill_seconds",
            "router-observed duration of the prefill hop",
            buckets=_LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.e2e_s = Histogram(
            "pdrouter_request_seconds",
            "client request arrival to its last byte",
            buckets=_LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "pdrouter_prompt_tokens", "prompt tokens of completed requests", registry=reg
        )
        self.generation_tokens = Counter(
            "pdrouter_generation_tokens", "generated tokens sent to clients", registry=reg
        )
        self.pool_bytes_written = Counter(
            "pdrouter_pool_bytes_written",
            "KV bytes prefill instances wrote to the pool",
            registry=reg,
        )
        self.pool_bytes_read = Counter(
            "pdrouter_pool_bytes_read", "KV bytes decode instances read from the pool", registry=reg
        )
        self.recomputed_tokens = Counter(
            "pdrouter_recomputed_prompt_tokens",
            "prompt tokens decode instances recomputed because their blocks were missing",
            registry=reg,
        )
        reg.register(_InstanceCollector(registry))

    def render(self) -> bytes:
        return generate_latest(self.registry)
