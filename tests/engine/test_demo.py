"""The demo job (``tierflow demo``), on a small file."""

from __future__ import annotations

from pathlib import Path

from tierflow.config import MB
from tierflow.demo import run_demo


def test_demo_standardises_a_file_bigger_than_its_budget(tmp_path: Path) -> None:
    lines: list[str] = []
    report = run_demo(budget=8 * MB, file_bytes=32 * MB, folder=str(tmp_path), say=lines.append)
    assert report.file_bytes == 32 * MB and report.file_bytes >= 4 * report.budget
    assert report.stats_rate > 0 and report.write_rate > 0 and report.peak_rss > 0
    text = "\n".join(lines)
    assert "mean and std of every column, one pass" in text
    assert "standardised features written with to_npy" in text
    assert "peak RSS" in text and "4.0 x the 8.0 MB budget" in text
    assert list(tmp_path.iterdir()) == []  # the demo's folder is gone
