"""The RAM tier of a store: values by entry name, bounded in bytes, least recently used
leave first.

It holds only what is also on the SSD, so dropping an entry never loses a value; the
pressure reactions of the store shrink or empty it. Each held value remembers the
identity of the file it matches (device, inode, mtime, size), so the store can tell
when another process has replaced or removed that file.

Not thread-safe: the owning store calls it with its lock held.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

__all__ = ["Held", "RamTier"]


class Held:
    """One value in the RAM tier: ``nbytes`` is what it costs, ``ident`` its file's identity."""

    __slots__ = ("ident", "nbytes", "value")

    def __init__(self, value: Any, nbytes: int, ident: tuple[int, int, int, int]) -> None:
        self.value = value
        self.nbytes = nbytes
        self.ident = ident


class RamTier:
    """An LRU map of entry name -> :class:`Held`, at most ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self._items: OrderedDict[str, Held] = OrderedDict()
        self._capacity = max(0, int(capacity))
        self.nbytes = 0

    @property
    def capacity(self) -> int:
        """The most bytes held at once."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def get(self, name: str) -> Held | None:
        """The held value of ``name`` (now the most recently used), or None."""
        held = self._items.get(name)
        if held is not None:
            self._items.move_to_end(name)
        return held

    def put(self, name: str, value: Any, nbytes: int, ident: tuple[int, int, int, int]) -> int:
        """Hold ``value`` as the most recently used; drop least recently used values until
        it fits. A value larger than the capacity is not held (any older value of
        ``name`` is dropped). Returns the bytes dropped."""
        old = self._items.pop(name, None)
        dropped = 0 if old is None else old.nbytes
        self.nbytes -= dropped
        if nbytes > self._capacity:
            return dropped
        self._items[name] = Held(value, nbytes, ident)
        self.nbytes += nbytes
        if self.nbytes > self._capacity:
            dropped += self._trim(self._capacity)
        return dropped

    def discard(self, name: str) -> int:
        """Drop ``name`` if held; the bytes dropped."""
        held = self._items.pop(name, None)
        if held is None:
            return 0
        self.nbytes -= held.nbytes
        return held.nbytes

    def resize(self, capacity: int) -> int:
        """Set the capacity (bytes), dropping least recently used values over it; the
        bytes dropped."""
        self._capacity = max(0, int(capacity))
        return self._trim(self._capacity)

    def clear(self) -> int:
        """Drop everything; the bytes dropped."""
        dropped = self.nbytes
        self._items.clear()
        self.nbytes = 0
        return dropped

    def _trim(self, limit: int) -> int:
        dropped = 0
        while self.nbytes > limit and self._items:
            _, held = self._items.popitem(last=False)
            self.nbytes -= held.nbytes
            dropped += held.nbytes
        return dropped
