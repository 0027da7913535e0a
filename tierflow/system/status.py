"""The reports for people: ``memory.status()`` and ``memory.limits()``.

They read the layers below (:mod:`tierflow.system.limits`, :mod:`tierflow.system.budget`,
the devices) and import none of them back; nothing in ``tierflow.system`` imports this
module, so a report can combine any figures without making an import circle.

``memory.limits()`` (:class:`Limits`): usable, free and budget memory and what set the
usable figure, e.g. ``5.8 GB usable (container (cgroup v1)), 5.8 GB free, budget 4.0 GB``.

``memory.status()`` (:class:`Status`): the machine as this process sees it, on one line.

::

    RAM 7.3/7.8 GB free (this program 0.04 GB, budget 5.1 GB) | swap 0.0 GB | SSD 29 GB free at ~/.tierflow/spill | 2 cores, load 0.34 | no GPU

- RAM: free and usable memory from :func:`tierflow.system.limits.read_memory`, so inside
  a container these are the container's figures, not the host's;
- this program: the resident set size (RSS) of this process;
- budget: the RAM tierflow's big arrays and blocks may use (:func:`~tierflow.system.budget.budget_bytes`);
- swap: swap in use on the machine;
- SSD: free space of the filesystem of the spill folder (``spill_dir`` setting), measured
  at its nearest existing parent when it is not created yet. A spill folder that cannot
  be written (or created) is shown as such, e.g. ``SSD: cannot write /proc/spill (No
  such file or directory), nothing can spill``, and :func:`status` warns
  (:class:`SpillFolderWarning`): tierflow has no other place to spill, so an array or a
  block that does not fit the RAM budget raises :class:`~tierflow.errors.SpillError`;
- cores this process may use and the 1-minute load average;
- each GPU's free and total memory (:func:`tierflow.system.devices.gpus`), and as a
  tier (:mod:`tierflow.system.device_budget`): its budget, what tierflow's running
  device tasks hold there, and its pressure level, e.g.
  ``cuda:0 6.0/8.0 GB free (budget 5.6 GB, tierflow 0.0 GB, ok)``.

Sizes are binary GB (2**30 bytes). ``as_dict()`` gives every figure in bytes for JSON.
"""

from __future__ import annotations

import dataclasses
import html
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from .. import config
from ..config import format_bytes
from . import budget, device_budget, devices
from . import limits as memory_limits
from .device_budget import DeviceBudget
from .devices import Device

__all__ = ["Limits", "SpillFolderWarning", "Status", "limits", "status"]

GB = config.GB


class SpillFolderWarning(UserWarning):
    """The spill folder cannot be written: nothing can spill to the SSD."""


