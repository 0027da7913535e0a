"""Counts of what happened inside one task, on the thread that runs it.

A profile (:mod:`tierflow.engine.profile`) wants, per task, how many operator calls ran
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

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["add", "counting"]

_local = threading.local()  # .counts: the open tally of this thread, or absent


def add(name: str, n: int = 1) -> None:
    """Add ``n`` to ``name`` in the tally open on this thread (nothing when none is)."""
    counts = getattr(_local, "counts", None)
    if counts is not None:
        counts[name] = counts.get(name, 0) + n


@contextlib.contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Open a tally on this thread for the block; yields its counts (name -> total).

    Nested tallies are separate: the inner one counts its block, and its counts are
    added to the outer one when it closes (a compute run inside a task is part of it).
    """
    outer = getattr(_local, "counts", None)
    counts: dict[str, int] = {}
    _local.counts = counts
    try:
        yield counts
    finally:
        _local.counts = outer
        if outer is not None:
            for name, n in counts.items():
                outer[name] = outer.get(name, 0) + n
