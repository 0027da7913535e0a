"""Counts of what happened inside one task, on the thread that runs it.

A profile (:mod:`tierflow.engine.observe.profile`) wants, per task, how many operator calls ran
out of memory and were halved, how many arrays went to the SSD, how many blocks came
from the cache. Those events happen deep in the layers (halving, placement, the cache);
each of them calls :func:`add`, which counts into the tally opened on the calling thread
by :func:`counting`, if any::

    with tally.counting() as counts:      # the profiler, around one task
        run_the_task()                    # ... halving: tally.add("halvings")
    counts                                # {"halvings": 2}

With no tally open (no profile) :func:`add` is one thread-local lookup, and the events
it counts are rare (a halving, an array placed, a cache hit), not per element.
"""

from __future__ import annotations

import threading

__all__ = ["add", "counting"]

_local = threading.local()  # .counts: the open tally of this thread, or absent


def add(name: str, n: int = 1) -> None:
    """Add ``n`` to ``name`` in the tally open on this thread (nothing when none is)."""
    counts = getattr(_local, "counts", None)
    if counts is not None:
        counts[name] = counts.get(name, 0) + n


class counting:  # lower case: used as a function, ``with tally.counting() as counts``
    """Open a tally on this thread for a ``with`` block; yields its counts (name ->
    total).

    Nested tallies are separate: the inner one counts its block, and its counts are
    added to the outer one when it closes (a compute run inside a task is part of it).
    A class, not a generator: a profile opens one around every task.
    """

    __slots__ = ("counts", "outer")

    def __enter__(self) -> dict[str, int]:
        self.outer = getattr(_local, "counts", None)
        self.counts: dict[str, int] = {}
        _local.counts = self.counts
        return self.counts

    def __exit__(self, *exc: object) -> None:
        outer = _local.counts = self.outer
        if outer is not None:
            for name, n in self.counts.items():
                outer[name] = outer.get(name, 0) + n
