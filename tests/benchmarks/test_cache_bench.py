"""benchmarks/cache's table and figure from fixed samples (the runs themselves are too slow
for a test): exact cells, and a PNG written."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.cache import report
from benchmarks.cache.workloads import Sample, WorkloadResult


def _results() -> report.Results:
    def wl(name: str, ttfts: list[tuple[int, float]], cached: float) -> WorkloadResult:
        samples = [Sample(i, t, 100, int(cached)) for i, t in ttfts]
        return WorkloadResult(name, samples, {"device": cached, "pool": 0.0, "computed": 100.0})

    def case(scale: float, cached: float) -> dict[str, WorkloadResult]:
        return {
            "multi_turn": wl("multi_turn", [(1, 2.0), (2, 2.0 * scale), (1, 1.0)], cached),
            "shared_doc": wl("shared_doc", [(1, 4.0), (2, 4.0 * scale), (3, 4.0 * scale)], cached),
            "no_reuse": wl("no_reuse", [(1, 0.5), (2, 0.5)], 0.0),
        }

    return {"cache off": case(1.0, 0.0), "device+pool": case(0.05, 300.0)}


def test_table_cells() -> None:
    text = report.render(_results(), "cmd", "settings")
    assert "| 2 | 2000 / 2000 | 100 / 100 |" in text  # turn 2: p50 / p90 per case
    assert "| device+pool | 4000 | 200 | 200 | 0.05 | 75% (300 device + 0 pool of 400; " in text
    assert "| cache off | 500 | 500 | 1.00 |" in text


def test_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra draws the figure")
    png = tmp_path / "cache.png"
    report.draw(_results(), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
