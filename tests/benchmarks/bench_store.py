"""Benchmarks of the two-tier store, with diskcache measured in the same run.

- ``set`` of a 4 KB value into a store of 100 entries and of 50,000 entries: the cost
  must not grow with the number of entries (target: median <= 0.1 ms, ratio <= 1.5);
- ``get`` of a 4 KB value from the RAM tier;
- ``get`` of a 64 MB array from the SSD tier (memory-mapped: no byte is read);
- diskcache's ``Cache.set``/``Cache.get`` on the same values. diskcache keeps values
  under 32 KB inside its SQLite file, so its small ``set`` writes no file; it is also
  measured with ``disk_min_file_size=0``, one file per value as the store does;
- the floor under any ``set`` that writes one file per value: creating, writing,
  closing and renaming a 4 KB file in the same filesystem, with nothing else. Its
  cost swings with the filesystem's state and load, so it is measured in the same run.

``make bench`` runs these with pytest-benchmark. ``python tests/benchmarks/bench_store.py``
prints the same figures as a table (``--entries`` changes the large store's size).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.storage.store import Store

SMALL, LARGE = 100, 50_000
VALUE_4K = os.urandom(4096)
ARRAY_64M = np.arange(64 * 2**20 // 8, dtype=np.float64)


def open_store(folder: Path, entries: int, **kwargs: Any) -> Store:
    st = Store(folder / "store", key_file=folder / "store.key", **kwargs)
    for i in range(entries):
        st[("fill", i)] = VALUE_4K
    return st


def open_diskcache(folder: Path, entries: int, **settings: Any) -> Any:
    diskcache = pytest.importorskip("diskcache") if __name__ != "__main__" else _import_diskcache()
    cache = diskcache.Cache(str(folder / "diskcache"), **settings)
    for i in range(entries):
        cache.set(("fill", i), VALUE_4K)
    return cache


def _import_diskcache() -> Any:
    import diskcache

    return diskcache


def setter(target: Any) -> Callable[[], None]:
    """One set of a new 4 KB value per call."""
    counter = itertools.count()
    return lambda: target.set(("new", next(counter)), VALUE_4K)


def file_writer(store: Store) -> Callable[[], None]:
    """One bare atomic write of a new 4 KB file per call, in the folders of ``store``:
    open in ``tmp/``, write, close, rename into one of the 256 folders under ``data/``,
    as the store's ``set`` does. Where a filesystem places (and how fast it creates) a
    file depends on its folder, so the floor is measured in the store's own folders.
    The names are ones a store never reads nor deletes."""
    tmp_dir, data_dir = store.path / "tmp", store.path / "data"
    for i in range(256):
        (data_dir / f"{i:02x}").mkdir(exist_ok=True)
    counter = itertools.count()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC

    def write() -> None:
        n = next(counter)
        tmp = f"{tmp_dir}/floor-{n}.tmp"
        fd = os.open(tmp, flags, 0o600)
        os.write(fd, VALUE_4K)
        os.close(fd)
        os.rename(tmp, f"{data_dir}/{n % 256:02x}/floor-{n}")

    return write


# -- pytest-benchmark -------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    yield lambda name: tmp_path_factory.mktemp(name)


@pytest.fixture(scope="module")
def small_store(folders: Callable[[str], Path]) -> Iterator[Store]:
    st = open_store(folders("small"), SMALL)
    yield st
    st.close()


@pytest.fixture(scope="module")
def large_store(folders: Callable[[str], Path]) -> Iterator[Store]:
    st = open_store(folders("large"), LARGE)
    yield st
    st.close()


@pytest.mark.parametrize("size", ["small", "large"])
def test_store_set_4kb(benchmark: Any, request: pytest.FixtureRequest, size: str) -> None:
    st = request.getfixturevalue(f"{size}_store")
    benchmark.extra_info["entries"] = len(st)
    benchmark(setter(st))


@pytest.mark.parametrize("size", [SMALL, LARGE])
@pytest.mark.parametrize("layout", ["inline", "files"])
def test_diskcache_set_4kb(
    benchmark: Any, folders: Callable[[str], Path], size: int, layout: str
) -> None:
    settings = {"disk_min_file_size": 0} if layout == "files" else {}
    cache = open_diskcache(folders(f"dc-{layout}-{size}"), size, **settings)
    benchmark.extra_info["entries"] = size
    benchmark(setter(cache))
    cache.close()


def test_filesystem_floor_4kb(benchmark: Any, large_store: Store) -> None:
    benchmark(file_writer(large_store))


def test_store_get_4kb_from_ram(benchmark: Any, small_store: Store) -> None:
    small_store["hot"] = VALUE_4K
    assert benchmark(small_store.get, "hot") == VALUE_4K


def test_diskcache_get_4kb(benchmark: Any, folders: Callable[[str], Path]) -> None:
    cache = open_diskcache(folders("dc-get"), SMALL)
    cache.set("hot", VALUE_4K)
    assert benchmark(cache.get, "hot") == VALUE_4K
    cache.close()


def test_store_get_64mb_array_from_ssd(benchmark: Any, folders: Callable[[str], Path]) -> None:
    st = open_store(folders("big"), 0, ram_mb=0)
    st["big"] = ARRAY_64M
    got = benchmark(st.get, "big")
    assert isinstance(got, np.memmap) and got.shape == ARRAY_64M.shape
    st.close()


def test_diskcache_get_64mb_array(benchmark: Any, folders: Callable[[str], Path]) -> None:
    cache = open_diskcache(folders("dc-big"), 0)
    cache.set("big", ARRAY_64M)
    got = benchmark.pedantic(cache.get, args=("big",), rounds=5, iterations=1)
    assert got.shape == ARRAY_64M.shape
    cache.close()


# -- as a script --------------------------------------------------------------------------


def median_us(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def medians_us(fns: list[Callable[[], Any]], rounds: int) -> list[float]:
    """Median microseconds of each of ``fns``, called in turn ``rounds`` times, so that
    all see the same moments of a busy machine."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) * 1e6 for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser(description="store benchmarks, printed as a table")
    parser.add_argument("--entries", type=int, default=LARGE, help="entries of the large store")
    parser.add_argument("--rounds", type=int, default=2000, help="calls per small measurement")
    args = parser.parse_args()
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="tierflow-bench-") as tmp:
        base = Path(tmp)
        for size in (SMALL, args.entries):
            st = open_store(base / f"s{size}", size)
            store_us, floor_us = medians_us([setter(st), file_writer(st)], args.rounds)
            rows.append((f"store set 4 KB, {size} entries", store_us))
            rows.append(("  bare file write 4 KB, same folders and moments", floor_us))
            if size == SMALL:
                st["hot"] = VALUE_4K
                rows.append(("store get 4 KB from RAM", median_us(partial(st.get, "hot"), 10_000)))
            st.close()
            for layout, settings in (("inline", {}), ("files", {"disk_min_file_size": 0})):
                cache = open_diskcache(base / f"d{size}{layout}", size, **settings)
                label = f"diskcache set 4 KB ({layout}), {size} entries"
                rows.append((label, median_us(setter(cache), args.rounds)))
                if size == SMALL and layout == "inline":
                    cache.set("hot", VALUE_4K)
                    rows.append(
                        ("diskcache get 4 KB", median_us(partial(cache.get, "hot"), 10_000))
                    )
                cache.close()
        st = open_store(base / "big", 0, ram_mb=0)
        st["big"] = ARRAY_64M
        rows.append(
            ("store get 64 MB array from SSD (mapped)", median_us(lambda: st.get("big"), 200))
        )
        st.close()
        cache = open_diskcache(base / "dbig", 0)
        cache.set("big", ARRAY_64M)
        rows.append(("diskcache get 64 MB array", median_us(partial(cache.get, "big"), 5)))
        cache.close()
    width = max(len(label) for label, _ in rows)
    for label, us in rows:
        print(f"{label:<{width}}  {us / 1000:9.3f} ms")
    small, large = (
        rows[0][1],
        next(us for label, us in rows if label.startswith(f"store set 4 KB, {args.entries}")),
    )
    print(
        f"store set, {args.entries} vs {SMALL} entries: ratio {large / small:.2f} (target <= 1.5)"
    )


if __name__ == "__main__":
    main()
