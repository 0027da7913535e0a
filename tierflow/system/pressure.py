"""Memory pressure: one level from free memory and stall figures, and who reacts to it.

Policy
------
The level (:class:`~tierflow.system.types.Level`: ``ok < moderate < high < critical``)
is the worst level any row of :data:`THRESHOLDS` reaches. Two signals feed it:

- the free fraction, ``free / usable`` from :func:`tierflow.system.limits.read_memory`
  (the container's limit, not the host's RAM). It moves the moment memory is taken, so
  it is the fast signal and alone can reach every level;
- PSI, the share of the last 10 s in which tasks waited for memory
  (:mod:`tierflow.system.psi`). A 10 s average lags, so it confirms a trend rather than
  leading one; it matters where the free figure looks fine but the kernel is already
  thrashing (page cache of a memory-mapped file counted as free, swap, a neighbour in
  the same cgroup). Without PSI the free fraction decides alone.

Who reads, and how often
------------------------
- :func:`pressure` takes a fresh reading (a few small file reads) and changes nothing.
- :func:`level_now` is for allocation paths: at most one real reading per
  :data:`LEVEL_INTERVAL` seconds, the recorded level in between; no thread. A reading
  whose level differs from the recorded one is passed to :func:`notify`.
- a watcher (:func:`tierflow.system.watch.on_pressure`) reads in the background and
  also passes its levels to :func:`notify`.

Reactions
---------
Pools, tier placement and stores :func:`subscribe` an object with ``on_pressure(level)``
and ``relieve()`` (:class:`~tierflow.system.types.PressureSubscriber`). The registry holds
weak references, so a subscriber that is no longer used drops out by itself.
:func:`notify` records a level and, when it differs from the recorded one, calls every
subscriber's ``on_pressure`` in subscription order; entering ``critical`` also runs a
garbage collection afterwards, so that what the subscribers let go of is returned.
:func:`relieve` asks every subscriber to give its cached RAM back now.

Locking: ``_lock`` guards the recorded level, the reading clock and the subscriber
table, and is held only for those few assignments. Subscribers are always called with
no tierflow lock held, from whichever thread noticed the change: a subscriber may take
its own lock, and may call :func:`level_now` or :func:`notify` itself. A subscriber that
raises is logged and the others still run.
"""

from __future__ import annotations

import gc
import html
import logging
import numbers
import threading
import time
import weakref
from dataclasses import dataclass
from typing import NamedTuple

from ..config import format_bytes
from . import psi as _psi
from .types import Level, PressureSubscriber

__all__ = [
    "LEVEL_INTERVAL",
    "THRESHOLDS",
    "Pressure",
    "Threshold",
    "classify",
    "level_now",
    "notify",
    "pressure",
    "recorded_level",
    "relieve",
    "reset",
    "subscribe",
    "subscribers",
    "unsubscribe",
]

log = logging.getLogger(__name__)


class Threshold(NamedTuple):
    """One row of :data:`THRESHOLDS`: ``signal`` past ``bound`` means at least ``level``.

    ``free_fraction`` (0..1) fires when strictly below its bound; ``psi_some`` and
    ``psi_full`` (avg10, in % of wall time) fire when strictly above theirs.
    """

    signal: str
    bound: float
    level: Level


# The whole policy. The free fraction is the fast signal and alone reaches every level;
# PSI averages over 10 s, so it only raises the level once a stall has lasted.
THRESHOLDS: tuple[Threshold, ...] = (
    # A quarter left: still comfortable, but one or two more block-sized allocations of
    # a typical job would use it up. Stop growing caches and running ahead.
    Threshold("free_fraction", 0.25, Level.MODERATE),
    # A tenth left: a cgroup this close to its limit reclaims on every charge and the
    # page cache of spilled arrays is being evicted. New big arrays go to the SSD,
    # stores halve their RAM tier, pools drop spare buffers.
    Threshold("free_fraction", 0.10, Level.HIGH),
    # A twentieth left: the next block may meet the OOM killer. Drop everything that
    # can be dropped (it stays on the SSD) and collect garbage.
    Threshold("free_fraction", 0.05, Level.CRITICAL),
    # Some task waited for memory 1 s out of the last 10: reclaim is no longer free. A
    # healthy machine shows well under 1 %, so this is a trend, not noise.
    Threshold("psi_some", 10.0, Level.MODERATE),
    # Every task stalled at once 0.5 s out of 10: the working set is being refaulted,
    # i.e. thrashing has begun even if the free figure still looks fine.
    Threshold("psi_full", 5.0, Level.HIGH),
    # 2 s out of 10 with no progress at all. systemd-oomd's default limit kills at 60 %
    # over 30 s; react well before the machine gets there.
    Threshold("psi_full", 20.0, Level.CRITICAL),
)

