"""How much memory this process may really use: the host, and every memory cgroup above it.

A process in a container sees the host's RAM in ``/proc/meminfo`` and ``free``, yet the
kernel kills it when its memory cgroup reaches its limit, which may be a small part of
that RAM. So the usable memory is the smallest of:

- the host's ``MemTotal`` (``/proc/meminfo``);
- every memory cgroup limit from the process's own cgroup up to the top of the mounted
  hierarchy: cgroup v1 ``memory.limit_in_bytes``, and in v1 also the leaf's
  ``hierarchical_memory_limit`` from ``memory.stat`` (it covers ancestors a container
  cannot see); cgroup v2 ``memory.max`` and ``memory.high`` (above ``memory.high`` the
  kernel throttles the cgroup and reclaims hard, which is the slowdown tierflow exists to
  avoid, so it counts as a limit too).

Swap limits (v1 ``memory.memsw.*``, v2 ``memory.swap.max``) and v1 soft limits do not
count: they do not bound the RAM a process gets. A value of ``max`` or anything at or above
2**62 (v1 writes 9223372036854771712 for "no limit") means unlimited; a limit above the
host's RAM is not special-cased: the host figure is smaller and wins.

Free memory in a cgroup is its limit minus its usage, where usage leaves out the
reclaimable page cache (``inactive_file`` in ``memory.stat``; v1 ``total_inactive_file``
when present, as it includes child cgroups). Free memory overall is the smallest of the
host's ``MemAvailable`` and the free memory of every limited cgroup level.

Which hierarchy: the memory controller lives in exactly one. Where a v1 hierarchy carries
it (also on hybrid machines, with a v2 tree mounted beside it), v1 is read; otherwise the
v2 tree is read at the levels whose ``cgroup.controllers`` lists ``memory``. Mount points
come from ``/proc/self/mountinfo`` and the process's cgroup path from ``/proc/self/cgroup``;
the mount's root field maps one onto the other (a container often mounts its own cgroup as
the root of ``/sys/fs/cgroup``, with no ancestor visible).

Everything is read under a ``root`` path (default: the ``proc_root`` setting, ``/``) so that
tests point it at a fake tree. A missing or garbled file never raises: that level is
skipped (the next readable level or the host figure wins) and a warning is logged once on
the ``tierflow.system`` logger.

This module reads figures only; the report for people that adds the budget,
``memory.limits()``, lives in :mod:`tierflow.system.status`.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from .. import config
from ..config import format_bytes

__all__ = ["Cgroup", "MemoryFigures", "own_cgroup", "read_memory"]

logger = logging.getLogger("tierflow.system")

# v1 writes PAGE_COUNTER_MAX rounded to pages (9223372036854771712) for "no limit", v2
# writes "max"; a real limit is never within a factor of two of 2**63.
UNLIMITED = 1 << 62

_MOUNTINFO = "proc/self/mountinfo"
_PROC_CGROUP = "proc/self/cgroup"
_MEMINFO = "proc/meminfo"

# One warning per distinct problem: these files are re-read on every pressure sample (up
# to twice a second), and a broken file would otherwise flood the log.
_warned: set[str] = set()
_MAX_WARNED = 256


@dataclass(frozen=True)
class MemoryFigures:
    """One reading of the memory this process may use, in bytes.

    ``usable`` is the smallest of the host RAM and every cgroup limit above the process;
    ``free`` is what can still be allocated without pushing out anything but reclaimable
    page cache; ``source`` says which bound set ``usable`` (``"host"``, ``"cgroup v1"`` or
    ``"cgroup v2"``); ``cgroup_dir`` is the process's cgroup v2 folder (where its
    ``memory.pressure`` lives), or None without a v2 tree; ``host_total`` is ``MemTotal``.
    ``limited_by`` is the cgroup (a path inside its hierarchy, such as ``/docker/ab12``)
    whose limit set ``usable``, or None when the host did.
    """

    usable: int
    free: int
    source: str
    cgroup_dir: str | None
    host_total: int
    limited_by: str | None = None


@dataclass(frozen=True)
class Cgroup:
    """Where the memory controller of this process lives.

    ``version`` is 1 or 2, ``name`` the cgroup path as ``/proc/self/cgroup`` shows it,
    ``folder`` the folder of that cgroup (under the root the figures were read from),
    ``mount`` the folder the hierarchy is mounted on (the highest level one can read).
    """

    version: int
    name: str
    folder: str
    mount: str


def read_memory(root: str | None = None) -> MemoryFigures:
    """Read the usable and free memory of this process now (a few small file reads).

    ``root`` is where ``/proc`` and ``/sys/fs/cgroup`` are read (default: the
    ``proc_root`` setting). Never raises for missing or garbled system files: it logs a
    warning on the ``tierflow.system`` logger and uses the next readable figure.
    """
    root = config.get("proc_root") if root is None else os.fspath(root)
    host_total, host_available = _read_host(root)
    usable, free, source, limited_by = host_total, host_available, "host", None
    memory_cgroup, v2_dir = _locate(root)
    if memory_cgroup is not None:
        for level in _levels(memory_cgroup, root):
            if level.limit is None:
                continue
            if level.limit < usable:
                usable, source, limited_by = (
                    level.limit,
                    f"cgroup v{memory_cgroup.version}",
                    level.name,
                )
            if level.free is not None:
                free = min(free, level.free)
    return MemoryFigures(
        usable=usable,
        free=max(0, min(free, usable)),
        source=source,
        cgroup_dir=v2_dir,
        host_total=host_total,
        limited_by=limited_by,
    )


def own_cgroup(root: str | None = None) -> Cgroup | None:
    """The cgroup that holds this process's memory controller, or None if there is none.

    With a v1 memory hierarchy that one is returned (also on hybrid machines); otherwise
    the v2 cgroup, if the v2 tree has the memory controller at all.
    """
    root = config.get("proc_root") if root is None else os.fspath(root)
    return _locate(root)[0]


# -- reading files -------------------------------------------------------------------------


def _warn(message: str) -> None:
    if message in _warned:
        logger.debug("%s", message)
        return
    if len(_warned) < _MAX_WARNED:
        _warned.add(message)
    logger.warning("%s", message)


def _read_text(path: str) -> str | None:
    """The content of a small file, or None if it cannot be read (the caller warns)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _parse_int(text: str) -> int | None:
    text = text.strip()
    return int(text) if re.fullmatch(r"\d+", text) else None


