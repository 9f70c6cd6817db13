"""The host tier's /metrics families, read from EngineStats at scrape time; none without one."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from workers.engine.api import EngineStats
from workers.engine.host_tier import HostTierStats
from workers.server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _stats(host: HostTierStats | None) -> EngineStats:
    return EngineStats(0, 0, 0, 8, 0, 0, host_tier=host)


def test_host_tier_families_come_from_the_engine_stats() -> None:
    host = HostTierStats("write_back", num_slots=10, num_used=4, slot_bytes=32, blocks_written=6,
                         bytes_written=192, blocks_read=3, bytes_read=96, evictions=2,
                         writes_skipped=1)  # fmt: skip
    got = {k: v for k, v in _samples(ServerMetrics(lambda: _stats(host))).items()
           if k.startswith("pdworker_host_tier")}  # fmt: skip
    assert got == {
        'pdworker_host_tier_blocks{state="used"}': 4.0,
        'pdworker_host_tier_blocks{state="total"}': 10.0,
        'pdworker_host_tier_bytes{state="used"}': 128.0,
        'pdworker_host_tier_bytes{state="total"}': 320.0,
        "pdworker_host_tier_hits_total": 3.0,
        "pdworker_host_tier_read_bytes_total": 96.0,
        'pdworker_host_tier_copies_total{policy="write_back"}': 6.0,
        'pdworker_host_tier_copy_bytes_total{policy="write_back"}': 192.0,
        "pdworker_host_tier_evictions_total": 2.0,
        "pdworker_host_tier_writes_skipped_total": 1.0,
    }


def test_no_host_tier_no_families_and_host_is_a_prompt_source() -> None:
    samples = _samples(ServerMetrics(lambda: _stats(None)))
    assert not [k for k in samples if k.startswith("pdworker_host_tier")]
    assert samples['pdworker_prompt_tokens_by_source_total{source="host"}'] == 0.0