# Seconds between two real readings in level_now(). PSI changes over seconds and the
# free figure is re-read by allocation paths many times a second; twice a second keeps
# the cost (a few file reads) negligible and the reaction fast enough.
LEVEL_INTERVAL = 0.5

# The clock of level_now(); a module attribute so that tests can drive it.
_clock = time.monotonic


def classify(free_fraction: float, psi_some: float | None, psi_full: float | None) -> Level:
    """The level for a free fraction (0..1) and PSI ``some``/``full`` avg10 (in %).

    Pure: applies :data:`THRESHOLDS`. A PSI figure of None (unknown) is ignored.
    Raises ``ValueError`` for a free fraction outside 0..1 or a PSI figure outside
    0..100 (or NaN).

    >>> classify(0.5, 0.0, 0.0), classify(0.08, None, None), classify(0.9, 1.0, 30.0)
    (<Level.OK: 'ok'>, <Level.HIGH: 'high'>, <Level.CRITICAL: 'critical'>)
    """
    values = {"free_fraction": free_fraction, "psi_some": psi_some, "psi_full": psi_full}
    if not (isinstance(free_fraction, numbers.Real) and 0.0 <= free_fraction <= 1.0):
        raise ValueError(f"free_fraction={free_fraction!r} must be a fraction between 0 and 1")
    for name in ("psi_some", "psi_full"):
        value = values[name]
        if value is not None and not (isinstance(value, numbers.Real) and 0.0 <= value <= 100.0):
            raise ValueError(f"{name}={value!r} must be a percentage between 0 and 100 or None")
    level = Level.OK
    for row in THRESHOLDS:
        value = values[row.signal]
        if value is None:
            continue
        fires = value < row.bound if row.signal == "free_fraction" else value > row.bound
        if fires and row.level > level:
            level = row.level
    return level


# -- one reading ---------------------------------------------------------------------------

_COLOURS = {
    Level.OK: "#2e7d32",
    Level.MODERATE: "#b58900",
    Level.HIGH: "#e65100",
    Level.CRITICAL: "#c62828",
}


def _percent(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.1f} %"


@dataclass(frozen=True)
class Pressure:
    """One reading of memory pressure.

    ``free`` and ``usable`` are bytes (usable = the smallest of host RAM and every
    cgroup limit; ``source`` says which); ``free_fraction`` is ``free / usable``
    (0..1); ``psi_some`` / ``psi_full`` are the avg10 stall shares in % of wall time, or
    None where the kernel does not report them; ``psi_path`` is the file they came from.

    ``str()`` reads like ``ok: 5.8 GB free (99 %), stalls 0.0 % (some) / 0.0 % (full)``.
    """

    level: Level
    free: int
    usable: int
    free_fraction: float
    psi_some: float | None
    psi_full: float | None
    source: str = "host"
    psi_path: str | None = None

    @property
    def stalls(self) -> str:
        """The PSI part of ``str()``: ``0.0 % (some) / 0.0 % (full)`` or ``unknown (no PSI)``."""
        if self.psi_some is None:
            return "unknown (no PSI)"
        return f"{_percent(self.psi_some)} (some) / {_percent(self.psi_full)} (full)"

    def __str__(self) -> str:
        return (
            f"{self.level.value}: {format_bytes(self.free)} free "
            f"({self.free_fraction * 100:.0f} %), stalls {self.stalls}"
        )

    def __repr__(self) -> str:
        return (
            f"Pressure(level={self.level.value!r}, free={format_bytes(self.free)}, "
            f"usable={format_bytes(self.usable)} ({self.source}), "
            f"free_fraction={self.free_fraction:.3f}, psi_some={self.psi_some!r}, "
            f"psi_full={self.psi_full!r})"
        )

    def _repr_html_(self) -> str:
        where = "host" if self.source == "host" else f"container ({self.source})"
        rows = [
            ("free", f"{format_bytes(self.free)} ({self.free_fraction * 100:.0f} %)"),
            ("usable", f"{format_bytes(self.usable)}, {where}"),
            ("stalls, last 10 s", self.stalls),
            ("stall figures from", self.psi_path or "not available"),
        ]
        body = "".join(
            f"<tr><th style='text-align:left'>{html.escape(name)}</th>"
            f"<td style='text-align:left'>{html.escape(value)}</td></tr>"
            for name, value in rows
        )
        colour = _COLOURS[self.level]
        caption = f"memory pressure: <b style='color:{colour}'>{html.escape(self.level.value)}</b>"
        return f"<table><caption>{caption}</caption>{body}</table>"


