"""Fake ``/proc`` and ``/sys/fs/cgroup`` trees for tests of :mod:`tierflow.system`.

tierflow reads every system file under a root path (the ``proc_root`` setting), so a test
builds a tree in a temporary folder and points the code at it:

>>> tree = FakeSystem(tmp_path, total=16 * GB, available=12 * GB)   # doctest: +SKIP
>>> tree.mount_v1("/docker/abc")                                    # doctest: +SKIP
>>> tree.v1("/docker/abc", limit=6 * GB, usage=2 * GB, inactive_file=1 * GB)  # doctest: +SKIP
>>> read_memory(tree.root)                                          # doctest: +SKIP

A mount records where a hierarchy is mounted (``point``) and which cgroup of it is the
mount's root (``mount_root``: ``/`` on a host, the container's own cgroup in a container
without a cgroup namespace). Mounting writes ``/proc/self/mountinfo`` and
``/proc/self/cgroup`` and creates every folder from the mount root down to the process's
cgroup with "no limit" files, as the kernel shows them. ``v1(...)`` and ``v2(...)`` then
set the figures of one cgroup; ``write`` and ``remove`` break files on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["GB", "MB", "V1_UNLIMITED", "FakeSystem"]

GB = 1 << 30
MB = 1 << 20

V1_UNLIMITED = 9223372036854771712  # what v1 memory.limit_in_bytes shows for "no limit"


@dataclass(frozen=True, kw_only=True)
class V1Stat:
    """The v1 figures a test rarely sets.

    ``total_inactive_file`` defaults to ``inactive_file``; -1 leaves the ``total_`` line
    out (as in an old kernel's stat of a cgroup without children).
    ``hierarchical_limit`` defaults to the cgroup's own limit.
    """

    total_inactive_file: int | None = None
    hierarchical_limit: int | None = None
    use_hierarchy: int = 1


@dataclass
class _FakeMount:
    version: int
    cgroup: str  # the process's cgroup inside this hierarchy
    point: str
    mount_root: str
    options: str


def _escape(path: str) -> str:
    """mountinfo's octal escapes for space, tab, newline and backslash."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


class FakeSystem:
    """A fake root with ``proc/meminfo``, ``proc/self/{mountinfo,cgroup}`` and cgroup folders.

    ``total`` and ``available`` are the host's MemTotal and MemAvailable in bytes (rounded
    down to KiB, as the kernel writes them). ``root`` is the path to hand to
    ``read_memory(root)`` or ``config.set(proc_root=...)``.
    """

    def __init__(self, base: Path | str, *, total: int = 16 * GB, available: int = 12 * GB):
        self.base = Path(base)
        self.base.mkdir(parents=True, exist_ok=True)
        self._mounts: list[_FakeMount] = []
        self.meminfo(total, available)
        self._write_proc()

    @property
    def root(self) -> str:
        return str(self.base)

    # -- host ----------------------------------------------------------------------------

    def meminfo(self, total: int, available: int | None, *, free: int | None = None) -> None:
        """Write /proc/meminfo; ``available=None`` leaves MemAvailable out (old kernels)."""
        if free is None:
            free = (available or 0) // 2
        lines = [
            f"MemTotal:       {total // 1024} kB",
            f"MemFree:        {free // 1024} kB",
        ]
        if available is not None:
            lines.append(f"MemAvailable:   {available // 1024} kB")
        cached = (available or 0) - free
        lines += [
            "Buffers:               0 kB",
            f"Cached:         {max(cached, 0) // 1024} kB",
            "SwapTotal:             0 kB",
            "HugePages_Total:       0",
        ]
        self.write("proc/meminfo", "\n".join(lines) + "\n")

    def pressure(self, some: float = 0.0, full: float = 0.0, *, cgroup: str | None = None) -> Path:
        """Write PSI figures (avg10; avg60 and avg300 follow) to /proc/pressure/memory,
        or to the ``memory.pressure`` of a v2 cgroup when ``cgroup`` is given."""
        text = (
            f"some avg10={some:.2f} avg60={some / 2:.2f} avg300={some / 4:.2f} total=12345\n"
            f"full avg10={full:.2f} avg60={full / 2:.2f} avg300={full / 4:.2f} total=6789\n"
        )
        if cgroup is None:
            return self.write("proc/pressure/memory", text)
        return self._write_at(self.folder(2, cgroup) / "memory.pressure", text)

    # -- mounts --------------------------------------------------------------------------

    def mount_v1(
        self,
        cgroup: str = "/",
        *,
        point: str = "/sys/fs/cgroup/memory",
        mount_root: str = "/",
        controllers: str = "memory",
    ) -> Path:
        """Mount a v1 hierarchy with ``controllers`` and put the process in ``cgroup``.

        Returns the folder of the process's cgroup.
        """
        mount = _FakeMount(1, cgroup, point, mount_root, controllers)
        self._mounts.append(mount)
        self._write_proc()
        if "memory" not in controllers.split(","):
            return self.base / point.lstrip("/") / cgroup[len(mount_root.rstrip("/")) :].lstrip("/")
        for level in self._chain(mount):
            self._v1_defaults(self.folder(1, level))
        return self.folder(1, cgroup)

    def mount_v2(
        self,
        cgroup: str = "/",
        *,
        point: str = "/sys/fs/cgroup",
        mount_root: str = "/",
        memory: bool = True,
    ) -> Path:
        """Mount the v2 tree and put the process in ``cgroup``; ``memory=False`` leaves the
        memory controller out of ``cgroup.controllers`` (as on a hybrid machine)."""
        mount = _FakeMount(2, cgroup, point, mount_root, "")
        self._mounts.append(mount)
        self._write_proc()
        controllers = "cpuset cpu io memory hugetlb pids" if memory else "cpuset cpu io pids"
        for level in self._chain(mount):
            self._v2_defaults(self.folder(2, level), controllers, is_root=level == "/")
        return self.folder(2, cgroup)

    def folder(self, version: int, cgroup: str) -> Path:
        """The folder of ``cgroup`` (a path inside the hierarchy) under the fake root."""
        mounts = [m for m in self._mounts if m.version == version]
        # v1: the hierarchy with the memory controller, where several are mounted.
        mount = next((m for m in mounts if "memory" in m.options.split(",")), None)
        mount = mount or next(iter(mounts), None)
        if mount is None:
            raise ValueError(f"no cgroup v{version} mounted in this fake tree")
        base = mount.mount_root.rstrip("/")
        if base and cgroup != base and not cgroup.startswith(base + "/"):
            raise ValueError(f"{cgroup} is not visible under the mount root {mount.mount_root}")
        rel = cgroup[len(base) :].lstrip("/")
        return self.base / mount.point.lstrip("/") / rel

    # -- cgroup figures ------------------------------------------------------------------

    def v1(
        self,
        cgroup: str,
        *,
        limit: int | str = V1_UNLIMITED,
        usage: int | str = 0,
        inactive_file: int = 0,
        stat: V1Stat | None = None,
    ) -> Path:
        """Set a v1 cgroup's limit, usage and memory.stat (created if missing); ``stat``
        for the figures a test rarely sets."""
        stat = stat or V1Stat()
        folder = self.folder(1, cgroup)
        folder.mkdir(parents=True, exist_ok=True)
        total = inactive_file if stat.total_inactive_file is None else stat.total_inactive_file
        hierarchical = limit if stat.hierarchical_limit is None else stat.hierarchical_limit
        use_hierarchy = stat.use_hierarchy
        lines = [
            "cache 0",
            "rss 0",
            f"inactive_file {inactive_file}",
            "active_file 0",
            f"hierarchical_memory_limit {hierarchical}",
            f"hierarchical_memsw_limit {V1_UNLIMITED}",
        ]
        if total >= 0:
            lines.append(f"total_inactive_file {total}")
        self._write_at(folder / "memory.limit_in_bytes", f"{limit}\n")
        self._write_at(folder / "memory.usage_in_bytes", f"{usage}\n")
        self._write_at(folder / "memory.stat", "\n".join(lines) + "\n")
        self._write_at(folder / "memory.use_hierarchy", f"{use_hierarchy}\n")
        return folder

    def v2(
        self,
        cgroup: str,
        *,
        max: int | str = "max",
        high: int | str = "max",
        current: int | str = 0,
        inactive_file: int = 0,
    ) -> Path:
        """Set a v2 cgroup's memory.max/high/current and memory.stat (created if missing),
        with every controller (``write`` its ``cgroup.controllers`` for fewer)."""
        folder = self.folder(2, cgroup)
        folder.mkdir(parents=True, exist_ok=True)
        self._write_at(folder / "cgroup.controllers", "cpuset cpu io memory hugetlb pids\n")
        self._write_at(folder / "memory.max", f"{max}\n")
        self._write_at(folder / "memory.high", f"{high}\n")
        self._write_at(folder / "memory.current", f"{current}\n")
        self._write_at(
            folder / "memory.stat",
            f"anon 0\nfile 0\nactive_file 0\ninactive_file {inactive_file}\n",
        )
        return folder

    # -- raw files -----------------------------------------------------------------------

    def write(self, relpath: str, text: str) -> Path:
        """Write ``text`` to ``relpath`` (relative to the fake root), creating folders."""
        return self._write_at(self.base / relpath.lstrip("/"), text)

    def remove(self, relpath: str | Path) -> None:
        """Delete a file (``relpath`` relative to the fake root, or a path from a method)."""
        path = Path(relpath)
        path = path if path.is_absolute() else self.base / str(relpath).lstrip("/")
        path.unlink()

    # -- internals -----------------------------------------------------------------------

    @staticmethod
    def _write_at(path: Path, text: str) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    @staticmethod
    def _chain(mount: _FakeMount) -> list[str]:
        """Every cgroup from the mount root down to the process's cgroup."""
        levels = [mount.mount_root]
        rest = mount.cgroup[len(mount.mount_root.rstrip("/")) :].strip("/")
        for part in rest.split("/") if rest else []:
            levels.append(levels[-1].rstrip("/") + "/" + part)
        return levels

    def _v1_defaults(self, folder: Path) -> None:
        if (folder / "memory.limit_in_bytes").exists():
            return
        self._write_at(folder / "memory.limit_in_bytes", f"{V1_UNLIMITED}\n")
        self._write_at(folder / "memory.usage_in_bytes", f"{64 * MB}\n")
        self._write_at(
            folder / "memory.stat",
            f"inactive_file 0\ntotal_inactive_file 0\nhierarchical_memory_limit {V1_UNLIMITED}\n",
        )
        self._write_at(folder / "memory.use_hierarchy", "1\n")

    def _v2_defaults(self, folder: Path, controllers: str, is_root: bool) -> None:
        if (folder / "cgroup.controllers").exists():
            return
        self._write_at(folder / "cgroup.controllers", controllers + "\n")
        idle = "avg10=0.00 avg60=0.00 avg300=0.00 total=0"
        self._write_at(folder / "memory.pressure", f"some {idle}\nfull {idle}\n")
        if "memory" in controllers.split() and not is_root:
            self._write_at(folder / "memory.max", "max\n")
            self._write_at(folder / "memory.high", "max\n")
            self._write_at(folder / "memory.current", f"{64 * MB}\n")
            self._write_at(folder / "memory.stat", "anon 0\nfile 0\ninactive_file 0\n")

    def _write_proc(self) -> None:
        lines = [
            "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/root rw",
            "23 22 0:5 / /proc rw,nosuid,nodev,noexec,relatime shared:2 - proc proc rw",
            "24 22 0:20 / /sys rw,nosuid,nodev,noexec,relatime shared:3 - sysfs sysfs rw",
        ]
        cgroup_lines = ["9:name=systemd:/", "3:cpuset:/"]
        for n, mount in enumerate(self._mounts, start=30):
            fstype = "cgroup" if mount.version == 1 else "cgroup2"
            options = f"rw,{mount.options}" if mount.options else "rw"
            lines.append(
                f"{n} 24 0:{n} {_escape(mount.mount_root)} {_escape(mount.point)} "
                f"rw,nosuid,nodev,noexec,relatime shared:{n} - {fstype} {fstype} {options}"
            )
            if mount.version == 1:
                cgroup_lines.append(f"{n - 25}:{mount.options}:{mount.cgroup}")
            else:
                cgroup_lines.append(f"0::{mount.cgroup}")
        self.write("proc/self/mountinfo", "\n".join(lines) + "\n")
        self.write("proc/self/cgroup", "\n".join(cgroup_lines) + "\n")
