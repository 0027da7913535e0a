"""Real memory cgroups for tests and benchmarks: run a command under a hard memory limit.

>>> from cgroups import memory_cgroup, skip_reason          # doctest: +SKIP
>>> if (reason := skip_reason()): pytest.skip(reason)        # doctest: +SKIP
>>> with memory_cgroup(512 << 20) as cg:                     # doctest: +SKIP
...     proc = cg.run([sys.executable, "script.py"], timeout=60)
...     killed = cg.oom_kills() > 0

The cgroup is made next to this process's own memory cgroup: a child folder of it on
cgroup v1; on v2 a child of the nearest ancestor (itself included) whose
``cgroup.subtree_control`` lists ``memory`` (v2 forbids a cgroup with processes from
handing controllers to children, so that is usually an ancestor). Swap is limited too
(v1 ``memory.memsw.limit_in_bytes``, v2 ``memory.swap.max = 0``) where the kernel
accounts it, so a process over the limit is killed instead of swapping. Names are unique
(``tierflow-test-<pid>-<random>``). Leaving the ``with`` block, also on an exception,
kills every process still in the cgroup (they can only have got there through
:meth:`CgroupHandle.wrap`) and removes the folder; folders left by a test process that
died are removed the next time a cgroup is made.

Needs a writable cgroup hierarchy (in practice: root); :func:`skip_reason` says why not.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierflow.system.limits import own_cgroup

__all__ = ["PREFIX", "CgroupHandle", "available", "memory_cgroup", "skip_reason"]

PREFIX = "tierflow-test-"

# `sh` writes its own pid into the cgroup and then becomes the command, so everything the
# command allocates is charged to the cgroup from its first byte.
_WRAPPER = 'echo $$ > "$0" && exec "$@"'


@dataclass(frozen=True)
class CgroupHandle:
    """A memory cgroup made by :func:`memory_cgroup`; ``path`` is its folder."""

    path: Path
    version: int  # 1 or 2
    limit_bytes: int

    @property
    def name(self) -> str:
        """The folder name (unique per cgroup)."""
        return self.path.name

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` prefixed so that it runs inside this cgroup (a ``sh`` that moves itself
        in and then ``exec``s the command; the pid stays the same)."""
        return ["sh", "-c", _WRAPPER, str(self.path / "cgroup.procs"), *cmd]

    def run(
        self, cmd: Sequence[str], *, timeout: float, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` of ``cmd`` inside this cgroup (``capture_output`` and
        ``text`` default to True). A process killed by the kernel's OOM killer returns
        ``-9``; :meth:`oom_kills` tells it apart from other kills."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.wrap(cmd), timeout=timeout, **kwargs)

    def pids(self) -> list[int]:
        """The processes in the cgroup now."""
        with contextlib.suppress(OSError):
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        return []

    def usage_bytes(self) -> int:
        """Memory charged to the cgroup now, page cache included."""
        return int(self._read("memory.usage_in_bytes" if self.version == 1 else "memory.current"))

    def peak_bytes(self) -> int | None:
        """The most memory ever charged to the cgroup, or None where the kernel does not
        keep it (v2 before Linux 5.19)."""
        text = self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")
        return int(text) if text.strip().isdigit() else None

    def oom_kills(self) -> int:
        """How many processes the OOM killer killed in this cgroup (0 where the kernel does
        not count them: v1 before Linux 4.13)."""
        text = self._read("memory.oom_control" if self.version == 1 else "memory.events")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def kill(self) -> None:
        """SIGKILL every process in the cgroup and wait (up to 5 s) until it is empty."""
        deadline = time.monotonic() + 5
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def _read(self, file: str) -> str:
        with contextlib.suppress(OSError):
            return (self.path / file).read_text()
        return ""


def _parent(root: str = "/") -> tuple[Path, int] | str:
    """(the folder to make test cgroups in, the cgroup version), or why there is none."""
    cgroup = own_cgroup(root)
    if cgroup is None:
        return "no memory cgroup controller is mounted on this machine"
    folder, mount = Path(cgroup.folder), Path(cgroup.mount)
    if cgroup.version == 1:
        return folder, 1
    while True:
        try:
            subtree = (folder / "cgroup.subtree_control").read_text().split()
        except OSError:
            subtree = []
        if "memory" in subtree:
            return folder, 2
        if folder == mount or mount not in folder.parents:
            return (
                f"cgroup v2: no cgroup from {cgroup.folder} up to {cgroup.mount} lists memory "
                f"in cgroup.subtree_control, so no child can get a memory limit"
            )
        folder = folder.parent


@functools.lru_cache(maxsize=1)
def skip_reason() -> str | None:
    """Why a memory cgroup cannot be made here, or None when it can (probed once)."""
    parent = _parent()
    if isinstance(parent, str):
        return parent
    folder, _ = parent
    probe = folder / f"{PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError as e:
        return f"cannot make a memory cgroup under {folder}: {e.strerror} (needs root)"
    try:
        probe.rmdir()
    except OSError as e:
        return f"made {probe} but cannot remove it: {e.strerror}"
    return None


def available() -> bool:
    """True when :func:`memory_cgroup` works on this machine."""
    return skip_reason() is None


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[CgroupHandle]:
    """Make a memory cgroup limited to ``limit_bytes`` of RAM (and no swap); remove it on exit.

    Raises ``RuntimeError`` with :func:`skip_reason` where the machine does not allow it.
    On exit every process still inside is killed; a folder that cannot be removed is
    reported with a ``RuntimeWarning`` rather than hiding the body's own exception.
    """
    reason = skip_reason()
    if reason is not None:
        raise RuntimeError(reason)
    parent = _parent()
    assert not isinstance(parent, str)
    folder, version = parent
    _remove_stale(folder)
    path = folder / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    handle = CgroupHandle(path, version, limit_bytes)
    try:
        _set_limit(handle)
        yield handle
    finally:
        handle.kill()
        _remove(path)


def _set_limit(handle: CgroupHandle) -> None:
    limit = str(handle.limit_bytes)
    if handle.version == 1:
        (handle.path / "memory.limit_in_bytes").write_text(limit)
        # memsw (RAM + swap) must be at least the RAM limit, so it is written second; it
        # is missing where the kernel does not account swap.
        with contextlib.suppress(OSError):
            (handle.path / "memory.memsw.limit_in_bytes").write_text(limit)
    else:
        (handle.path / "memory.max").write_text(limit)
        with contextlib.suppress(OSError):
            (handle.path / "memory.swap.max").write_text("0")


def _remove(path: Path) -> None:
    # rmdir answers EBUSY for a moment after the last process died.
    deadline = time.monotonic() + 5
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if time.monotonic() > deadline:
                warnings.warn(
                    f"could not remove test cgroup {path}: {e.strerror}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
            time.sleep(0.05)


def _remove_stale(folder: Path) -> None:
    """Remove empty test cgroups whose creating process is gone."""
    with contextlib.suppress(OSError):
        for child in folder.iterdir():
            if not child.name.startswith(PREFIX) or not child.is_dir():
                continue
            pid_text = child.name[len(PREFIX) :].removeprefix("probe-").split("-")[0]
            if not pid_text.isdigit() or _alive(int(pid_text)):
                continue
            with contextlib.suppress(OSError):
                if not (child / "cgroup.procs").read_text().split():
                    child.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