def pressure(root: str | None = None) -> Pressure:
    """Read the memory pressure now.

    ``root`` is where ``/proc`` and ``/sys/fs/cgroup`` are read (default: the
    ``proc_root`` setting). Stall figures come from the process's cgroup v2
    ``memory.pressure`` when there is one, else ``/proc/pressure/memory``, else they are
    None and the level comes from the free fraction alone. A few small file reads; no
    side effects (unlike :func:`level_now`, subscribers are not notified). Does not
    raise for missing or garbled system files (they are logged and skipped).

    >>> print(pressure())  # doctest: +SKIP
    ok: 5.8 GB free (99 %), stalls 0.0 % (some) / 0.0 % (full)
    """
    from . import limits

    figures = limits.read_memory(root)
    usable = max(0, int(figures.usable))
    free = max(0, int(figures.free))
    fraction = min(1.0, free / usable) if usable > 0 else 0.0
    stalls = _psi.read_psi(figures.cgroup_dir, root)
    some = None if stalls is None else stalls.some.avg10
    full = None if stalls is None or stalls.full is None else stalls.full.avg10
    return Pressure(
        level=classify(fraction, some, full),
        free=free,
        usable=usable,
        free_fraction=fraction,
        psi_some=some,
        psi_full=full,
        source=figures.source,
        psi_path=None if stalls is None else stalls.path,
    )


# -- the recorded level and the subscribers ------------------------------------------------

_lock = threading.Lock()
_level = Level.OK  # the level last recorded by notify(); guarded by _lock
_read_at: float | None = None  # _clock() at the last reading; guarded by _lock
_generation = 0  # bumped by every notify() that changes the level; guarded by _lock
_failing = False  # the last reading in level_now() raised (warn once per failure streak)
# id(subscriber) -> weak reference, in subscription order. Dead references are pruned
# when the table is read, not from weakref callbacks: a callback can run inside a
# garbage collection on a thread that already holds _lock.
_subscribers: dict[int, weakref.ref[PressureSubscriber]] = {}


def level_now() -> Level:
    """The pressure level, cheap enough for every allocation.

    Takes a real reading (:func:`pressure`) at most once per :data:`LEVEL_INTERVAL`
    seconds and returns the recorded level in between; concurrent callers never read
    twice. A reading whose level changed notifies the subscribers (see :func:`notify`)
    on the calling thread. No thread is started. If the reading fails, a warning is
    logged and the recorded level is returned: an allocation path should not fail
    because ``/proc`` could not be read.
    """
    global _read_at, _failing
    now = _clock()
    with _lock:
        if _read_at is not None and now - _read_at < LEVEL_INTERVAL:
            return _level
        # Claim this reading before reading, so other threads get the recorded level
        # meanwhile instead of all reading at once.
        _read_at = now
        recorded = _level
    try:
        level = pressure().level
    except Exception:
        log.log(
            logging.DEBUG if _failing else logging.WARNING,
            "cannot read memory pressure; keeping level %s",
            recorded,
            exc_info=True,
        )
        _failing = True
        return recorded
    _failing = False
    notify(level)
    return level


def recorded_level() -> Level:
    """The level last recorded by :func:`notify` (or a reading), without reading anything."""
    with _lock:
        return _level