def _read_host(root: str) -> tuple[int, int]:
    """``MemTotal`` and ``MemAvailable`` in bytes."""
    path = os.path.join(root, _MEMINFO)
    text = _read_text(path)
    fields: dict[str, int] = {}
    for line in (text or "").splitlines():
        match = re.match(r"^(\w+):\s+(\d+)\s*kB\s*$", line)
        if match:
            fields[match.group(1)] = int(match.group(2)) * 1024
    total = fields.get("MemTotal", 0)
    if total <= 0:
        # Without /proc/meminfo the C library still knows the RAM size; it cannot know
        # what page cache is reclaimable, so free pages stand in for MemAvailable.
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        available = os.sysconf("SC_AVPHYS_PAGES") * page
        _warn(
            f"cannot read MemTotal from {path} ({'missing' if text is None else 'garbled'}); "
            f"using the C library's figures: {format_bytes(total)} RAM, "
            f"{format_bytes(available)} free"
        )
        return total, min(available, total)
    if "MemAvailable" in fields:
        available = fields["MemAvailable"]
    else:
        # Kernels before 3.14 lack MemAvailable; this is the estimate `free` used then.
        available = sum(fields.get(k, 0) for k in ("MemFree", "Buffers", "Cached"))
    return total, min(available, total)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class _Mount:
    root: str  # the path inside the hierarchy that is mounted (a container's own cgroup)
    point: str  # where it is mounted
    fstype: str  # cgroup or cgroup2
    options: frozenset[str]  # super options: the v1 controllers, rw, ...


def _read_mounts(root: str) -> list[_Mount]:
    path = os.path.join(root, _MOUNTINFO)
    text = _read_text(path)
    if text is None:
        _warn(f"cannot read {path}; memory cgroup limits are not known, using the host figure")
        return []
    mounts = []
    for line in text.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 1:
            continue
        if tail[0] not in ("cgroup", "cgroup2"):
            continue
        options = frozenset(tail[2].split(",")) if len(tail) > 2 else frozenset()
        mounts.append(_Mount(_unescape(fields[3]), _unescape(fields[4]), tail[0], options))
    return mounts


