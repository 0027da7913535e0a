"""The two-tier store and ``@cached``: values kept in RAM and on the SSD, across runs.

- :func:`store` opens a :class:`Store` (``memory.store``), a mapping whose values live
  in a bounded RAM tier over a bounded SSD tier (:mod:`.tiers`);
- :func:`cached` keeps a function's results in one (``memory.cached``, :mod:`.cached`).

How a value becomes bytes and is trusted again is :mod:`.serial` (with the signing key
of :mod:`.signing`); which entries exist, their sizes and access times are the index
(:mod:`.index`); keys and file names are :mod:`.keys`.
"""

from __future__ import annotations

from .cached import CachedFunction, CacheInfo, cached
from .keys import Key
from .serial import StoreWarning
from .tiers import Store, StoreUsage, store

__all__ = [
    "CacheInfo",
    "CachedFunction",
    "Key",
    "Store",
    "StoreUsage",
    "StoreWarning",
    "cached",
    "store",
]
