"""Selector.pick: which instance a request tries next (plain data, no network)."""

from __future__ import annotations

from pdrouter.router.instances.registry import Registry
from pdrouter.router.selection.admission import Admission, AdmissionConfig
from pdrouter.router.selection.breaker import BreakerBoard, BreakerConfig
from pdrouter.router.selection.policies import RoundRobin
from pdrouter.router.selection.selector import Selector
from tests.pdrouter.router.worker_health import worker_health


def selector_over(registry: Registry) -> Selector:
    """Round robin on both roles, default breakers and admission."""
    policies = {"prefill": RoundRobin(), "decode": RoundRobin()}
    return Selector(registry, policies, BreakerBoard(BreakerConfig()), Admission(AdmissionConfig()))


def _selector(num_prefill: int) -> tuple[Selector, Registry]:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(num_prefill)]
    registry = Registry(urls, ["http://127.0.0.1:9100"])
    return selector_over(registry), registry


def _port(orch: Selector, exclude: set[str] | None = None) -> str | None:
    inst = orch.pick("prefill", exclude or set())
    return None if inst is None else inst.url[-4:]


def test_healthy_first_then_unchecked_then_down() -> None:
    orch, reg = _selector(3)
    p0, p1, p2 = reg.prefill
    # Nothing checked yet: all three are candidates, in round-robin order.
    assert [_port(orch) for _ in range(3)] == ["9000", "9001", "9002"]
    reg.mark_down(p0, "ConnectError")
    p1.healthy = True
    assert [_port(orch) for _ in range(2)] == ["9001", "9001"]  # the healthy one only
    p1.healthy = False
    assert {_port(orch) for _ in range(4)} == {"9001", "9002"}  # unchecked before down
    reg.mark_down(p1, "ConnectError")
    reg.mark_down(p2, "ConnectError")
    # Everything down: still try them (one may be back), never an excluded one.
    assert _port(orch, {p0.url, p2.url}) == "9001"
    assert _port(orch, {p0.url, p1.url, p2.url}) is None


def test_an_instance_of_another_fingerprint_is_never_picked() -> None:
    orch, reg = _selector(2)
    reg.fingerprint = "aaaa"
    p0, p1 = reg.prefill
    reg.check_passed(p0, worker_health("aaaa", role="prefill"))
    reg.check_passed(p1, worker_health("bbbb", role="prefill"))
    assert (p0.healthy, p1.healthy) == (True, False)
    assert [_port(orch) for _ in range(3)] == ["9000"] * 3
    assert _port(orch, {p0.url}) is None


def test_stage_failure_status_follows_the_kinds_of_failure() -> None:
    from pdrouter.router.orchestrator.failures import Failure, stage_error

    def fails(*pairs: tuple[str, str, str]) -> list[tuple[str, Failure]]:
        return [(url, Failure(kind, reason, "m", True, False)) for url, kind, reason in pairs]  # type: ignore[arg-type]

    err = stage_error(
        "prefill", fails(("a", "unreachable", "ConnectError"), ("b", "unreachable", "x"))
    )
    assert (err.status, err.retry_after_s, err.stage) == (503, 1, "prefill")
    assert err.message == "no prefill instance reachable (a: ConnectError; b: x)"
    err = stage_error(
        "decode", fails(("a", "unreachable", "refused"), ("b", "unavailable", "full"))
    )
    assert (err.status, err.message) == (503, "no decode instance available (a: refused; b: full)")
    err = stage_error("decode", fails(("a", "unavailable", "full"), ("b", "failed", "died")))
    assert (err.status, err.retry_after_s) == (502, None)
    assert err.message == "decode failed on every instance tried (a: full; b: died)"
    err = stage_error("decode", [])
    assert (err.status, err.message) == (503, "no decode instance reachable (no decode instance "
                                                "left to try)")  # fmt: skip
