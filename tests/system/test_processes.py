"""The process-liveness rule: pid plus start time, /proc first, psutil as fallback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tierflow.system import processes
from tierflow.system.processes import UNKNOWN, may_be_running, start_time, token

from common import wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


@pytest.fixture
def gone_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_live_process_has_its_start_time_and_is_running() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        start = start_time(child.pid)
        assert start is not None and start > UNKNOWN
        assert may_be_running(child.pid, start)
        assert token(child.pid) == f"{child.pid}-{start}"
    finally:
        child.communicate(b"")


def test_a_gone_process_has_no_start_time_and_is_not_running(gone_pid: int) -> None:
    assert start_time(gone_pid) is None
    assert not may_be_running(gone_pid, 12345)
    assert not may_be_running(gone_pid, UNKNOWN)


def test_a_zombie_is_not_running_though_its_pid_still_answers_a_signal() -> None:
    child = subprocess.Popen(["true"])  # exits at once; not reaped until wait()
    try:
        wait_for(lambda: _state(child.pid) == "Z", 10, "the child to exit")
        os.kill(child.pid, 0)  # the pid is still there...
        assert start_time(child.pid) is None  # ...but nothing runs under it
        assert not may_be_running(child.pid, UNKNOWN)
    finally:
        child.wait()


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def test_a_reused_pid_with_another_start_time_is_not_the_same_process() -> None:
    me = os.getpid()
    start = start_time(me)
    assert start is not None and start > UNKNOWN
    assert may_be_running(me, start)
    assert not may_be_running(me, start + 1)


def test_an_unknown_start_on_either_side_keeps_the_file() -> None:
    me = os.getpid()
    assert may_be_running(me, UNKNOWN)


def test_own_token_is_pid_and_start_time() -> None:
    assert token() == f"{os.getpid()}-{start_time(os.getpid())}"


def test_without_proc_psutil_gives_the_same_start_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gone_pid: int
) -> None:
    me = os.getpid()
    from_proc = start_time(me)
    monkeypatch.setattr(processes, "_PROC", str(tmp_path / "no-proc"))
    asked: list[int] = []
    real = psutil.Process

    def spy(pid: int) -> psutil.Process:
        asked.append(pid)
        return real(pid)

    monkeypatch.setattr(psutil, "Process", spy)
    # Same unit as /proc, so a token written one way compares equal the other way.
    assert start_time(me) == from_proc
    assert start_time(gone_pid) is None
    assert asked == [me, gone_pid]
    assert may_be_running(me, from_proc or -1)
    assert not may_be_running(gone_pid, 12345)


def test_an_unreadable_stat_file_falls_back_to_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    from_proc = start_time(me)

    def denied(pid: int) -> int:
        raise PermissionError(13, "Permission denied", f"/proc/{pid}/stat")

    monkeypatch.setattr(processes, "_from_proc", denied)
    assert start_time(me) == from_proc


def test_a_process_psutil_may_not_inspect_is_unknown_and_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def denied(pid: int) -> psutil.Process:
        raise psutil.AccessDenied(pid)

    monkeypatch.setattr(processes, "_PROC", "/nonexistent-proc")
    monkeypatch.setattr(psutil, "Process", denied)
    assert start_time(os.getpid()) == UNKNOWN
    assert may_be_running(os.getpid(), 12345)


def test_a_pid_hidden_by_proc_but_alive_is_unknown(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gone_pid: int
) -> None:
    fake = tmp_path / "proc"
    (fake / "self").mkdir(parents=True)  # a /proc mounted with hidepid=2: others are absent
    monkeypatch.setattr(processes, "_PROC", str(fake))
    assert start_time(os.getppid()) == UNKNOWN
    assert may_be_running(os.getppid(), 12345)
    assert start_time(gone_pid) is None
