"""The GPU slots a run's device tasks sit on (the scheduler's docstring, "GPUs").

A :class:`Seats` reads the GPUs' budgets once per run, refuses before any task starts a
device task that could never fit, seats each device task on a slot of the GPU with room
(:data:`tierflow.system.device_budget.ledger`, shared by every compute), makes room there
by moving persisted blocks to the host, and gives the seats back.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...config import format_bytes
from ...errors import OutOfMemoryError, TierflowError
from ...storage import device_store
from ...system import device_budget
from ...system.device_budget import Seat
from ...system.types import Level
from ..gpu import tier
from ..types import Task

__all__ = ["Seats"]


class Seats:
    """The device tasks of one run and the seats they hold. Scheduler thread only.

    ``devices[i]`` is the GPU task ``i`` is admitted on (``"cuda"``: any), or None.
    """

    def __init__(self, tasks: Sequence[Task], devices: Sequence[str | None]) -> None:
        self.tasks = tasks
        self.devices = devices
        self.held: dict[int, Seat] = {}  # device tasks in flight -> their seats
        self.budgets: dict[str, int] = {}  # read once by check
        self.slots = 0
        # The GPUs' pressure levels, read at most once per admission round.
        self.levels: dict[str, Level] | None = None

    def check(self) -> None:
        """Read the GPUs' budgets and slots for this run, before any task runs. Raises
        :class:`~tierflow.errors.OutOfMemoryError` for a device task that projects more
        than its GPU's whole budget (it could never be admitted), and
        :class:`~tierflow.errors.TierflowError` for one whose GPU is not here."""
        asked: dict[tuple[str, int], str] = {}  # (device, bytes) -> the first task's name
        for t, d in zip(self.tasks, self.devices, strict=True):
            if d is not None:
                asked.setdefault((d, t.device_bytes), t.name)
        if not asked:
            return
        self.budgets = device_budget.budgets()
        self.slots = device_budget.slots()
        for (device, nbytes), name in asked.items():
            budgets = self.budgets
            if device == "cuda":
                where = max(budgets, key=lambda d: budgets[d], default=None)
            else:
                where = device if device in budgets else None
            if where is None:
                have = ", ".join(budgets) or "none"
                raise TierflowError(
                    f"{name} runs on {device}, which is not here (GPUs: {have}); run it with "
                    "device='cpu' or on a machine with that GPU"
                )
            if nbytes > budgets[where]:
                figures = {b.id: b for b in device_budget.device_budgets()}
                fig = figures.get(where)
                why = (
                    f" ({format_bytes(fig.free)} free of {format_bytes(fig.total)} less a "
                    f"margin of {format_bytes(fig.margin)})"
                    if fig is not None
                    else ""
                )
                largest = " (the largest of the GPUs here)" if device == "cuda" else ""
                raise OutOfMemoryError(
                    f"{name} needs {format_bytes(nbytes, 3)} on the GPU (blocks in, result "
                    f"out and the function's own tensors), more than the whole budget of "
                    f"{where}{largest}: {format_bytes(budgets[where], 3)}{why}; make blocks "
                    "smaller (rows=), run it on another device (device='cuda:N' with more "
                    "free memory, or 'cpu'), or lower the margin (gpu_margin, "
                    "TIERFLOW_GPU_MARGIN)"
                )

    def seat(self, i: int, alone: bool) -> bool:
        """Seat device task ``i`` on a GPU slot; False when it must wait. ``alone``: the
        only task in flight of a nested run, seated whatever is taken (its caller holds a
        slot and waits for it)."""
        task, device = self.tasks[i], self.devices[i]
        assert device is not None
        budgets = self.budgets
        caller = tier.current_device()  # a compute inside a device task: its GPU
        if device == "cuda" and caller in budgets:
            device = caller
        candidates = list(budgets) if device == "cuda" else [device]
        ledger = device_budget.ledger
        if alone:
            where = max(candidates, key=lambda d: budgets.get(d, 0) - ledger.admitted(d))
            self.held[i] = ledger.force(where, task.device_bytes)
            return True
        levels = self.levels
        if levels is None:  # read once per admission round
            levels = self.levels = device_budget.levels_now()
        # Blocks persisted on a GPU (persist(device=...)) take room from its budget, and
        # make way for device tasks: spilled to the host, largest first, when a task
        # would not fit beside them.
        kept = {d: device_store.held_on(d) for d in candidates}
        for d, held in kept.items():
            if held and levels.get(d, Level.OK).rank >= Level.HIGH.rank:
                # The GPU is under pressure (another process, or memory outside
                # tierflow's count): its persisted blocks go to the host.
                device_store.make_room(d, held)
                kept[d] = device_store.held_on(d)
        room = {d: max(0, budgets[d] - kept[d]) for d in candidates if d in budgets}
        seat = ledger.seat(candidates, task.device_bytes, room, levels, self.slots)
        if seat is None and any(kept.values()):
            where = max(candidates, key=lambda d: kept[d])
            short = task.device_bytes - (room.get(where, 0) - ledger.admitted(where))
            if short > 0 and device_store.make_room(where, short):
                room[where] = max(0, budgets.get(where, 0) - device_store.held_on(where))
                seat = ledger.seat(candidates, task.device_bytes, room, levels, self.slots)
        if seat is None:
            return False
        self.held[i] = seat
        return True

    def release(self, i: int) -> None:
        """Give back task ``i``'s seat, if it holds one."""
        seat = self.held.pop(i, None)
        if seat is not None:
            device_budget.ledger.release(seat)

    def release_all(self) -> None:
        for seat in self.held.values():
            device_budget.ledger.release(seat)
        self.held.clear()