def _read_own_cgroups(root: str) -> tuple[str | None, str | None]:
    """The process's v1 memory cgroup path and its v2 path, from /proc/self/cgroup."""
    path = os.path.join(root, _PROC_CGROUP)
    text = _read_text(path)
    if text is None:
        _warn(f"cannot read {path}; memory cgroup limits are not known, using the host figure")
        return None, None
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, cgroup = parts
        if hierarchy == "0" and controllers == "":
            v2 = cgroup
        elif "memory" in controllers.split(","):
            v1 = cgroup
    return v1, v2


def _folder(mounts: list[_Mount], cgroup: str, root: str) -> tuple[str, str] | None:
    """Map a cgroup path onto (its folder, the mount point folder) under ``root``."""
    best: tuple[int, str, str] | None = None
    for mount in mounts:
        mroot = mount.root.rstrip("/") or "/"
        if mroot == "/":
            rel = cgroup.lstrip("/")
        elif cgroup == mroot or cgroup.startswith(mroot + "/"):
            rel = cgroup[len(mroot) :].lstrip("/")
        else:
            continue
        # The mount closest to the cgroup shows the most of it; prefer it.
        depth = len(mroot)
        if best is None or depth > best[0]:
            point = os.path.join(root, mount.point.lstrip("/"))
            best = (depth, os.path.normpath(os.path.join(point, rel)), os.path.normpath(point))
    if best is None and mounts:
        # The mount's root is no ancestor of our cgroup (seen from another cgroup
        # namespace): the mount point is the closest folder we can read.
        point = os.path.normpath(os.path.join(root, mounts[0].point.lstrip("/")))
        _warn(
            f"cgroup {cgroup} is not under the mounted cgroup {mounts[0].root} "
            f"({mounts[0].point}); reading limits from {mounts[0].point} only"
        )
        return point, point
    return None if best is None else (best[1], best[2])


def _locate(root: str) -> tuple[Cgroup | None, str | None]:
    """(the memory controller's cgroup or None, the process's v2 folder or None)."""
    mounts = _read_mounts(root)
    if not mounts:
        return None, None
    v1_path, v2_path = _read_own_cgroups(root)
    v1_mounts = [m for m in mounts if m.fstype == "cgroup" and "memory" in m.options]
    v2_mounts = [m for m in mounts if m.fstype == "cgroup2"]

    v2_dir = v2_found = None
    if v2_path is not None and v2_mounts:
        v2_found = _folder(v2_mounts, v2_path, root)
        if v2_found is not None and os.path.isdir(v2_found[0]):
            v2_dir = v2_found[0]

    if v1_path is not None and v1_mounts:
        found = _folder(v1_mounts, v1_path, root)
        if found is not None:
            return Cgroup(1, v1_path, found[0], found[1]), v2_dir
    if v2_found is not None and v2_path is not None:
        return Cgroup(2, v2_path, v2_found[0], v2_found[1]), v2_dir
    return None, v2_dir


# -- one level of the hierarchy ------------------------------------------------------------


@dataclass(frozen=True)
class _Level:
    name: str  # cgroup path inside the hierarchy
    limit: int | None  # bytes, None = unlimited or unreadable
    free: int | None  # limit minus usage without reclaimable cache; None = unknown


def _levels(cgroup: Cgroup, root: str) -> list[_Level]:
    """Every readable limited level from the process's cgroup up to the mount point."""
    folder, name = cgroup.folder, cgroup.name
    while not os.path.isdir(folder) and len(folder) > len(cgroup.mount):
        folder, name = os.path.dirname(folder), os.path.dirname(name.rstrip("/")) or "/"
        _warn(
            f"the folder of memory cgroup {cgroup.name} is missing; reading limits from {folder} up"
        )
    leaf_folder, leaf_name = folder, name
    levels: list[_Level] = []
    while os.path.isdir(folder):
        if cgroup.version == 1:
            level = _read_v1(folder, name, leaf=folder == leaf_folder)
        else:
            level = _read_v2(folder, name, is_top=folder == cgroup.mount)
        if level is not None:
            levels.append(level)
        if len(folder) <= len(cgroup.mount):
            break
        folder, name = os.path.dirname(folder), os.path.dirname(name.rstrip("/")) or "/"
    if cgroup.version == 1 and os.path.isdir(leaf_folder):
        hidden = _hidden_v1_limit(leaf_folder, leaf_name, levels)
        if hidden is not None:
            levels.append(hidden)
    return levels


