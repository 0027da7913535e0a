"""PSI parsing and where the stall figures are read from (tierflow/system/psi.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierflow import config
from tierflow.system import pressure as pressure_mod
from tierflow.system.psi import Psi, PsiLine, parse_psi, read_psi

from common import fixed_memory

GB = 1 << 30

NORMAL = (
    "some avg10=12.34 avg60=5.00 avg300=1.25 total=987654\n"
    "full avg10=6.50 avg60=2.00 avg300=0.50 total=123456\n"
)
NO_FULL = "some avg10=1.50 avg60=0.40 avg300=0.10 total=4242\n"
QUIET = (
    "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    """An empty fake root, set as the ``proc_root`` setting."""
    root = tmp_path / "root"
    root.mkdir()
    config.set(proc_root=str(root))
    return root


def proc_file(root: Path) -> Path:
    return root / "proc" / "pressure" / "memory"


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Fixed memory figures for pressure(); tests set ``cgroup_dir`` and sizes in the dict."""
    return fixed_memory(monkeypatch)


# -- parse_psi ------------------------------------------------------------------------------


def test_parse_normal_file() -> None:
    psi = parse_psi(NORMAL, "/x/memory.pressure")
    assert psi == Psi(
        some=PsiLine(12.34, 5.0, 1.25, 987654),
        full=PsiLine(6.5, 2.0, 0.5, 123456),
        path="/x/memory.pressure",
    )


def test_parse_without_full_line_as_older_kernels_write() -> None:
    psi = parse_psi(NO_FULL)
    assert psi.some.avg10 == 1.5
    assert psi.full is None


