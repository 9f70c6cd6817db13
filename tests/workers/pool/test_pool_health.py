"""HealthMonitor's transitions with a scripted probe (the fault injection here is the probe's
answer; tests/workers/pool/test_self_heal.py drives the same code with real faults)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from workers.pool.pool_health import HealthMonitor, PoolHealth, ProbeOutcome

DOWN = ProbeOutcome("the pool owner or the master does not answer (code -900)", reachable=False)
UNMAPPED = ProbeOutcome("the pool owner no longer maps this client's staging", reachable=True)
OK = ProbeOutcome(None)


def _monitor(answers: list[ProbeOutcome], reconnects: list[bool], max_reconnects: int = 8):
    registry = CollectorRegistry()
    calls: list[str] = []

    def probe() -> ProbeOutcome:
        calls.append("probe")
        return answers.pop(0)

    def reconnect() -> bool:
        calls.append("reconnect")
        return reconnects.pop(0)

    monitor = HealthMonitor(probe, reconnect, 1.0, max_reconnects, registry)
    return monitor, registry, calls


def test_degraded_is_logged_once_and_never_reconnects_while_unreachable(caplog) -> None:
    monitor, registry, calls = _monitor([DOWN, DOWN, DOWN, OK], [])
    caplog.set_level(logging.WARNING, logger="workers.pool.client")
    for _ in range(3):
        assert monitor.check_once() == PoolHealth("degraded", DOWN.reason, 0)
        assert monitor.degraded
    assert registry.get_sample_value("pdworker_pool_degraded") == 1
    assert calls == ["probe"] * 3  # a hung or dead pool: no setup that could hold the GIL
    assert monitor.check_once() == PoolHealth("ok", None, 0)
    assert registry.get_sample_value("pdworker_pool_degraded") == 0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages  # one line per transition, not per probe
    assert messages[0].startswith("pool client degraded") and DOWN.reason in messages[0]
    assert messages[1].startswith("pool client healthy again after")


def test_a_lost_mapping_reconnects_then_probes_the_new_link() -> None:
    monitor, registry, calls = _monitor([UNMAPPED, UNMAPPED, OK], [False, True])
    assert monitor.check_once() == PoolHealth("degraded", UNMAPPED.reason, 0)  # refused
    assert monitor.check_once() == PoolHealth("ok", None, 1)
    assert calls == ["probe", "reconnect", "probe", "reconnect", "probe"]
    assert registry.get_sample_value("pdworker_pool_reconnects_total") == 1


def test_reconnects_stop_at_the_bound() -> None:
    monitor, _, calls = _monitor([UNMAPPED, UNMAPPED, UNMAPPED], [True], max_reconnects=1)
    monitor.check_once()  # reconnects, but the new link is unmapped too
    health = monitor.check_once()
    assert health.state == "degraded" and "gave up after 1 reconnects" in (health.reason or "")
    assert calls == ["probe", "reconnect", "probe", "probe"]
