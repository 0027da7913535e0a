"""The benchmark suites' shared machinery (_harness.py): what every suite's report rests on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _harness import report_run, span, timed, verdict


def test_a_target_row_passes_when_its_value_reaches_the_target_either_way() -> None:
    assert verdict(1.5, 1.3) == "PASS"
    assert verdict(1.2, 1.3) == "MISS"
    assert verdict(0.9, 1.0, at_least=False) == "PASS"  # a cost: at most
    assert verdict(1.1, 1.0, at_least=False) == "MISS"
    assert verdict(None, 1.0) == "MISS"  # not measured
    assert verdict(None, None) == verdict(2.0, None) == "INFO"  # a figure without a target


def test_a_run_prints_its_report_and_writes_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def describe(report: dict[str, Any]) -> list[str]:
        return [f"sum {report['sum']}", "done"]

    path = tmp_path / "figures.json"
    report = report_run(lambda: {"sum": 3}, describe, str(path))
    assert report == {"sum": 3}
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["sum 3", "done"]
    assert lines[2].endswith(" s in all)")
    assert json.loads(path.read_text()) == {"sum": 3}
    report_run(lambda: {"sum": 4}, describe, None)  # no path: nothing written
    assert json.loads(path.read_text()) == {"sum": 3}


def test_a_span_is_the_median_and_the_range_in_its_unit() -> None:
    assert span([1.61, 1.4, 1.52]) == "1.52x (1.40-1.61)"
    assert span([0.002, 0.001, 0.003], " ms", 1000) == "2.00 ms (1.00-3.00)"
    assert span([]) == "-"


def test_timed_gives_the_result_and_a_duration() -> None:
    out, seconds = timed(lambda: sum(range(1000)))
    assert out == 499500
    assert 0 <= seconds < 5