def _problem(path: str, text: str | None) -> str:
    if text is None:
        return f"{path} is missing or unreadable"
    shown = text.strip()
    return f"{path} holds {shown[:40]!r}, not a number" if shown else f"{path} is empty"


def _limit_value(path: str) -> tuple[str | None, int | None]:
    """(what is wrong with the file or None, its limit in bytes or None for unlimited)."""
    text = _read_text(path)
    value = "" if text is None else text.strip()
    if value == "max":
        return None, None
    number = _parse_int(value)
    if number is None:
        return _problem(path, text), None
    return None, None if number >= UNLIMITED else number


def _read_stat(path: str, keys: tuple[str, ...]) -> dict[str, int] | None:
    text = _read_text(path)
    if text is None:
        return None
    stat = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in keys:
            number = _parse_int(parts[1])
            if number is not None:
                stat[parts[0]] = number
    return stat


def _free(folder: str, limit: int, usage_file: str, inactive_keys: tuple[str, ...]) -> int | None:
    """limit - (usage - inactive_file); None when the usage cannot be read."""
    usage_path = os.path.join(folder, usage_file)
    text = _read_text(usage_path)
    usage = None if text is None else _parse_int(text)
    if usage is None:
        _warn(
            f"cannot read the memory usage: {_problem(usage_path, text)}; "
            f"free memory leaves out the {format_bytes(limit)} limit of this cgroup"
        )
        return None
    stat_path = os.path.join(folder, "memory.stat")
    stat = _read_stat(stat_path, inactive_keys) or {}
    inactive = next((stat[k] for k in inactive_keys if k in stat), None)
    if inactive is None:
        # Counting reclaimable cache as used errs on the safe side.
        _warn(f"no inactive_file in {stat_path}; counting all page cache of this cgroup as used")
        inactive = 0
    return max(0, limit - max(0, usage - inactive))


_V1_INACTIVE = ("total_inactive_file", "inactive_file")


def _read_v1(folder: str, name: str, leaf: bool) -> _Level | None:
    hierarchy = _read_text(os.path.join(folder, "memory.use_hierarchy"))
    if not leaf and hierarchy is not None and hierarchy.strip() == "0":
        # Legacy v1 without hierarchy: this ancestor's limit does not bind its children.
        return None
    path = os.path.join(folder, "memory.limit_in_bytes")
    problem, limit = _limit_value(path)
    if problem is not None:
        _warn(f"cannot read the memory limit: {problem}; skipping this cgroup level")
    if limit is None:
        return None
    return _Level(name, limit, _free(folder, limit, "memory.usage_in_bytes", _V1_INACTIVE))


def _hidden_v1_limit(folder: str, name: str, levels: list[_Level]) -> _Level | None:
    """The leaf's ``hierarchical_memory_limit`` if it is below every limit we could read.

    The kernel folds the limits of every ancestor into it, also of ancestors a container
    cannot see. Their usage is not visible either; the leaf's usage is a lower bound of
    it, so the free figure of this level is an upper bound.
    """
    stat = _read_stat(os.path.join(folder, "memory.stat"), ("hierarchical_memory_limit",))
    hierarchical = (stat or {}).get("hierarchical_memory_limit")
    if hierarchical is None or hierarchical >= UNLIMITED:
        return None
    if any(level.limit is not None and level.limit <= hierarchical for level in levels):
        return None
    free = _free(folder, hierarchical, "memory.usage_in_bytes", _V1_INACTIVE)
    return _Level(f"an ancestor of {name}", hierarchical, free)


def _read_v2(folder: str, name: str, is_top: bool) -> _Level | None:
    controllers_path = os.path.join(folder, "cgroup.controllers")
    controllers = _read_text(controllers_path)
    if controllers is None:
        _warn(f"cannot read {controllers_path}; skipping this cgroup level")
        return None
    if "memory" not in controllers.split():
        return None
    limit = None
    for file in ("memory.max", "memory.high"):
        path = os.path.join(folder, file)
        if not os.path.exists(path):
            # The root cgroup has no limit files; any other level should have memory.max.
            if file == "memory.max" and not is_top:
                _warn(f"{path} is missing; skipping this cgroup level")
            continue
        problem, value = _limit_value(path)
        if problem is not None:
            _warn(f"cannot read the memory limit: {problem}; ignoring it")
        if value is not None:
            limit = value if limit is None else min(limit, value)
    if limit is None:
        return None
    return _Level(name, limit, _free(folder, limit, "memory.current", ("inactive_file",)))
