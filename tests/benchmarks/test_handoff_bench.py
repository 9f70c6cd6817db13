"""The handoff benchmark and its pool probes run end to end on the CPU against a real pool.

Both start real mooncake_master and `pdworker pool` processes (LocalPool) and P, D and pool
workers as processes of their own; every one is stopped by PID inside the benchmark.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.handoff import __main__ as handoff
from benchmarks.handoff import probes


def _table_rows(text: str) -> list[list[str]]:
    """Cells of the handoff table's rows (the first table of the report)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| 64 (61) |"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.mark.parametrize("mode", ["serialized", "pipelined"])
def test_cpu_handoff_moves_every_byte_of_a_scattered_prompt_with_a_partial_tail(
    tmp_path, mode
) -> None:
    out = tmp_path / "handoff.md"
    argv = ["--cpu", "--tokens", "64", "--block-sizes", "16", "--warm-reps", "1", "--mode", mode]
    argv += ["--group-blocks", "2"]  # 4 blocks in 2 groups: the pipeline overlaps
    assert handoff.main([*argv, "--output", str(out)]) == 0
    text = out.read_text()
    assert "`python -m benchmarks.handoff --cpu --tokens 64 --block-sizes 16" in text
    assert "Device: no GPU" in text
    assert f"Mode `{mode}`" in text
    rows = _table_rows(text)
    # prompt, block, blocks (tail), MiB, pool, D2H, put, get, H2D, handoff ms, ratios, exact
    assert [(r[1], r[2], r[4], r[-1]) for r in rows] == [
        ("16", "4 (13 in last)", "cold", "yes"),
        ("16", "4 (13 in last)", "warm", "yes"),
    ]
    for row in rows:
        assert float(row[9]) > 0  # handoff ms
        for cell in row[5:9]:  # stage cells "ms (GB/s)"; pipelined: time waited, may be ~0
            ms = cell.split()[0]
            assert float(ms) > 0 if mode == "serialized" else float(ms) >= 0


def test_cpu_probes_measure_the_pool_and_which_staging_mooncake_accepts(tmp_path) -> None:
    out = tmp_path / "probes.md"
    assert probes.main(["--cpu", "--only", "value_batch,staging", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert not [r for r in rows if "failed" in str(r.get("note", ""))]
    measured = {
        (r["value"], r["temp"], r["op"], r["batch"]) for r in rows if r["probe"] == "value_batch"
    }
    small, big = probes.pool_probes.CPU_SIZES.small_value, probes.pool_probes.CPU_SIZES.big_value
    assert measured == {
        *((small, "cold", op, 64) for op in ("put", "get")),
        *((small, "warm", op, b) for op in ("put", "get") for b in (1, 8, 64)),
        *((big, "cold", op, 32) for op in ("put", "get")),
        *((big, "warm", op, b) for op in ("put", "get") for b in (1, 8)),
    }
    staging = {r["variant"]: r for r in rows if r["probe"] == "staging"}
    assert set(staging) == {"shm-mooncake", "shm-pinned", "tcp-pageable", "tcp-pinned"}
    # Over shared memory Mooncake takes only the buffer it allocated; over TCP any memory.
    assert staging["shm-mooncake"]["register_buffer_rc"] == 0
    assert staging["shm-pinned"]["register_buffer_rc"] != 0
    for name in ("shm-mooncake", "tcp-pageable", "tcp-pinned"):
        assert staging[name]["register_buffer_rc"] == 0
        assert staging[name]["exact"] is True
    assert "## Staging buffer per transport" in out.read_text()
