"""find_free_port's range, narrowed by PDROUTER_PORT_RANGE (parallel test workers each own one)."""

from __future__ import annotations

import pytest

from pdrouter.common import proc
from pdrouter.common.proc import PORT_RANGE_ENV, find_free_port, hold_port, port_range


def test_without_the_variable_the_callers_range_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    assert port_range(20000, 32000) == (20000, 32000)


def test_the_variable_narrows_the_range_and_every_port_falls_inside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "22000-22010")
    assert port_range(20000, 32000) == (22000, 22010)
    assert port_range(22005, 32000) == (22005, 22010)
    ports = {find_free_port() for _ in range(30)}
    assert ports <= set(range(22000, 22010))


@pytest.mark.parametrize("spec", ["22000", "a-b", "22000-22010-3"])
def test_a_malformed_range_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, spec)
    with pytest.raises(ValueError, match=PORT_RANGE_ENV):
        port_range(20000, 32000)


def test_a_range_outside_the_callers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "40000-41000")
    with pytest.raises(ValueError, match="leaves no port"):
        port_range(20000, 32000)


def test_a_port_is_not_handed_out_twice_before_half_the_range_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A launcher probes every process's ports before any binds one: each must differ."""
    # Start from nothing handed out: earlier tests in this process may have drawn ports from
    # this range (it lies inside the xdist worker's own), which would start the count early.
    monkeypatch.setattr(proc, "_HANDED_OUT", set())
    monkeypatch.setenv(PORT_RANGE_ENV, "22100-22110")
    ports = [find_free_port() for _ in range(5)]
    assert len(set(ports)) == 5


def test_a_held_port_is_never_handed_out_until_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """hold_port keeps a port from every probe (the launcher holds its router's this way), and
    a port someone else holds cannot be held."""
    port = find_free_port()
    monkeypatch.setattr(proc, "_HANDED_OUT", set())
    monkeypatch.setenv(PORT_RANGE_ENV, f"{port}-{port + 1}")
    held = hold_port("127.0.0.1", port)
    try:
        with pytest.raises(RuntimeError, match="no free TCP port"):
            find_free_port()
        with pytest.raises(RuntimeError, match=rf"^port {port} on 127\.0\.0\.1 is in use \("):
            hold_port("127.0.0.1", port)
    finally:
        held.close()
    assert find_free_port() == port


def test_a_port_to_avoid_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """avoid: ports the process was given and binds later (the pool owner's flags)."""
    low, high = port_range(20000, 32000)
    port = find_free_port(low, high - 1)  # port + 1 in this test worker's range too
    monkeypatch.setenv(PORT_RANGE_ENV, f"{port}-{port + 2}")
    for _ in range(20):
        monkeypatch.setattr(proc, "_HANDED_OUT", set())
        assert find_free_port(avoid={port + 1}) == port
