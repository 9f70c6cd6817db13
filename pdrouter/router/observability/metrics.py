"""The router's Prometheus metrics: one CollectorRegistry per app, no process globals.

Counters and histograms are updated by the orchestrator as requests move; per-instance state
(health, in-flight requests and tokens, circuit breaker) is read from the registry and the
breaker board at scrape time, so it can never drift from what selection sees.
"""

from __future__ import annotations

import bisect
import itertools
import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pdrouter.router.instances.registry import Registry
from pdrouter.router.selection.breaker import STATE_TO_GAUGE, BreakerBoard
from pdrouter.wire.pd import DecodeEvent, KVHandle, PrefillResult

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_HANDOFF_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class _InstanceCollector:
    """Reads instance health, load and breaker state at scrape time."""

    def __init__(self, registry: Registry, breakers: BreakerBoard | None) -> None:
        self._registry = registry
        self._breakers = breakers

    def collect(self):  # prometheus-client's collector protocol
        labels = ["role", "url"]
        up = GaugeMetricFamily(
            "pdrouter_instance_up", "1 when the instance passes health checks", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "pdrouter_instance_in_flight",
            "requests this router has in flight on the instance",
            labels=labels,
        )
        in_flight_tokens = GaugeMetricFamily(
            "pdrouter_instance_in_flight_tokens",
            "tokens of the requests in flight on the instance (estimated prompt on prefill, "
            "prompt + max_tokens on decode)",
            labels=labels,
        )
        slow_checks = CounterMetricFamily(
            "pdrouter_instance_slow_checks",
            "health checks that timed out while the instance's calls made progress (busy, "
            "not counted as failed)",
            labels=labels,
        )
        breaker = GaugeMetricFamily(
            "pdrouter_instance_breaker_state",
            "circuit breaker per instance: 0 closed, 1 half-open, 2 open",
            labels=labels,
        )
        for inst in self._registry.all():
            key = [inst.role, inst.url]
            up.add_metric(key, 1.0 if inst.healthy else 0.0)
            in_flight.add_metric(key, float(inst.in_flight))
            in_flight_tokens.add_metric(key, float(inst.in_flight_tokens))
            slow_checks.add_metric(key, float(inst.num_slow_checks))
            if self._breakers is not None:
                breaker.add_metric(key, STATE_TO_GAUGE[self._breakers.state(inst.url)])
        yield up
        yield in_flight
        yield in_flight_tokens
        yield slow_checks
        if self._breakers is not None:
            yield breaker


class LoopHistogram:
    """A Prometheus histogram updated only from the router's event-loop thread: no lock.

    prometheus_client's metrics take a lock per update (twice per observation here) and
    check their state in several Python calls; the inter-token latency is observed once per
    relayed token and a request updates a dozen metrics, so on the router's hot path that
    machinery (whose locks guard against threads the router does not have: handlers, the
    scrape included, all run on one event loop) cost more than the bookkeeping. The same goes
    for LoopCounter and LoopGauge below. Exposition is the standard one: cumulative
    `_bucket{le=...}`, `_sum`, `_count`.
    """

    def __init__(
        self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = [*sorted(buckets), math.inf]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, value: float, count: int) -> None:
        """count observations of value at once."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative = itertools.accumulate(self.counts)
        buckets = [
            (floatToGoString(b), float(n)) for b, n in zip(self.bounds, cumulative, strict=True)
        ]
        family.add_metric([], buckets, self.sum)
        return [family]


class CounterChild:
    """One label set's value of a LoopCounter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up (inc by {amount})")
        self.value += amount


class LoopCounter(CounterChild):
    """A Prometheus counter updated only from the event-loop thread (see LoopHistogram);
    with labelnames, labels(*values) is the child of those values (made on first use)."""

    __slots__ = ("_children", "documentation", "labelnames", "name")

    def __init__(
        self,
        name: str,
        documentation: str,
        registry: CollectorRegistry,
        labelnames: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.name = name  # exposed as name_total
        self.documentation = documentation
        self.labelnames = labelnames
        self._children: dict[tuple[str, ...], CounterChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> CounterChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self._children[values] = CounterChild()
        return child

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        if self.labelnames:
            for values, child in self._children.items():
                family.add_metric(list(values), child.value)
        else:
            family.add_metric([], self.value)
        return [family]


class LoopGauge:
    """A Prometheus gauge updated only from the event-loop thread (see LoopHistogram)."""

    __slots__ = ("documentation", "name", "value")

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.value = 0.0
        registry.register(self)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.name, self.documentation, value=self.value)]


