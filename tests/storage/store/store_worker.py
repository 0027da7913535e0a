"""A process that writes numbered values into a store, for the multi-process store tests.

Run as ``python store_worker.py PATH START COUNT DISK_BYTES``: opens the store at PATH
with that SSD limit, prints ``ready``, then sets ``key_for(i) = value_for(i)`` for i
in ``START .. START+COUNT-1`` and prints ``done``. The tests import :func:`check` to
verify that whatever a reader finds is exactly what the writer wrote for that key.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

KEYS = 40


def key_for(i: int) -> int:
    return i % KEYS


def value_for(i: int) -> Any:
    """Arrays (up to 2.4 MB), dicts with a blob (up to 1 MB), or tuples; every value names
    its i. Large values make a kill likely to land while a file is being written."""
    if i % 3 == 0:
        return np.full(1000 + (i % 7) * 50_000, i, dtype=np.int64)
    if i % 3 == 1:
        return {"i": i, "blob": bytes([i % 251]) * (500 + (i % 5) * 250_000)}
    return ("i", i, str(i) * (i % 50))


def check(key: Any, value: Any) -> None:
    """Raise AssertionError unless ``value`` is what the writer wrote for ``key``."""
    if isinstance(value, np.ndarray):
        i = int(value[0])
        np.testing.assert_array_equal(value, value_for(i))
    elif isinstance(value, dict):
        i = value["i"]
        assert value == value_for(i), f"dict for {i} differs"
    else:
        i = value[1]
        assert value == value_for(i), f"tuple for {i} differs"
    assert key_for(i) == key, f"value {i} found under key {key}"


def main() -> None:
    from tierflow.config import GB
    from tierflow.storage.store import Store

    path, start, count, disk_bytes = sys.argv[1], *map(int, sys.argv[2:5])
    st = Store(path, ram_mb=1, disk_gb=disk_bytes / GB)
    print("ready", flush=True)
    for i in range(start, start + count):
        st[key_for(i)] = value_for(i)
    st.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
