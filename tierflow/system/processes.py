"""Is a process still running? The one rule behind every "remove what a dead process left".

Files a process leaves behind (spill folders, ``to_npy`` temporaries, store temporaries,
shared arrays in /dev/shm) carry its :func:`token` in their names: ``<pid>-<start>``,
where ``<start>`` is the process's start time. A pid alone is not enough, because the
kernel reuses pids; a pid with the same start time is the same process.

The start time is read from ``/proc/<pid>/stat`` (field 22, clock ticks since boot).
Where ``/proc`` is missing (not Linux) or the file cannot be read, psutil is asked,
and its answer is converted to the same unit (``(create_time - boot_time)`` times the
clock ticks per second), so a token written one way is compared correctly the other.

Three answers, and only one of them lets a caller delete anything::

    start_time(pid)   None      no process runs with that pid (gone, or a zombie)
                      UNKNOWN   a process has that pid, but its start cannot be read
                      int > 0   its start time

A zombie (a process that has exited and waits for its parent to collect its status) runs
no code and holds no file open, so it counts as gone: the pid still answers a signal 0
until its parent reaps it, which a check that a killed process has ended must not take
for life.

:func:`may_be_running` is False only for "gone" or "a known start that differs from
the recorded one": when in doubt, a file is kept. Pids compare only within one pid
namespace; containers that share a folder should not share these names.
"""

from __future__ import annotations

import os

import psutil

__all__ = ["UNKNOWN", "may_be_running", "start_time", "token"]

UNKNOWN = 0  # a start time that cannot be read (also what a token records then)

_PROC = "/proc"  # tests point it at a folder that is not there
_own: tuple[int, str] | None = None  # (pid, token) of this process; a fork child redoes it


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


_ENDED = (b"Z", b"X")  # /proc states of a process that has exited: zombie, dead


def _from_proc(pid: int) -> int | None:
    """Start time from ``/proc/<pid>/stat`` (None for a zombie); raises OSError when it
    cannot be read."""
    with open(f"{_PROC}/{pid}/stat", "rb") as f:
        stat = f.read()
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in _ENDED:
        return None
    return int(fields[19])


def _from_psutil(pid: int) -> int | None:
    """Start time from psutil, in clock ticks since boot like ``/proc``."""
    try:
        process = psutil.Process(pid)
        if process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        since_boot = process.create_time() - psutil.boot_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:
        return UNKNOWN
    return max(round(since_boot * _ticks_per_second()), UNKNOWN)


def _exists(pid: int) -> bool:
    """Whether some process has ``pid`` (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, but is not ours to signal
    return True


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot.

    None when no process runs with that pid (none has it, or it is a zombie); :data:`UNKNOWN` when one has, but its start time
    cannot be read (``/proc`` mounted with ``hidepid``, psutil denied). Never raises.
    """
    if pid <= 0:
        return None
    try:
        return _from_proc(pid)
    except FileNotFoundError:
        if os.path.isdir(f"{_PROC}/self"):
            # /proc works, so the pid is gone, or hidden from us (hidepid=2).
            return UNKNOWN if _exists(pid) else None
    except (OSError, ValueError, IndexError):
        pass
    return _from_psutil(pid)


def token(pid: int | None = None) -> str:
    """``"<pid>-<start>"`` for process ``pid`` (default: this one), to put in file names.

    The start is :data:`UNKNOWN` (0) when it cannot be read. This process's token is
    read once and read again in a forked child, which is another process.
    """
    global _own
    me = os.getpid()
    if pid is not None and pid != me:
        return f"{pid}-{start_time(pid) or UNKNOWN}"
    if _own is None or _own[0] != me:
        _own = (me, f"{me}-{start_time(me) or UNKNOWN}")
    return _own[1]


def may_be_running(pid: int, start: int) -> bool:
    """Whether the process that wrote the token ``<pid>-<start>`` may still run.

    False only when it is surely gone: no process has ``pid``, or the process that has
    it started at another time (the pid was reused). A start of :data:`UNKNOWN` on
    either side means "cannot tell", so True: a file is never removed on a guess.
    """
    now = start_time(pid)
    if now is None:
        return False
    return start == UNKNOWN or now in (UNKNOWN, start)