@dataclass(frozen=True)
class Status:
    """One reading of the machine; sizes in bytes.

    ``ram_free``/``ram_usable`` and ``memory_source`` (``"host"``, ``"cgroup v1"``,
    ``"cgroup v2"``) come from the memory limits; ``rss`` is this process's resident
    memory; ``budget`` the RAM budget; ``swap_used`` the machine's swap in use;
    ``ssd_free`` the free space where spill files go (``spill_dir``, measured at
    ``ssd_path``, its nearest existing folder); ``cores`` the cores this process may use;
    ``load_1m`` the 1-minute load average (None where the system has none); ``gpus`` one
    :class:`~tierflow.system.devices.Device` per GPU, and ``gpu_budgets`` one
    :class:`~tierflow.system.device_budget.DeviceBudget` per GPU (its budget, what
    tierflow holds there, its level). ``spill_problem`` says why spill files cannot be
    made in ``spill_dir`` (None when they can).
    """

    ram_free: int
    ram_usable: int
    memory_source: str
    rss: int
    budget: int
    swap_used: int
    ssd_free: int
    spill_dir: str
    ssd_path: str
    cores: int
    load_1m: float | None
    gpus: tuple[Device, ...] = ()
    gpu_budgets: tuple[DeviceBudget, ...] = ()
    spill_problem: str | None = None

    def _ssd_text(self) -> str:
        where = _home_short(self.spill_dir)
        if self.spill_problem is not None:
            return f"SSD: cannot write {where} ({self.spill_problem}), nothing can spill"
        return f"SSD {_ssd_gb(self.ssd_free)} GB free at {where}"

    def _gpu_text(self, d: Device) -> str:
        text = f"{d.id} {d.free / GB:.1f}/{d.total / GB:.1f} GB free"
        tier = next((b for b in self.gpu_budgets if b.id == d.id), None)
        if tier is None:
            return text
        return (
            f"{text} (budget {_budget_text(tier.budget)}, tierflow "
            f"{_budget_text(tier.admitted + tier.kept)}, {tier.level.value})"
        )

    def _parts(self) -> list[str]:
        load = "n/a" if self.load_1m is None else f"{self.load_1m:.2f}"
        cores = f"{self.cores} core" + ("" if self.cores == 1 else "s")
        gpus = ", ".join(self._gpu_text(d) for d in self.gpus)
        return [
            f"RAM {self.ram_free / GB:.1f}/{self.ram_usable / GB:.1f} GB free "
            f"(this program {self.rss / GB:.2f} GB, budget {_budget_text(self.budget)})",
            f"swap {self.swap_used / GB:.1f} GB",
            self._ssd_text(),
            f"{cores}, load {load}",
            gpus or "no GPU",
        ]

    def __str__(self) -> str:
        return " | ".join(self._parts())

    def __repr__(self) -> str:
        return f"<Status {self}>"

    def as_dict(self) -> dict[str, Any]:
        """Every figure (sizes in bytes), the GPUs as dicts and the line as ``text``."""
        return {
            "ram_free": self.ram_free,
            "ram_usable": self.ram_usable,
            "memory_source": self.memory_source,
            "rss": self.rss,
            "budget": self.budget,
            "swap_used": self.swap_used,
            "ssd_free": self.ssd_free,
            "spill_dir": self.spill_dir,
            "ssd_path": self.ssd_path,
            "spill_problem": self.spill_problem,
            "cores": self.cores,
            "load_1m": self.load_1m,
            "gpus": [d.as_dict() for d in self.gpus],
            "gpu_budgets": [b.as_dict() for b in self.gpu_budgets],
            "text": str(self),
        }

    def _repr_html_(self) -> str:
        where = "host" if self.memory_source == "host" else f"container ({self.memory_source})"
        load = "n/a" if self.load_1m is None else f"{self.load_1m:.2f}"
        rows = [
            ("RAM free", f"{self.ram_free / GB:.1f} of {self.ram_usable / GB:.1f} GB", where),
            ("this program", f"{self.rss / GB:.2f} GB", "resident set size"),
            ("budget", _budget_text(self.budget), "RAM tierflow's arrays and blocks may use"),
            ("swap used", f"{self.swap_used / GB:.1f} GB", ""),
            (
                ("SSD free", f"{_ssd_gb(self.ssd_free)} GB", _home_short(self.spill_dir))
                if self.spill_problem is None
                else ("SSD", "cannot spill", f"{_home_short(self.spill_dir)}: {self.spill_problem}")
            ),
            ("CPU", f"{self.cores} cores", f"load {load}"),
        ]
        rows += [(d.id, f"{d.free / GB:.1f} of {d.total / GB:.1f} GB", d.name) for d in self.gpus]
        rows += [
            (
                f"{b.id} budget",
                _budget_text(b.budget),
                f"tierflow holds {_budget_text(b.admitted + b.kept)}, pressure {b.level.value}",
            )
            for b in self.gpu_budgets
        ]
        if not self.gpus:
            rows.append(("GPU", "none", ""))
        body = "".join(
            f"<tr><th style='text-align:left'>{html.escape(name)}</th>"
            f"<td style='text-align:right'>{html.escape(value)}</td>"
            f"<td style='text-align:left'>{html.escape(note)}</td></tr>"
            for name, value, note in rows
        )
        return f"<table><caption>tierflow status</caption>{body}</table>"


@dataclass(frozen=True)
class Limits:
    """Usable, free and budget bytes, and what set the usable figure.

    ``str()`` reads like ``5.8 GB usable (container (cgroup v1)), 5.8 GB free, budget 4.0 GB``;
    in a notebook the object shows as a small table.
    """

    usable: int
    free: int
    budget: int
    source: str
    host_total: int
    limited_by: str | None = None

    @property
    def where(self) -> str:
        """``host`` or ``container (cgroup v1)`` / ``container (cgroup v2)``."""
        return "host" if self.source == "host" else f"container ({self.source})"

    def __str__(self) -> str:
        return (
            f"{format_bytes(self.usable)} usable ({self.where}), "
            f"{format_bytes(self.free)} free, budget {format_bytes(self.budget)}"
        )

    def __repr__(self) -> str:
        return (
            f"Limits(usable={format_bytes(self.usable)}, free={format_bytes(self.free)}, "
            f"budget={format_bytes(self.budget)}, source={self.source!r}, "
            f"host_total={format_bytes(self.host_total)})"
        )

    def as_dict(self) -> dict[str, Any]:
        """Every figure (bytes) plus ``where`` and the readable line as ``text``, for JSON."""
        return {**dataclasses.asdict(self), "where": self.where, "text": str(self)}

    def _repr_html_(self) -> str:
        limit = self.where if self.limited_by is None else f"{self.where}: {self.limited_by}"
        rows = [
            ("usable", format_bytes(self.usable), limit),
            ("free", format_bytes(self.free), "page cache that can be dropped counts as free"),
            ("budget", format_bytes(self.budget), "RAM tierflow's arrays and blocks may use"),
            ("host RAM", format_bytes(self.host_total), "MemTotal in /proc/meminfo"),
        ]
        body = "".join(
            f"<tr><th style='text-align:left'>{html.escape(name)}</th>"
            f"<td style='text-align:right'>{html.escape(value)}</td>"
            f"<td style='text-align:left'>{html.escape(note)}</td></tr>"
            for name, value, note in rows
        )
        return f"<table><caption>tierflow memory limits</caption>{body}</table>"


