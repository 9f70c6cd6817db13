"""Selection policies and the registry's fingerprint rule: plain data, no processes."""

from __future__ import annotations

import pytest

from pdrouter.router.instances.instance import (
    FingerprintMismatch,
    HealthThresholds,
    Instance,
    check_fingerprints,
)
from pdrouter.router.instances.registry import Registry
from pdrouter.router.selection.policies import LeastInFlight, RoundRobin, make_policy
from tests.pdrouter.router.worker_health import worker_health


def _instances(n: int, role: str = "prefill") -> list[Instance]:
    return [Instance(f"http://127.0.0.1:{9000 + i}", role) for i in range(n)]  # type: ignore[arg-type]


def test_round_robin_cycles_in_order_and_adapts_to_a_shrinking_list() -> None:
    policy = RoundRobin()
    insts = _instances(3)
    picks = [policy.pick(insts).url[-4:] for _ in range(7)]
    assert picks == ["9000", "9001", "9002", "9000", "9001", "9002", "9000"]
    # One instance left out (down): the counter keeps going over the two that remain.
    picks = [policy.pick(insts[1:]).url[-4:] for _ in range(3)]
    assert picks == ["9002", "9001", "9002"]


def test_round_robin_refuses_an_empty_list() -> None:
    with pytest.raises(ValueError, match="at least one candidate"):
        RoundRobin().pick([])


def test_least_in_flight_picks_the_idlest_first_on_ties() -> None:
    insts = _instances(3)
    insts[0].in_flight, insts[1].in_flight, insts[2].in_flight = 2, 1, 1
    assert LeastInFlight().pick(insts) is insts[1]
    insts[1].in_flight = 3
    assert LeastInFlight().pick(insts) is insts[2]


def test_make_policy_by_name_and_unknown_names_listed() -> None:
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert isinstance(make_policy("least_in_flight"), LeastInFlight)
    with pytest.raises(
        ValueError,
        match=r"unknown selection policy 'fastest'; known: cache_aware, "
        r"least_in_flight, least_loaded, power_of_two, round_robin",
    ):
        make_policy("fastest")


def test_fingerprints_agree() -> None:
    insts = _instances(2) + _instances(1, "decode")
    for inst in insts:
        inst.fingerprint, inst.block_size = "aaaa", 16
    assert check_fingerprints(insts) == "aaaa"


def test_fingerprint_mismatch_names_both_instances_and_both_fingerprints() -> None:
    p, d = _instances(1)[0], _instances(1, "decode")[0]
    d.url = "http://127.0.0.1:9100"
    p.fingerprint, p.block_size, p.model = "aaaa", 16, "tiny"
    d.fingerprint, d.block_size, d.model = "bbbb", 8, "tiny"
    with pytest.raises(FingerprintMismatch) as info:
        check_fingerprints([p, d])
    message = str(info.value)
    assert "prefill http://127.0.0.1:9000 has fingerprint aaaa (block size 16" in message
    assert "decode http://127.0.0.1:9100 has bbbb (block size 8" in message


def test_unchecked_instances_are_ignored_but_one_must_answer() -> None:
    insts = _instances(2)
    with pytest.raises(FingerprintMismatch, match="no instance answered"):
        check_fingerprints(insts)
    insts[1].fingerprint = "cccc"
    assert check_fingerprints(insts) == "cccc"


def test_registry_health_updates_and_late_mismatch_stays_down() -> None:
    every_check = HealthThresholds(unhealthy_after=1, healthy_after=1)  # no hysteresis here
    reg = Registry(["http://127.0.0.1:9000/"], ["http://127.0.0.1:9001"], every_check)
    assert [i.url for i in reg.all()] == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    p, d = reg.prefill[0], reg.decode[0]
    reg.check_passed(p, worker_health("aaaa", role="prefill"))
    reg.check_passed(d, worker_health("aaaa"))
    reg.fingerprint = check_fingerprints(reg.all())
    assert [i.healthy for i in reg.all()] == [True, True]
    assert reg.models() == ["tiny"]
    reg.mark_down(d, "ConnectError")
    assert reg.healthy("decode") == [] and d.last_error == "ConnectError"
    # The decode instance comes back serving another model: it must stay out.
    reg.check_passed(d, worker_health("ffff", model="other"))
    assert not d.healthy
    assert d.last_error == "fingerprint ffff differs from the cluster's aaaa"
    reg.check_passed(d, worker_health("aaaa"))
    assert d.healthy and d.last_error == ""


def test_registry_needs_both_roles() -> None:
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        Registry(["http://127.0.0.1:9000"], [])


def test_the_router_side_never_imports_paddle() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pdrouter.cli, pdrouter.router.serve, pdrouter.router.app, "
        "pdrouter.launch.cluster, pdrouter.router.orchestrator, pdrouter.wire.pd; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('paddle', 'workers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
