"""The registry's membership and health rules (plain data, an injected clock) and the
/instances admin API in-process. Health checks go to a small in-process app whose /health
answer each test sets, through a real httpx client."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from pdrouter.router.instances import health
from pdrouter.router.instances.instance import (
    FingerprintMismatch,
    HealthThresholds,
    RegistrationConflict,
)
from pdrouter.router.instances.registry import Registry
from tests.pdrouter.router.test_selection import selector_over
from tests.pdrouter.router.worker_health import answering_client, worker_health

FP = "fp-aaaa"
ADMIN = "admin-secret-1"


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _registration(role: str = "prefill", port: int = 9000, **over: Any) -> dict[str, Any]:
    body = {"role": role, "url": f"http://127.0.0.1:{port}", "fingerprint": FP, "block_size": 16,
            "model": "tiny", "capacity": 64, "num_kv_blocks": 96}  # fmt: skip
    return {**body, **over}


# -- registry: membership ---------------------------------------------------------------------


def test_first_registration_fixes_the_fingerprint_and_a_mismatch_names_both() -> None:
    reg = Registry([], [])
    assert reg.all() == [] and reg.fingerprint is None
    p, is_new = reg.register("prefill", "http://127.0.0.1:9000/", FP, 16, "tiny", 64, 96)
    assert (p.instance_id, p.url, p.source, is_new, reg.fingerprint) == (
        "p0", "http://127.0.0.1:9000", "registered", True, FP)  # fmt: skip
    assert (p.healthy, p.block_size, p.capacity, p.num_kv_blocks) == (False, 16, 64, 96)
    with pytest.raises(FingerprintMismatch) as exc:
        reg.register("decode", "http://127.0.0.1:9001", "fp-bbbb", 8, "other")
    assert str(exc.value).startswith(
        "decode http://127.0.0.1:9001 has fingerprint fp-bbbb (block size 8, model other) "
        "but the cluster's is fp-aaaa"
    )
    assert [i.instance_id for i in reg.all()] == ["p0"]
    d, _ = reg.register("decode", "http://127.0.0.1:9001", FP, 16)
    assert d.instance_id == "d1" and reg.decode == [d]


def test_registering_again_keeps_the_id_and_another_role_is_a_conflict() -> None:
    clock = FakeClock()
    reg = Registry([], [], clock=clock)
    p, _ = reg.register("prefill", "http://127.0.0.1:9000", FP, 16, capacity=8)
    clock.now_s = 105.0
    again, is_new = reg.register("prefill", "http://127.0.0.1:9000", FP, 16, capacity=32)
    assert (again is p, is_new, p.capacity, p.last_heartbeat_s) == (True, False, 32, 105.0)
    with pytest.raises(RegistrationConflict, match="already registered as prefill \\(p0\\)"):
        reg.register("decode", "http://127.0.0.1:9000", FP, 16)
    assert len(reg.all()) == 1


def test_static_lists_name_both_roles_or_neither() -> None:
    with pytest.raises(ValueError, match="or neither"):
        Registry([], ["http://127.0.0.1:9001"])
    reg = Registry(["http://127.0.0.1:9000"], ["http://127.0.0.1:9001"])
    assert [(i.instance_id, i.source) for i in reg.all()] == [("p0", "static"), ("d1", "static")]


def test_a_registration_must_match_the_static_cluster_fingerprint() -> None:
    reg = Registry(["http://127.0.0.1:9000"], ["http://127.0.0.1:9001"])
    reg.fingerprint = FP  # what startup fixed from the static instances
    with pytest.raises(FingerprintMismatch, match="but the cluster's is fp-aaaa"):
        reg.register("decode", "http://127.0.0.1:9002", "fp-cccc", 16)


def test_heartbeat_expiry_removes_only_silent_registered_instances() -> None:
    clock = FakeClock()
    reg = Registry(["http://127.0.0.1:9000"], ["http://127.0.0.1:9001"], clock=clock)
    removed: list[str] = []
    reg.on_removed(lambda inst: removed.append(inst.instance_id))
    reg.fingerprint = FP
    a, _ = reg.register("decode", "http://127.0.0.1:9002", FP, 16)
    b, _ = reg.register("decode", "http://127.0.0.1:9003", FP, 16)
    clock.now_s = 108.0
    assert reg.heartbeat(b.instance_id) is b and reg.heartbeat("d99") is None
    clock.now_s = 110.0
    assert reg.expire_heartbeats(ttl_s=10.0) == []  # a is exactly at the TTL: kept
    clock.now_s = 110.5
    assert reg.expire_heartbeats(ttl_s=10.0) == [a]
    assert [i.instance_id for i in reg.all()] == ["p0", "d1", "d3"]
    clock.now_s = 1000.0
    assert reg.expire_heartbeats(ttl_s=10.0) == [b]  # static ones never expire
    assert [i.instance_id for i in reg.all()] == ["p0", "d1"]
    assert removed == ["d2", "d3"]
    assert reg.remove("d1") is not None and reg.remove("d1") is None
    assert removed == ["d2", "d3", "d1"]


def test_draining_instances_take_no_new_request_until_undrained() -> None:
    reg = Registry([f"http://127.0.0.1:{9000 + i}" for i in range(2)], ["http://127.0.0.1:9100"])
    orch = selector_over(reg)
    p0, p1 = reg.prefill
    p0.healthy = p1.healthy = True
    assert reg.set_draining("p0", True) is p0
    assert reg.healthy("prefill") == [p1] and reg.routable("prefill") == [p1]
    assert [orch.pick("prefill", set()) for _ in range(3)] == [p1, p1, p1]
    assert orch.pick("prefill", {p1.url}) is None  # never the draining one, even as last resort
    p0.in_flight = 1
    assert (reg.describe_instance(p0)["draining"], reg.describe_instance(p0)["drained"]) == (
        True, False)  # fmt: skip
    p0.in_flight = 0
    assert reg.describe_instance(p0)["drained"] is True
    reg.set_draining("p0", False)
    assert {orch.pick("prefill", set()).url for _ in range(2)} == {p0.url, p1.url}
    assert reg.set_draining("p7", True) is None


# -- registry: health thresholds ------------------------------------------------------------


async def test_unhealthy_after_n_failed_checks_healthy_after_m_passed() -> None:
    reg = Registry(["http://p:1"], ["http://d:2"], HealthThresholds(unhealthy_after=3,
                                                                    healthy_after=2))  # fmt: skip
    reg.fingerprint = FP
    p = reg.prefill[0]
    ok_body = worker_health(FP, role="prefill").model_dump()
    answer: dict[str, Any] = {"status": 503, "body": {"status": "loading"}}
    async with answering_client(answer) as client:
        # Loading, then up on its first pass (it was never healthy: no hysteresis to apply).
        assert await health.check(reg, client, p, 1.0) is False
        assert (p.healthy, p.last_error) == (False, "/health answered HTTP 503")
        answer.update(status=200, body=ok_body)
        assert await health.check(reg, client, p, 1.0) is True and p.healthy
        # Two failures in a row are tolerated, the third takes it out.
        answer.update(status=500, body={})
        for n in (1, 2):
            assert await health.check(reg, client, p, 1.0) is False
            assert (p.healthy, p.consecutive_failures) == (True, n)
        assert await health.check(reg, client, p, 1.0) is False
        assert (p.healthy, p.consecutive_failures) == (False, 3)
        # Back after two passes in a row; a failure in between starts the count again.
        answer.update(status=200, body=ok_body)
        assert await health.check(reg, client, p, 1.0) is True
        assert (p.healthy, p.last_error) == (False, "recovering: 1 of 2 health checks passed")
        answer.update(status=500, body={})
        assert await health.check(reg, client, p, 1.0) is False
        answer.update(status=200, body=ok_body)
        assert await health.check(reg, client, p, 1.0) is True and not p.healthy
        assert await health.check(reg, client, p, 1.0) is True and p.healthy and p.last_error == ""
        # A failed request (transport error) takes it out at once, whatever the threshold.
        reg.mark_down(p, "ConnectError")
        assert (p.healthy, p.last_error) == (False, "ConnectError")
        # Another model behind the same URL: a pass of /health that still keeps it down.
        answer.update(body=worker_health("fp-zzzz", role="prefill", model="x").model_dump())
        for _ in range(3):
            assert await health.check(reg, client, p, 1.0) is False
        assert p.last_error == "fingerprint fp-zzzz differs from the cluster's fp-aaaa"


async def test_a_health_check_without_json_fails() -> None:
    reg = Registry(["http://p:1"], ["http://d:2"])
    app = FastAPI()

    @app.get("/health")
    async def health_route() -> str:
        return "fine"  # a JSON string, not an object: no field to read, must not crash

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        assert await health.check(reg, client, reg.prefill[0], 1.0) is False
        assert reg.prefill[0].last_error == (
            "/health answered a body that is not a WorkerHealth (body: Input should be an object)"
        )


# -- `pdrouter serve` flags -------------------------------------------------------------------


def _serve(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    import argparse

    from pdrouter.router import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    code = serve.run(parser.parse_args(argv))
    return code, capsys.readouterr().err


def test_serve_refuses_a_static_list_of_one_role(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _serve(["--prefill", "http://127.0.0.1:1"], capsys)
    assert code == 2
    assert err.startswith("pdrouter: refusing to start: ")
    assert "or neither, when every worker registers" in err


@pytest.mark.parametrize("argv", [["--unhealthy-after", "0"], ["--healthy-after", "0"]])
def test_serve_refuses_bad_thresholds_as_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from pdrouter.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("usage: pdrouter serve")
    assert "pdrouter serve: error: health thresholds must be >= 1" in err


def test_serve_instance_flags_reach_the_config() -> None:
    import argparse

    from pdrouter.router import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--admin-key", "a", "--internal-secret", "s", "--heartbeat-ttl-s",
                              "4.5", "--unhealthy-after", "5", "--healthy-after", "3"])  # fmt: skip
    cfg = serve.config_from_args(args)
    assert (cfg.prefill_urls, cfg.decode_urls) == ((), ())
    assert (cfg.admin_key, cfg.internal_secret, cfg.heartbeat_ttl_s) == ("a", "s", 4.5)
    assert (args.unhealthy_after, args.healthy_after) == (5, 3)