class RouterMetrics:
    """Counters and histograms the orchestrator updates; render() for GET /metrics."""

    def __init__(self, registry: Registry, breakers: BreakerBoard | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = LoopCounter(
            "pdrouter_requests",
            "client requests by endpoint and final HTTP status",
            reg,
            ("endpoint", "status"),
        )
        self.in_progress = LoopGauge(
            "pdrouter_requests_in_progress", "client requests being served", reg
        )
        self.stage_failures = LoopCounter(
            "pdrouter_stage_failures",
            "failed calls to a worker by stage and kind (retried or not)",
            reg,
            ("stage", "kind"),
        )
        self.retries = LoopCounter(
            "pdrouter_retries",
            "calls tried again on another instance (failovers included)",
            reg,
            ("stage",),
        )
        self.failovers = LoopCounter(
            "pdrouter_failovers",
            "retries that resumed a stream on another instance after it failed mid-stream",
            reg,
            ("stage",),
        )
        self.rejected = LoopCounter(
            "pdrouter_rejected",
            "requests refused by admission control (429) by the limit that refused them",
            reg,
            ("limit",),
        )
        self.ttft_s = LoopHistogram(
            "pdrouter_time_to_first_token_seconds",
            "client request arrival to the first token leaving the router",
            _LATENCY_BUCKETS_S,
            reg,
        )
        self.tpot_s = LoopHistogram(
            "pdrouter_time_per_output_token_seconds",
            "mean time between output tokens after the first, per request",
            _TPOT_BUCKETS_S,
            reg,
        )
        self.itl_s = LoopHistogram(
            "pdrouter_inter_token_latency_seconds",
            "gap between two relayed output events divided by the tokens in the later one",
            _TPOT_BUCKETS_S,
            reg,
        )
        self.prefill_s = LoopHistogram(
            "pdrouter_prefill_seconds",
            "router-observed duration of the prefill hop",
            _LATENCY_BUCKETS_S,
            reg,
        )
        self.prefill_worker_s = LoopHistogram(
            "pdrouter_prefill_worker_seconds",
            "prefill duration as P reports it (queue + compute + pool write, on P)",
            _LATENCY_BUCKETS_S,
            reg,
        )
        self.e2e_s = LoopHistogram(
            "pdrouter_request_seconds",
            "client request arrival to its last byte",
            _LATENCY_BUCKETS_S,
            reg,
        )
        self.prompt_tokens = LoopCounter(
            "pdrouter_prompt_tokens", "prompt tokens of completed requests", reg
        )
        self.prompt_tokens_by_source = LoopCounter(
            "pdrouter_prompt_tokens_by_source",
            "prompt tokens by where the worker that prefilled them (P, or D for a local "
            "prefill) got their KV: device (its prefix cache), host (its host tier), pool "
            "(read from the pool), computed",
            reg,
            ("source",),
        )
        self.generation_tokens = LoopCounter(
            "pdrouter_generation_tokens", "generated tokens sent to clients", reg
        )
        self.pool_bytes_written = LoopCounter(
            "pdrouter_pool_bytes_written", "KV bytes prefill instances wrote to the pool", reg
        )
        self.pool_bytes_read = LoopCounter(
            "pdrouter_pool_bytes_read", "KV bytes decode instances read from the pool", reg
        )
        self.recomputed_tokens = LoopCounter(
            "pdrouter_recomputed_prompt_tokens",
            "prompt tokens decode instances recomputed because their blocks were missing",
            reg,
        )
        self.handoff_put_s = LoopHistogram(
            "pdrouter_handoff_put_seconds",
            "prefill side of the KV handoff as P reports it (device-to-host copy + pool put)",
            _HANDOFF_BUCKETS_S,
            reg,
        )
        self.handoff_put_wait_s = LoopHistogram(
            "pdrouter_handoff_put_wait_seconds",
            "of the prefill side of the KV handoff, what P waited for after its first token "
            "(the rest was written while later prefill chunks computed)",
            _HANDOFF_BUCKETS_S,
            reg,
        )
        self.handoff_get_s = LoopHistogram(
            "pdrouter_handoff_get_seconds",
            "decode side of the KV handoff as D reports it (pool get + host-to-device copy)",
            _HANDOFF_BUCKETS_S,
            reg,
        )
        self.pool_blocks = LoopCounter(
            "pdrouter_pool_blocks",
            "prompt KV blocks by stage and outcome: prefill hit (already in the pool) or miss "
            "(written); decode hit (loaded) or miss (not loaded, recomputed)",
            reg,
            ("stage", "outcome"),
        )
        self.disaggregation_decisions = LoopCounter(
            "pdrouter_disaggregation_decisions",
            "requests by the path their prompt took: pd (P prefilled, KV through the pool) or "
            "local (D prefilled it: fewer uncached tokens than --local-prefill-below-tokens), "
            "and why",
            reg,
            ("path", "reason"),
        )
        self.first_to_second_token_s = LoopHistogram(
            "pdrouter_first_to_second_token_seconds",
            "streamed requests: the router's write of the first token to its write of the second",
            _TPOT_BUCKETS_S,
            reg,
        )
        self.handoff_after_first_token_s = LoopHistogram(
            "pdrouter_handoff_after_first_token_seconds",
            "requests through P and the pool: P's result arriving at the router to D's first "
            "event (the handoff left after P's first token)",
            _HANDOFF_BUCKETS_S,
            reg,
        )
        reg.register(_InstanceCollector(registry, breakers))
        # The children every request through P updates, looked up once (account_prefill).
        by_source = self.prompt_tokens_by_source
        self._device_tokens = by_source.labels("device")
        self._pool_tokens = by_source.labels("pool")
        self._computed_tokens = by_source.labels("computed")
        self._prefill_hits = self.pool_blocks.labels("prefill", "hit")
        self._prefill_misses = self.pool_blocks.labels("prefill", "miss")

    def account_prefill(self, result: PrefillResult) -> None:
        """What P's result says about the pool and the handoff's first half."""
        self.pool_bytes_written.inc(result.num_bytes_written)
        num_pool, num_host = result.num_pool_cached_tokens, result.num_host_cached_tokens
        self._device_tokens.inc(result.num_cached_tokens - num_pool - num_host)
        if num_host:  # no host series on a router whose workers have no host tier
            self.prompt_tokens_by_source.labels("host").inc(num_host)
        self._pool_tokens.inc(num_pool)
        self._computed_tokens.inc(len(result.prompt_token_ids) - result.num_cached_tokens)
        self.prefill_worker_s.observe(result.timings.total_s)
        self._prefill_hits.inc(result.num_blocks_skipped)
        self._prefill_misses.inc(result.num_blocks_written)
        if result.kv is not None:
            self.handoff_put_s.observe(result.timings.d2h_s + result.timings.put_s)
            self.handoff_put_wait_s.observe(result.timings.write_wait_s)

    def account_decode(self, ev: DecodeEvent, kv: KVHandle | None, num_prompt_tokens: int) -> None:
        """What D's final event says about the pool and the handoff's second half (or, of a
        prompt D prefilled itself, where its KV came from)."""
        if ev.num_cached_tokens is not None:
            num_cached, num_pool = ev.num_cached_tokens, ev.num_pool_cached_tokens or 0
            num_host = ev.num_host_cached_tokens or 0
            by_source = self.prompt_tokens_by_source
            by_source.labels("device").inc(num_cached - num_pool - num_host)
            if num_host:
                by_source.labels("host").inc(num_host)
            by_source.labels("pool").inc(num_pool)
            by_source.labels("computed").inc(num_prompt_tokens - num_cached)
        if ev.num_bytes_read:
            self.pool_bytes_read.inc(ev.num_bytes_read)
        if ev.num_tokens_recomputed:
            self.recomputed_tokens.inc(ev.num_tokens_recomputed)
        if kv is not None and ev.num_blocks_loaded is not None:
            self.pool_blocks.labels("decode", "hit").inc(ev.num_blocks_loaded)
            self.pool_blocks.labels("decode", "miss").inc(len(kv.keys) - ev.num_blocks_loaded)
        if ev.timings is not None and kv is not None:  # a prompt D prefilled has no handoff
            self.handoff_get_s.observe(ev.timings.get_s + ev.timings.h2d_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
