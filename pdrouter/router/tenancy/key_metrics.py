"""Usage per API key in the router's /metrics, by key id (never the key itself)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from pdrouter.router.observability.metrics import LoopCounter


class KeyMetrics:
    """pdrouter_api_key_*: requests by status, tokens by kind, 429s by limit, in flight."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = LoopCounter(
            "pdrouter_api_key_requests",
            "requests of a keys-file API key by final HTTP status",
            registry,
            ("key_id", "status"),
        )
        self.tokens = LoopCounter(
            "pdrouter_api_key_tokens",
            "tokens used by a keys-file API key (kind: prompt, generation)",
            registry,
            ("key_id", "kind"),
        )
        self.rejected = LoopCounter(
            "pdrouter_api_key_rejected",
            "requests of an API key refused with 429 by the limit that refused them",
            registry,
            ("key_id", "limit"),
        )
        self.in_flight: dict[str, int] = {}  # key id -> requests in flight, read at scrape
        registry.register(self)

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._gauge()]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield self._gauge()

    def _gauge(self) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(
            "pdrouter_api_key_in_flight",
            "requests of a keys-file API key in flight",
            labels=["key_id"],
        )
        for key_id, num in self.in_flight.items():
            gauge.add_metric([key_id], float(num))
        return gauge