def test_parse_ignores_unknown_lines_and_blank_lines() -> None:
    psi = parse_psi("\nfuture avg10=1 x=2\n" + NORMAL + "\n")
    assert psi.some.avg10 == 12.34
    assert psi.full is not None and psi.full.total == 123456


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no 'some avg10=...' line"),
        ("hello world\n", "no 'some avg10=...' line"),
        (NO_FULL + "full avg10=6.50 avg60=2.00 total=1\n", "cannot parse PSI line 'full avg10"),
        ("some avg10=abc avg60=0 avg300=0 total=0", "avg10=abc is not a number"),
        ("some avg10=1 avg60=0 avg300=0 total=1.5", "total=1.5 is not a whole number"),
        ("some avg10=1.0 avg60=0 total=0", "missing avg300"),
        ("some avg10=101.0 avg60=0 avg300=0 total=0", "avg10=101.0 is not a percentage"),
        ("some avg10=-1 avg60=0 avg300=0 total=0", "avg10=-1 is not a percentage"),
        ("some avg10=nan avg60=0 avg300=0 total=0", "avg10=nan is not a percentage"),
        ("some avg10=1 avg60=0 avg300=0 total=-5", "total=-5 is negative"),
        ("some avg10 avg60=0 avg300=0 total=0", "'avg10' is not key=value"),
    ],
)
def test_parse_garbage_raises_value_error_naming_the_file(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_psi(text, "/fake/pressure")
    assert "/fake/pressure" in str(info.value)


@given(
    some=st.tuples(*[st.floats(0, 100, allow_nan=False)] * 3, st.integers(0, 2**63)),
    full=st.none() | st.tuples(*[st.floats(0, 100, allow_nan=False)] * 3, st.integers(0, 2**63)),
)
def test_parse_round_trips_what_the_kernel_writes(
    some: tuple[float, float, float, int], full: tuple[float, float, float, int] | None
) -> None:
    def line(kind: str, v: tuple[float, float, float, int]) -> str:
        return f"{kind} avg10={v[0]:.2f} avg60={v[1]:.2f} avg300={v[2]:.2f} total={v[3]}\n"

    text = line("some", some) + ("" if full is None else line("full", full))
    psi = parse_psi(text)
    assert psi.some.avg10 == pytest.approx(round(some[0], 2), abs=0.006)
    assert psi.some.total == some[3]
    assert (psi.full is None) == (full is None)
    if full is not None and psi.full is not None:
        assert psi.full.avg300 == pytest.approx(round(full[2], 2), abs=0.006)


@pytest.mark.skipif(not os.path.exists("/proc/pressure/memory"), reason="kernel without PSI")
def test_parse_this_machines_file() -> None:
    psi = read_psi(root="/")
    assert psi is not None
    assert 0.0 <= psi.some.avg10 <= 100.0


# -- read_psi: which file -----------------------------------------------------------------------


def test_read_from_proc_under_proc_root(proc_root: Path) -> None:
    path = write(proc_file(proc_root), NORMAL)
    psi = read_psi()
    assert psi is not None
    assert psi.path == str(path)
    assert (psi.some.avg10, psi.full and psi.full.avg10) == (12.34, 6.5)


def test_explicit_root_wins_over_setting(proc_root: Path, tmp_path: Path) -> None:
    write(proc_file(proc_root), NORMAL)
    other = tmp_path / "other"
    write(proc_file(other), NO_FULL)
    psi = read_psi(root=str(other))
    assert psi is not None and psi.some.avg10 == 1.5


def test_absent_file_is_none_without_warning(
    proc_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="tierflow"):
        assert read_psi() is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_unreadable_file_is_none_without_warning(
    proc_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a folder in place of the file stands in for EOPNOTSUPP (kernel booted with psi=0)
    proc_file(proc_root).mkdir(parents=True)
    with caplog.at_level(logging.DEBUG, logger="tierflow"):
        assert read_psi() is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "not readable" in caplog.text


def test_garbage_is_none_with_one_warning(
    proc_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(proc_file(proc_root), "some avg10=lots\n")
    with caplog.at_level(logging.DEBUG, logger="tierflow"):
        assert read_psi() is None
        assert read_psi() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "a broken file read twice a second must not flood the log"
    assert str(path) in warnings[0].getMessage()
    assert "from free memory alone" in warnings[0].getMessage()


def test_cgroup_file_is_preferred_over_proc(proc_root: Path, tmp_path: Path) -> None:
    write(proc_file(proc_root), QUIET)
    cgroup = tmp_path / "sys" / "fs" / "cgroup" / "job"
    own = write(cgroup / "memory.pressure", NORMAL)
    psi = read_psi(str(cgroup))
    assert psi is not None
    assert psi.path == str(own)
    assert psi.some.avg10 == 12.34


def test_cgroup_without_file_falls_back_to_proc(proc_root: Path, tmp_path: Path) -> None:
    proc = write(proc_file(proc_root), NO_FULL)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    psi = read_psi(str(cgroup))
    assert psi is not None and psi.path == str(proc)


def test_cgroup_garbage_warns_and_falls_back_to_proc(
    proc_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = write(proc_file(proc_root), NO_FULL)
    cgroup = tmp_path / "cgroup"
    write(cgroup / "memory.pressure", "garbage\n")
    with caplog.at_level(logging.WARNING, logger="tierflow"):
        psi = read_psi(str(cgroup))
    assert psi is not None and psi.path == str(proc)
    assert str(cgroup / "memory.pressure") in caplog.text


# -- the same through pressure() --------------------------------------------------------------


def test_pressure_reads_the_cgroup_dir_from_the_memory_figures(
    proc_root: Path, tmp_path: Path, figures: dict[str, object]
) -> None:
    write(proc_file(proc_root), QUIET)
    cgroup = tmp_path / "cgroup"
    write(cgroup / "memory.pressure", NORMAL)
    figures["cgroup_dir"] = str(cgroup)
    reading = pressure_mod.pressure()
    assert (reading.psi_some, reading.psi_full) == (12.34, 6.5)
    assert reading.psi_path == str(cgroup / "memory.pressure")
    # full 6.5 % > 5 % lifts a comfortable free fraction (75 %) to high
    assert reading.level == "high"


def test_pressure_without_full_line(proc_root: Path, figures: dict[str, object]) -> None:
    write(proc_file(proc_root), NO_FULL)
    reading = pressure_mod.pressure()
    assert (reading.psi_some, reading.psi_full) == (1.5, None)
    assert str(reading).endswith("stalls 1.5 % (some) / unknown (full)")


def test_pressure_without_psi_uses_free_fraction_alone(
    proc_root: Path, figures: dict[str, object]
) -> None:
    figures["free"] = int(0.08 * 8 * GB)
    reading = pressure_mod.pressure()
    assert reading.psi_some is None and reading.psi_full is None and reading.psi_path is None
    assert reading.level == "high"
    assert str(reading).endswith("stalls unknown (no PSI)")


def test_pressure_with_garbage_psi_uses_free_fraction_alone(
    proc_root: Path, figures: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    write(proc_file(proc_root), "full avg10=99.00\n")
    with caplog.at_level(logging.WARNING, logger="tierflow"):
        reading = pressure_mod.pressure()
    assert reading.level == "ok" and reading.psi_some is None
    assert "ignoring memory stall figures" in caplog.text
