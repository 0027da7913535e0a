"""GPU budgets: the bytes tierflow's tasks may hold on each GPU, what they hold, its level.

Each GPU is a tier of its own, beside the RAM budget (:mod:`tierflow.system.budget`):

- **Budget.** Its free memory at the first reading in this process, less a margin: the
  ``gpu_margin`` setting (``TIERFLOW_GPU_MARGIN``), by default ``max(256 MB, 10 % of the
  GPU's total)``, which leaves room for the CUDA context, cuBLAS workspaces and the
  caching allocator's rounding. Like the RAM budget it is fixed once read, because
  tierflow's own tensors would shrink a budget that followed free memory; a new GPU
  provider (:func:`tierflow.system.devices.use_provider`) or a change of ``gpu_margin``
  reads it again::

      cuda:0  8.0 GB total, 6.0 GB free at first reading, margin 0.4 GB -> budget 5.6 GB

- **Pressure level.** From the GPU's free fraction now (``free / total``), by the same
  thresholds as RAM (:data:`tierflow.system.pressure.THRESHOLDS`: a quarter left is
  ``moderate``, a tenth ``high``, a twentieth ``critical``); there is no PSI for a GPU.
  It is what another process (or memory outside the budget) takes from the device.
  :func:`levels_now` re-reads at most every :data:`LEVEL_INTERVAL` seconds.

- **Ledger.** :data:`ledger` (a :class:`DeviceLedger`) holds, per GPU, the projected
  bytes of the device tasks every compute admitted there, and which of the GPU's
  ``gpu_slots`` worker slots each one took. A task is seated (:meth:`DeviceLedger.seat`)
  on a slot of the GPU with the most room left among those it may run on, when

  * a slot of that GPU is free, and
  * its bytes fit beside what is admitted there (``admitted + bytes <= budget``) and the
    GPU's level is below ``high``; a GPU that holds nothing takes one task whatever its
    level, so that work always moves.

  Its seat is given back when the task ends (:meth:`DeviceLedger.release`).

Nothing here imports torch: GPU figures come through :func:`tierflow.system.devices.gpus`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import config
from ..config import MB, format_bytes
from . import devices
from .pressure import classify
from .types import Level

__all__ = [
    "LEVEL_INTERVAL",
    "DeviceBudget",
    "DeviceLedger",
    "Seat",
    "budgets",
    "device_budgets",
    "ledger",
    "level_of",
    "levels_now",
    "margin_bytes",
    "slots",
]

MIN_MARGIN = 256 * MB  # the default margin's floor: a CUDA context alone takes ~300 MB
MARGIN_SHARE = 0.10  # the default margin's share of the GPU's total memory
LEVEL_INTERVAL = 0.5  # seconds between two real readings in levels_now()

_clock = time.monotonic  # levels_now()'s clock; tests drive it


def margin_bytes(total: int) -> int:
    """The margin left free on a GPU of ``total`` bytes: ``gpu_margin``, or by default
    ``max(256 MB, 10 % of total)``."""
    configured = config.get("gpu_margin")
    if configured is not None:
        return int(configured)
    return max(MIN_MARGIN, int(total * MARGIN_SHARE))


def slots() -> int:
    """Device tasks that may run at once on each GPU (the ``gpu_slots`` setting)."""
    return int(config.get("gpu_slots"))


def level_of(free: int, total: int) -> Level:
    """The pressure level of a GPU with ``free`` of ``total`` bytes free (see the module
    docstring); ``ok`` for a GPU that reports no total."""
    if total <= 0:
        return Level.OK
    return classify(min(1.0, max(0.0, free / total)), None, None)


_lock = threading.Lock()  # guards _fixed, _fixed_for, _levels, _levels_at
_fixed: dict[str, int] = {}  # device id -> budget, fixed at its first reading
_fixed_for: Any = None  # the provider _fixed was read through
_levels: dict[str, Level] = {}
_levels_at = -1e18


def _reading(found: Sequence[devices.Device] | None = None) -> list[devices.Device]:
    """The GPUs now (``found``, when the caller has just read them); drops the fixed
    budgets and levels when the provider changed, and fixes those of new GPUs."""
    global _fixed_for, _levels_at
    provider = devices.provider()
    found = list(devices.gpus() if found is None else found)
    with _lock:
        if provider is not _fixed_for:
            _fixed.clear()
            _levels.clear()
            _levels_at = -1e18
            _fixed_for = provider
        for d in found:
            if d.id not in _fixed:
                _fixed[d.id] = max(0, d.free - margin_bytes(d.total))
    return found


def budgets() -> dict[str, int]:
    """Every GPU's budget in bytes, by id (``"cuda:0"``); empty without a GPU.

    Reads the GPUs (see :func:`tierflow.system.devices.gpus`); a GPU read for the first
    time gets its budget fixed now."""
    found = _reading()
    with _lock:
        return {d.id: _fixed[d.id] for d in found if d.id in _fixed}


def levels_now() -> dict[str, Level]:
    """Every GPU's pressure level by id, read at most every :data:`LEVEL_INTERVAL`
    seconds (the recorded levels in between): admission calls it for every task."""
    global _levels_at
    now = _clock()
    with _lock:
        if now - _levels_at < LEVEL_INTERVAL and _fixed_for is devices.provider():
            return dict(_levels)
    found = _reading()
    fresh = {d.id: level_of(d.free, d.total) for d in found}
    with _lock:
        _levels.clear()
        _levels.update(fresh)
        _levels_at = now
    return fresh


def _on_setting_changed(name: str) -> None:
    if name == "gpu_margin":
        with _lock:
            _fixed.clear()


config.on_change(_on_setting_changed)


@dataclass(frozen=True, slots=True)
class Seat:
    """Where a device task runs: slot ``slot`` of GPU ``device``, holding ``nbytes``."""

    device: str
    slot: int
    nbytes: int


class DeviceLedger:
    """Per GPU: the bytes of the device tasks every compute admitted there, and the
    slots they took (see the module docstring).

    Every method takes ``_lock`` once. ``peak(device)`` is the most ever admitted on a
    GPU at once (:meth:`reset_peak` starts it again; tests read it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._admitted: dict[str, int] = {}  # _lock
        self._busy: dict[str, set[int]] = {}  # slots taken, by device; _lock
        self._peak: dict[str, int] = {}  # _lock

    def admitted(self, device: str) -> int:
        """Bytes admitted on ``device`` now."""
        with self._lock:
            return self._admitted.get(device, 0)

    def running(self, device: str) -> int:
        """Device tasks seated on ``device`` now."""
        with self._lock:
            return len(self._busy.get(device, ()))

    def peak(self, device: str) -> int:
        """The most bytes ever admitted on ``device`` at once."""
        with self._lock:
            return self._peak.get(device, 0)

    def reset_peak(self) -> None:
        """Start every device's peak again from what is admitted now."""
        with self._lock:
            self._peak = dict(self._admitted)

    def seat(
        self,
        candidates: Sequence[str],
        nbytes: int,
        budget: dict[str, int],
        levels: dict[str, Level],
        slots: int,
    ) -> Seat | None:
        """Seat a task of ``nbytes`` on the candidate GPU with the most room
        (``budget[d]`` less what is admitted there) that has a free slot of ``slots``
        and takes it by the rules of the module docstring; None (nothing taken) when no
        candidate does. Ties go to the earlier candidate."""
        with self._lock:
            best: tuple[int, str] | None = None
            for d in candidates:
                if d not in budget:
                    continue
                held = self._admitted.get(d, 0)
                if len(self._busy.get(d, ())) >= slots:
                    continue
                if held and (
                    held + nbytes > budget[d] or levels.get(d, Level.OK).rank >= Level.HIGH.rank
                ):
                    continue
                room = budget[d] - held
                if best is None or room > best[0]:
                    best = (room, d)
            if best is None:
                return None
            return self._take(best[1], nbytes)

    def force(self, device: str, nbytes: int) -> Seat:
        """Seat a task on ``device`` whatever is admitted there and whatever slots are
        taken (a nested compute's task, whose caller holds a slot)."""
        with self._lock:
            return self._take(device, nbytes)

    def _take(self, device: str, nbytes: int) -> Seat:
        """Caller holds ``_lock``."""
        busy = self._busy.setdefault(device, set())
        slot = next(s for s in range(len(busy) + 1) if s not in busy)
        busy.add(slot)
        total = self._admitted.get(device, 0) + nbytes
        self._admitted[device] = total
        if total > self._peak.get(device, 0):
            self._peak[device] = total
        return Seat(device, slot, nbytes)

    def release(self, seat: Seat) -> None:
        """Give back what ``seat`` took (the task finished, failed or was dropped)."""
        with self._lock:
            self._busy.get(seat.device, set()).discard(seat.slot)
            self._admitted[seat.device] = self._admitted.get(seat.device, 0) - seat.nbytes


ledger = DeviceLedger()  # the process's; every scheduler run seats device tasks through it


@dataclass(frozen=True)
class DeviceBudget:
    """One GPU as a tier, sizes in bytes: ``free`` and ``total`` now, the ``margin``
    left free, the ``budget`` tierflow admits against, what tierflow has ``admitted``
    there (running device tasks), what it ``kept`` there (blocks persisted on the GPU,
    counted by the holders of :func:`add_holder`), and the ``level`` from the free
    fraction."""

    id: str
    name: str
    free: int
    total: int
    margin: int
    budget: int
    admitted: int
    level: Level
    kept: int = 0

    def __str__(self) -> str:
        kept = f" ({format_bytes(self.kept)} of kept blocks)" if self.kept else ""
        return (
            f"{self.id} budget {format_bytes(self.budget)} ({format_bytes(self.free)} free of "
            f"{format_bytes(self.total)}, margin {format_bytes(self.margin)}), tierflow holds "
            f"{format_bytes(self.admitted + self.kept)}{kept}, pressure {self.level.value}"
        )

    def as_dict(self) -> dict[str, Any]:
        """The fields (level as its name) and the one-line text, for JSON."""
        return {
            "id": self.id,
            "name": self.name,
            "free": self.free,
            "total": self.total,
            "margin": self.margin,
            "budget": self.budget,
            "admitted": self.admitted,
            "kept": self.kept,
            "level": self.level.value,
            "text": str(self),
        }


def device_budgets(found: Sequence[devices.Device] | None = None) -> list[DeviceBudget]:
    """Every GPU as a tier now (a fresh reading of free memory, or the GPUs ``found``
    that the caller has just read); empty without a GPU."""
    found = _reading(found)
    with _lock:
        fixed = dict(_fixed)
    return [
        DeviceBudget(
            d.id,
            d.name,
            d.free,
            d.total,
            margin_bytes(d.total),
            fixed.get(d.id, 0),
            ledger.admitted(d.id),
            level_of(d.free, d.total),
            sum(holder(d.id) for holder in list(_holders)),
        )
        for d in found
    ]


_holders: list[Callable[[str], int]] = []  # bytes other layers keep on a GPU, by id


def add_holder(holder: Callable[[str], int]) -> None:
    """Count ``holder(device_id)`` bytes as kept on each GPU by tierflow (the storage
    layer's GPU block stores register here: this layer cannot import them)."""
    if holder not in _holders:
        _holders.append(holder)
