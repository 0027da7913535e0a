"""The results a run holds for tasks that have not run yet (the scheduler's docstring,
"Placement and release").

A :class:`Held` counts each result it holds against the budget (in the process's ledger,
:data:`tierflow.system.budget.ledger`), lets it go when its last consumer has run, and
spills results to the SSD, largest first, when those of every compute together outgrow
``budget / HELD_SHARE`` or the pressure level reaches ``critical``. A spilled result is
mapped read-only under a read lease (:func:`tierflow.storage.spill.write_array`); its
file is deleted when the run ends.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ...storage import pages, spill
from ...system import budget as budget_module
from ..types import Tracer

__all__ = ["HELD_SHARE", "Held"]

log = logging.getLogger("tierflow.engine")

HELD_SHARE = 2  # held results above budget / HELD_SHARE are spilled


def _nbytes_in_ram(value: Any) -> int:
    if isinstance(value, np.ndarray):
        if isinstance(value, np.memmap) or spill.spill_file_of(value) is not None:
            return 0
        return int(value.nbytes)
    if isinstance(value, (tuple, list)):
        return sum(_nbytes_in_ram(v) for v in value)
    return 0


class Held:
    """One run's held results, their sizes in RAM and its spill files. Scheduler thread
    only. ``keep``: results the caller asked for, never spilled."""

    def __init__(self, keep: set[int], tracer: Tracer | None) -> None:
        self.keep = keep
        self.tracer = tracer
        self.results: dict[int, Any] = {}
        self.sizes: dict[int, int] = {}  # results in RAM -> their bytes
        self.bytes = 0  # their sum, counted in the ledger
        self.spilled: list[np.ndarray] = []  # this run's spill files, mapped
        self.spilled_bytes = 0

    def hold(self, i: int, result: Any) -> int:
        """Hold task ``i``'s result for its consumers; the bytes it adds in RAM."""
        self.results[i] = result
        size = _nbytes_in_ram(result)
        if size:
            self.sizes[i] = size
            self.bytes += size
            budget_module.ledger.hold(size)
        return size

    def release(self, i: int) -> None:
        """Let task ``i``'s result go: its last consumer has run."""
        value = self.results.pop(i, None)
        size = self.sizes.pop(i, 0)
        if size:
            self.bytes -= size
            budget_module.ledger.drop(size)
        if size == 0 and self.spilled and value is not None:
            self._unmap_spilled(value)

    def relieve(self, critical: bool) -> None:
        """Spill when the level has just reached ``critical``, or when the results held by
        every compute outgrow their share of the budget."""
        if not self.bytes:
            return
        if critical:
            self.spill("critical pressure")
        if self.bytes and budget_module.ledger.held > budget_module.budget_bytes() // HELD_SHARE:
            self.spill("held")

    def spill(self, why: str) -> None:
        """Move held results to spill files, largest first; for ``why == "held"`` until
        every compute's held results are under half their share."""
        order = sorted((size, i) for i, size in self.sizes.items() if size and i not in self.keep)
        limit = budget_module.budget_bytes() // HELD_SHARE
        for size, i in reversed(order):
            if why == "held" and budget_module.ledger.held <= limit // 2:
                break
            self.results[i] = self._to_disk(self.results[i])
            self.bytes -= size
            budget_module.ledger.drop(size)
            self.sizes[i] = 0
            self.spilled_bytes += size
            if self.tracer is not None:
                self.tracer.spilled(i, size)
            log.info("spilled a held result of %d bytes (%s)", size, why)

    def cleanup(self) -> None:
        """Give back the bytes still held and delete the spill files."""
        budget_module.ledger.drop(self.bytes)
        self.bytes = 0
        for mapped in self.spilled:
            record = spill.spill_file_of(mapped)
            if record is not None:
                spill.discard(record)
        self.spilled.clear()

    def _to_disk(self, value: Any) -> Any:
        if isinstance(value, tuple):
            return tuple(self._to_disk(v) for v in value)
        if isinstance(value, list):
            return [self._to_disk(v) for v in value]
        if isinstance(value, np.ndarray) and value.nbytes and _nbytes_in_ram(value):
            # Read-only under a read lease: a truncated spill file cannot fault readers.
            mapped = spill.write_array(np.ascontiguousarray(value))
            pages.release(mapped, drop_cache=True)
            self.spilled.append(mapped)
            return mapped
        return value

    def _unmap_spilled(self, value: Any) -> None:
        """Drop the pages of a released result's spill files from this process.

        Its consumers read them back through the mapping (an append writes the block
        to its file from there), which leaves them resident as file-backed RSS the
        budget does not count, until the files are deleted when the run ends; at a few
        MB per block that outgrew the budget. The file stays valid (a view of it, if a
        consumer returned one, faults its pages back in); it is deleted at the end.
        """
        if isinstance(value, (tuple, list)):
            for v in value:
                self._unmap_spilled(v)
        elif isinstance(value, np.memmap) and any(value is m for m in self.spilled):
            pages.release(value, drop_cache=True)
