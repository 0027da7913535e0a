"""Contracts of the system layer: pressure levels and the subscriber protocol.

Layers above (pools, tier placement, stores, the scheduler) subscribe to pressure
changes through :func:`tierflow.system.pressure.subscribe` with an object that follows
:class:`PressureSubscriber`.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol, runtime_checkable

__all__ = ["Level", "PressureSubscriber"]

_ORDER = ("ok", "moderate", "high", "critical")


class Level(str, Enum):
    """How short of memory the process is, ordered ``ok < moderate < high < critical``.

    A ``Level`` equals its name (``Level.HIGH == "high"``) and compares by severity
    against another level or a level name.
    """

    OK = "ok"
    MODERATE = "moderate"
    HIGH = "high"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        """0 for ``ok`` up to 3 for ``critical``."""
        return _ORDER.index(self.value)

    @classmethod
    def parse(cls, value: Level | str) -> Level:
        """``Level.parse("high")``; raises ``ValueError`` naming the valid levels."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown pressure level {value!r}; use one of {', '.join(_ORDER)}"
            ) from None

    def _other_rank(self, other: object) -> int:
        if isinstance(other, (Level, str)):
            return Level.parse(other).rank
        return NotImplemented

    def __lt__(self, other: object) -> bool:
        return self.rank < self._other_rank(other)

    def __le__(self, other: object) -> bool:
        return self.rank <= self._other_rank(other)

    def __gt__(self, other: object) -> bool:
        return self.rank > self._other_rank(other)

    def __ge__(self, other: object) -> bool:
        return self.rank >= self._other_rank(other)

    def __str__(self) -> str:
        return self.value


@runtime_checkable
class PressureSubscriber(Protocol):
    """What a pool, tier or store offers the pressure registry.

    ``on_pressure`` is called from whichever thread noticed the change, so
    implementations take their own lock. ``relieve`` gives cached RAM back now and
    returns the number of bytes released (0 if nothing was cached).
    """

    def on_pressure(self, level: Level) -> None: ...

    def relieve(self) -> int: ...
