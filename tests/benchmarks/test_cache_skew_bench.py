"""benchmarks/cache_skew's table and figure from fixed results (the runs are too slow for a
test): exact cells, the balance of P loads, and a PNG written."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.cache_skew import report
from benchmarks.cache_skew.workload import SkewResult, Turn


def _result(ttfts: list[float], loads: list[tuple[float, float]], device: float) -> SkewResult:
    turns = [Turn(i, 1, True, 0.1 * i, t, 100, 0) for i, t in enumerate(ttfts)]
    samples = [(0.05 * i, {"http://p0": a, "http://p1": b}) for i, (a, b) in enumerate(loads)]
    sources = {"device": device, "pool": 100.0 - device, "computed": 100.0}
    return SkewResult(turns, samples, sources, wall_s=2.0)


def _results() -> dict[str, SkewResult]:
    return {
        "round_robin": _result([1.0, 2.0, 3.0, 4.0, 5.0], [(4, 1), (2, 1)], 0.0),
        "cache_aware@0.25": _result([1.0, 1.0, 2.0, 2.0, 3.0], [(2, 2), (1, 2)], 50.0),
    }


def test_table_cells_and_balance() -> None:
    results = _results()
    assert report.mean_loads(results["round_robin"]) == {"http://p0": 3.0, "http://p1": 1.0}
    assert report.balance(results["round_robin"]) == 3.0
    assert report.balance(results["cache_aware@0.25"]) == 2.0 / 1.5
    text = report.render(results, "cmd", "settings")
    assert "| round_robin | 3000 | 5000 |  | 0% | 50% | 50% | 3.00 / 1.00 | 3.00 | 2.0 |" in text
    assert "| cache_aware@0.25 | 2000 | 3000 | +40% | 25% | 25% | 50% | 1.50 / 2.00 | 1.33 |" in (
        text
    )


def test_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra draws the figure")
    png = tmp_path / "cache_skew.png"
    report.draw(_results(), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
