"""Pressure stall information (PSI): how long tasks waited for memory.

The kernel (4.20+, ``CONFIG_PSI``) reports memory stalls in ``/proc/pressure/memory``
for the whole machine and, on cgroup v2, in ``memory.pressure`` inside each cgroup
folder, for that cgroup alone::

    some avg10=1.52 avg60=0.40 avg300=0.09 total=1234567
    full avg10=0.31 avg60=0.07 avg300=0.01 total=234567

``some`` is the share of wall time (in %) during which at least one task waited for
memory (reclaim, swap-in, refaults of evicted page cache); ``full`` is the share during
which every non-idle task waited at once, i.e. the time the workload made no progress.
``avg10``/``avg60``/``avg300`` are running averages over 10 s, 60 s and 300 s;
``total`` is the cumulative stall time in microseconds. Kernels before 5.13 may lack
the ``full`` line in some files, so it is optional here.

:func:`read_psi` prefers the cgroup's own file, because a container's memory limit is
what the process runs into, and the machine-wide figure can be quiet while the cgroup
thrashes (or the other way round). A missing or unreadable file (no PSI in the kernel,
``psi=0`` on the command line, a cgroup v1 machine) means "unknown", never an error.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass

from .. import config

__all__ = ["Psi", "PsiLine", "parse_psi", "read_psi"]

log = logging.getLogger(__name__)

_PROC_FILE = os.path.join("proc", "pressure", "memory")
_CGROUP_FILE = "memory.pressure"

# Paths whose content did not parse: warned about once, then only at debug level, so
# that level_now() reading twice a second does not flood the log with one complaint.
_warned: set[str] = set()
_warned_lock = threading.Lock()


@dataclass(frozen=True)
class PsiLine:
    """One line of a PSI file: stall shares in % of wall time, and the total in µs."""

    avg10: float
    avg60: float
    avg300: float
    total: int


@dataclass(frozen=True)
class Psi:
    """A parsed PSI file.

    ``some`` always exists; ``full`` is None on kernels that do not report it.
    ``path`` is the file it was read from (the cgroup's ``memory.pressure`` or
    ``/proc/pressure/memory`` under the configured ``proc_root``).
    """

    some: PsiLine
    full: PsiLine | None
    path: str


def _parse_line(fields: list[str]) -> PsiLine:
    values: dict[str, str] = {}
    for field in fields:
        key, sep, value = field.partition("=")
        if not sep:
            raise ValueError(f"field {field!r} is not key=value")
        values[key] = value
    missing = [k for k in ("avg10", "avg60", "avg300", "total") if k not in values]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    averages = []
    for key in ("avg10", "avg60", "avg300"):
        try:
            number = float(values[key])
        except ValueError:
            raise ValueError(f"{key}={values[key]} is not a number") from None
        # a share of wall time: anything outside 0..100 is not a PSI figure
        if not (math.isfinite(number) and 0.0 <= number <= 100.0):
            raise ValueError(f"{key}={values[key]} is not a percentage")
        averages.append(number)
    try:
        total = int(values["total"])
    except ValueError:
        raise ValueError(f"total={values['total']} is not a whole number") from None
    if total < 0:
        raise ValueError(f"total={total} is negative")
    return PsiLine(averages[0], averages[1], averages[2], total)


def parse_psi(text: str, path: str = "<text>") -> Psi:
    """Parse the content of a PSI file.

    Lines other than ``some`` and ``full`` are ignored (room for future kernels).
    Raises ``ValueError`` naming ``path`` and the offending line when there is no
    ``some`` line or a line is malformed.

    >>> parse_psi("some avg10=1.50 avg60=0.40 avg300=0.10 total=99").some.avg10
    1.5
    """
    lines: dict[str, PsiLine] = {}
    for raw in text.splitlines():
        fields = raw.split()
        if not fields or fields[0] not in ("some", "full"):
            continue
        try:
            lines[fields[0]] = _parse_line(fields[1:])
        except ValueError as exc:
            raise ValueError(f"{path}: cannot parse PSI line {raw.strip()!r}: {exc}") from None
    if "some" not in lines:
        raise ValueError(f"{path}: no 'some avg10=...' line in {text[:80]!r}")
    return Psi(some=lines["some"], full=lines.get("full"), path=path)


def _read_one(path: str) -> Psi | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        # EOPNOTSUPP when the kernel was booted with psi=0, EACCES in some sandboxes
        log.debug("PSI file %s is not readable (%s); treating stalls as unknown", path, exc)
        return None
    try:
        return parse_psi(text, path)
    except ValueError as exc:
        with _warned_lock:
            first = path not in _warned
            _warned.add(path)
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "ignoring memory stall figures: %s; the pressure level comes from free memory alone",
            exc,
        )
        return None


def read_psi(cgroup_dir: str | None = None, root: str | None = None) -> Psi | None:
    """Read memory PSI: the cgroup's own ``memory.pressure``, else the machine's.

    ``cgroup_dir`` is the process's cgroup v2 folder as a path on this machine
    (``MemoryFigures.cgroup_dir``, already under ``root``); ``root`` (default: the
    ``proc_root`` setting) is where ``proc/pressure/memory`` is looked for.
    Returns None when neither file exists, is readable, or parses; a file with
    garbage content is logged as a warning (once per path) and skipped.
    Reads one or two small files; no side effects.
    """
    if cgroup_dir:
        psi = _read_one(os.path.join(cgroup_dir, _CGROUP_FILE))
        if psi is not None:
            return psi
    base = config.get("proc_root") if root is None else os.fspath(root)
    return _read_one(os.path.join(base, _PROC_FILE))