def notify(level: Level | str) -> None:
    """Record ``level``; if it differs from the recorded one, tell every subscriber.

    Calls each live subscriber's ``on_pressure(level)`` on the calling thread, in
    subscription order, with no tierflow lock held; one that raises is logged and the
    others still run. Entering ``critical`` runs ``gc.collect()`` after the subscribers.
    Also restarts :func:`level_now`'s clock, so a level just recorded holds for
    :data:`LEVEL_INTERVAL` seconds (tests of other layers use this to simulate
    pressure). Raises ``ValueError`` for an unknown level name.
    """
    global _level, _read_at, _generation
    level = Level.parse(level)
    with _lock:
        _read_at = _clock()
        if level == _level:
            return
        _level = level
        _generation += 1
        generation = _generation
        live = _live_locked()
    log.info("memory pressure is now %s", level)
    for sub in live:
        with _lock:
            # A newer change was recorded meanwhile (by another thread, or by a subscriber
            # calling notify): it reaches every subscriber itself, so this one is stale.
            if _generation != generation:
                return
        try:
            sub.on_pressure(level)
        except Exception:
            log.exception("pressure subscriber %r raised in on_pressure(%s)", sub, level)
    if level == Level.CRITICAL:
        gc.collect()


def relieve() -> int:
    """Ask every subscriber to give its cached RAM back now; the bytes released.

    Calls each live subscriber's ``relieve()`` with no tierflow lock held and returns
    the sum of what they report. A subscriber that raises, or returns something that is
    not a non-negative integer, is logged and counts as 0.
    """
    total = 0
    for sub in subscribers():
        try:
            released = sub.relieve()
        except Exception:
            log.exception("pressure subscriber %r raised in relieve()", sub)
            continue
        if isinstance(released, bool) or not isinstance(released, int) or released < 0:
            log.warning(
                "pressure subscriber %r returned %r from relieve(), not a byte count; counting 0",
                sub,
                released,
            )
            continue
        total += released
    return total


def subscribe(sub: PressureSubscriber) -> None:
    """Call ``sub.on_pressure(level)`` on every level change, and ``sub.relieve()`` from
    :func:`relieve`, until ``sub`` is unsubscribed or no longer referenced elsewhere.

    Held by weak reference. Subscribing twice is the same as once. Nothing is called
    now; a subscriber that needs the current level reads :func:`level_now`. Raises
    ``TypeError`` when ``sub`` lacks ``on_pressure``/``relieve`` or cannot be weakly
    referenced.
    """
    if not isinstance(sub, PressureSubscriber):
        raise TypeError(
            f"a pressure subscriber needs methods on_pressure(level) and relieve() -> int; "
            f"{type(sub).__name__} lacks "
            + " and ".join(n for n in ("on_pressure", "relieve") if not hasattr(sub, n))
        )
    try:
        ref = weakref.ref(sub)
    except TypeError:
        raise TypeError(
            f"pressure subscribers are held by weak reference, and a {type(sub).__name__} "
            "cannot be weakly referenced; add '__weakref__' to its __slots__"
        ) from None
    with _lock:
        current = _subscribers.get(id(sub))
        if current is not None and current() is sub:
            return
        # a dead entry under a reused id is replaced; re-inserting keeps it last in order
        _subscribers.pop(id(sub), None)
        _subscribers[id(sub)] = ref


def unsubscribe(sub: PressureSubscriber) -> None:
    """Stop notifying ``sub``; does nothing if it was not subscribed."""
    with _lock:
        current = _subscribers.get(id(sub))
        if current is not None and current() is sub:
            del _subscribers[id(sub)]


def subscribers() -> list[PressureSubscriber]:
    """The live subscribers, in subscription order (a snapshot)."""
    with _lock:
        return _live_locked()


def _live_locked() -> list[PressureSubscriber]:
    """Live subscribers; prunes dead references. Needs ``_lock``."""
    live = []
    for key, ref in list(_subscribers.items()):
        sub = ref()
        if sub is None:
            del _subscribers[key]
        else:
            live.append(sub)
    return live


def reset() -> None:
    """Forget the recorded level (back to ``ok``) and the reading clock.

    Subscribers stay subscribed. Test suites call this between tests, so that a level
    simulated by one test does not hide the change another test notifies.
    """
    global _level, _read_at, _generation
    with _lock:
        _level = Level.OK
        _read_at = None
        _generation += 1