def limits(root: str | None = None) -> Limits:
    """Usable, free and budget memory of this process, for people to read.

    ``root`` is where ``/proc`` and ``/sys/fs/cgroup`` are read (default: the
    ``proc_root`` setting). The budget is this process's (:func:`tierflow.memory.budget`),
    which is fixed at first use. Never raises for unreadable system files (see
    :mod:`tierflow.system.limits`); a malformed ``TIERFLOW_RAM_BUDGET`` raises ``ConfigError``.

    >>> print(limits())  # doctest: +SKIP
    5.8 GB usable (container (cgroup v1)), 5.8 GB free, budget 4.0 GB
    """
    figures = memory_limits.read_memory(root)
    return Limits(
        usable=figures.usable,
        free=figures.free,
        budget=budget.budget_bytes(),
        source=figures.source,
        host_total=figures.host_total,
        limited_by=figures.limited_by,
    )


def status(root: str | None = None) -> Status:
    """Read the machine now (a few file reads; GPUs as :func:`~tierflow.system.devices.gpus`).

    ``root`` is where ``/proc`` and ``/sys/fs/cgroup`` are read (default: the
    ``proc_root`` setting). Reading the budget fixes the default budget if it was not
    fixed yet (see :func:`~tierflow.system.budget.budget`). Raises ``ConfigError`` for a
    malformed ``TIERFLOW_RAM_BUDGET``; unreadable system files do not raise. Warns
    (:class:`SpillFolderWarning`) when spill files cannot be made in the spill folder:
    it tries, making and removing an empty folder where tierflow would make its first.

    >>> print(status())  # doctest: +SKIP
    RAM 7.3/7.8 GB free (this program 0.04 GB, budget 5.1 GB) | swap 0.0 GB | ...
    """
    figures = memory_limits.read_memory(root)
    found = devices.gpus()
    spill_dir = os.path.abspath(os.path.expanduser(config.get("spill_dir")))
    ssd_path = _existing_parent(spill_dir)
    problem = _spill_problem(ssd_path)
    if problem is not None:
        warnings.warn(
            SpillFolderWarning(
                f"spill files cannot be made in {spill_dir} ({problem}). tierflow has no "
                "other place to spill: an array or a block that does not fit the RAM budget "
                "raises SpillError. Point TIERFLOW_SPILL_DIR (setting spill_dir) at a "
                "writable folder on a local disk"
            ),
            stacklevel=2,
        )
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system
        load = None
    return Status(
        ram_free=figures.free,
        ram_usable=figures.usable,
        memory_source=figures.source,
        rss=psutil.Process().memory_info().rss,
        budget=budget.budget_bytes(),
        swap_used=psutil.swap_memory().used,
        ssd_free=shutil.disk_usage(ssd_path).free,
        spill_dir=spill_dir,
        ssd_path=ssd_path,
        cores=devices.cpu_cores(root),
        load_1m=load,
        gpus=tuple(found),
        gpu_budgets=tuple(device_budget.device_budgets(found)),
        spill_problem=problem,
    )


def _spill_problem(existing: str) -> str | None:
    """Why no folder can be made in ``existing`` (the spill folder, or its nearest
    existing parent: where tierflow makes its first folder), None when one can. It
    tries: permissions do not tell root's case, nor a read-only or special filesystem."""
    if not os.path.isdir(existing):
        return f"{existing} is not a folder"
    try:
        probe = tempfile.mkdtemp(prefix=".tierflow-probe-", dir=existing)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.rmdir(probe)
    return None


def _existing_parent(path: str) -> str:
    """``path`` or its nearest ancestor that exists (the root always does)."""
    current = Path(path)
    while not current.exists() and current != current.parent:
        current = current.parent
    return str(current)


def _home_short(path: str) -> str:
    """``/home/ann/.tierflow/spill`` -> ``~/.tierflow/spill``."""
    home = os.path.expanduser("~")
    if home not in ("", "/") and (path == home or path.startswith(home.rstrip("/") + "/")):
        return "~" + path[len(home.rstrip("/")) :]
    return path


def _ssd_gb(n: int) -> str:
    """Whole GB from 10 GB up (``29``), one decimal below (``3.2``)."""
    gb = n / GB
    return f"{gb:.0f}" if gb >= 10 else f"{gb:.1f}"


def _budget_text(n: int) -> str:
    """GB with one decimal (``5.1 GB``); below 1 GB in MB, so a small budget reads true."""
    return f"{n / GB:.1f} GB" if n >= GB else config.format_bytes(n)
