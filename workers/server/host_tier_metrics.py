"""Prometheus metrics of the host tier (workers/engine/host_tier.py), read from the engine's
HostTierStats at scrape time; absent on a worker without a host tier (--swap-space 0).

    pdworker_host_tier_blocks{state=used|total}          gauge
    pdworker_host_tier_bytes{state=used|total}           gauge
    pdworker_host_tier_hits_total                        blocks swapped into the device
    pdworker_host_tier_read_bytes_total                  bytes of those swap-ins (H2D)
    pdworker_host_tier_copies_total{policy}              blocks copied device -> host
    pdworker_host_tier_copy_bytes_total{policy}          bytes of those copies (D2H)
    pdworker_host_tier_evictions_total                   entries evicted for room
    pdworker_host_tier_writes_skipped_total              copies not made (no slot, or failed)
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from workers.engine.host_tier import HostTierStats

PREFIX = "pdworker_host_tier"


def host_tier_metrics(stats: HostTierStats) -> Iterator[Metric]:
    """The host tier's metric families for one scrape."""
    for name, unit in (("blocks", 1), ("bytes", stats.slot_bytes)):
        gauge = GaugeMetricFamily(
            f"{PREFIX}_{name}", f"host tier {name}: used and total", labels=["state"]
        )
        gauge.add_metric(["used"], stats.num_used * unit)
        gauge.add_metric(["total"], stats.num_slots * unit)
        yield gauge
    yield CounterMetricFamily(
        f"{PREFIX}_hits", "blocks swapped in from the host tier", stats.blocks_read
    )
    yield CounterMetricFamily(
        f"{PREFIX}_read_bytes", "bytes copied host -> device (swap-ins)", stats.bytes_read
    )
    for name, doc, value in (
        ("copies", "blocks copied device -> host, by write policy", stats.blocks_written),
        ("copy_bytes", "bytes copied device -> host, by write policy", stats.bytes_written),
    ):
        counter = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["policy"])
        counter.add_metric([stats.write_policy], value)
        yield counter
    yield CounterMetricFamily(
        f"{PREFIX}_evictions", "host tier entries evicted for room", stats.evictions
    )
    yield CounterMetricFamily(
        f"{PREFIX}_writes_skipped",
        "copies to the host tier not made: every entry pinned, or the copy failed",
        stats.writes_skipped,
    )
