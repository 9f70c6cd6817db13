"""The handoff benchmark runs end to end on the CPU against a real pool.

It starts real mooncake_master and `pdworker pool` processes (LocalPool) and P and D as
processes of their own; every one is stopped by PID inside the benchmark.
"""

from __future__ import annotations

import pytest

from benchmarks.handoff import __main__ as handoff


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


def test_the_chunked_bench_sizes_its_pool_for_one_case_not_every_pair() -> None:
    """--tokens 4096,16384 --chunks 512,1024 --block-sizes 16,64 asked for one 192 GiB segment
    (every pair at once) and the owner never started on a 128 GiB host: each (path, block,
    chunk) case now gets its own pool, sized for that case's prompts alone."""
    from benchmarks.handoff import chunked

    per_token = chunked.LAYERS * 2 * chunked.KV_HEADS * chunked.HEAD_DIM * 2
    one_case = chunked.pool_bytes((4096 + 16384) * per_token, reps=2)
    assert one_case == int(4 * 3 * (4096 + 16384) * per_token * 1.6)
    assert one_case < 64 * 2**30
