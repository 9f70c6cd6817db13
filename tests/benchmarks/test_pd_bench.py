"""The PD benchmark's file: its two sections rewrite themselves and keep the rest."""

from __future__ import annotations

from benchmarks.pd import render_overlap
from benchmarks.table_file import publish_section


def _row(ttft_s: float, wait_s: float, early: float) -> dict[str, float]:
    return {"TTFT": ttft_s, "P compute": 9.9, "D2H": 0.006, "put": 0.018,
            "write wait": wait_s, "blocks early": early}  # fmt: skip


def test_sections_replace_only_themselves(tmp_path) -> None:
    out = tmp_path / "pd.md"
    publish_section(out, "pd", "# PD\n\nmain 1")
    with out.open("a") as f:
        f.write("\nNote written by hand.\n")
    publish_section(out, "pd-overlap", "## Overlap\n\noverlap 1")
    publish_section(out, "pd", "# PD\n\nmain 2")
    publish_section(out, "pd-overlap", "## Overlap\n\noverlap 2")
    text = out.read_text()
    assert "main 1" not in text and "overlap 1" not in text
    assert text.index("main 2") < text.index("Note written by hand.") < text.index("overlap 2")
    assert text.count("<!-- pd:begin -->") == text.count("<!-- pd-overlap:begin -->") == 1


def test_overlap_table_pairs_on_and_off() -> None:
    results = {"on": {4096: _row(10.0, 0.006, 192)}, "off": {4096: _row(10.02, 0.024, 0)}}
    text = render_overlap(results, [4096], reps=3)
    row = next(line for line in text.splitlines() if line.startswith("| 4096 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["4096", "256", "10000.0", "10020.0", "20.0", "9900.0", "9900.0",
                     "24.0", "24.0", "6.0", "24.0", "192", "0"]  # fmt: skip
    assert "--overlap-compare --overlap-lengths 4096 --reps 3" in text
