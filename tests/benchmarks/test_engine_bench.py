"""The engine benchmark runs end to end on a small setting and writes its table."""

from __future__ import annotations

from benchmarks import engine as bench


def test_bench_writes_a_row_per_model_and_stream_count(tmp_path) -> None:
    out = tmp_path / "engine.md"
    argv = ["--models", "tiny", "--streams", "1,2", "--max-tokens", "4", "--prompt-len", "8"]
    argv += ["--repeats", "1"]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    assert bench.main(argv) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| tiny |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "2"]
    assert rows[0].split("|")[4].strip() == "1.0x"
    assert "python -m benchmarks.engine --models tiny --streams 1,2" in text
