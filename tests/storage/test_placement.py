"""memory.array: RAM while the budget and pressure allow, a spill file otherwise."""

from __future__ import annotations

import errno
import gc
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierflow import memory
from tierflow.errors import SpillError
from tierflow.storage import placement, spill
from tierflow.storage.placement import SMALL, Placement, Report
from tierflow.system import budget, pressure
from tierflow.system.types import Level

from common import examples

MB = 1 << 20


class Conditions:
    """The budget and pressure level placement sees, set by each test."""

    def __init__(self) -> None:
        self.budget = 1 << 30
        self.level = Level.OK

    def leave_room(self, nbytes: int) -> None:
        """Budget such that exactly ``nbytes`` more fit in RAM."""
        self.budget = placement.ram_held() + nbytes


@pytest.fixture(autouse=True)
def conditions(monkeypatch: pytest.MonkeyPatch) -> Iterator[Conditions]:
    gc.collect()  # arrays of earlier tests stop counting
    state = Conditions()
    monkeypatch.setattr(budget, "budget_bytes", lambda: state.budget)
    monkeypatch.setattr(pressure, "level_now", lambda: state.level)
    yield state
    gc.collect()


# -- RAM or SSD -------------------------------------------------------------------------


def test_fits_the_budget_goes_to_ram(conditions: Conditions) -> None:
    conditions.leave_room(2 * MB)
    a = memory.array((1000, 8), "float32")
    assert type(a) is np.ndarray
    assert a.shape == (1000, 8) and a.dtype == np.float32 and not a.any()
    assert not memory.on_disk(a)
    assert placement.ram_held() >= a.nbytes


def test_over_the_remaining_budget_goes_to_the_ssd(conditions: Conditions) -> None:
    conditions.leave_room(2 * MB)
    a = memory.array(MB // 8)  # 1 MB: fits
    b = memory.array((2 * MB // 8,), "float64")  # 2 MB: only 1 MB left
    assert not memory.on_disk(a)
    assert isinstance(b, np.memmap) and memory.on_disk(b)
    assert not b.any()  # zero-filled like np.zeros
    c = memory.array(MB // 8)  # the last 1 MB still fits: b did not count
    assert not memory.on_disk(c)
    d = memory.array(1)  # nothing left, even for 8 bytes
    assert memory.on_disk(d)


def test_same_numpy_code_on_both_tiers(conditions: Conditions) -> None:
    conditions.leave_room(0)
    spilled = memory.array((300, 4), "float64")
    conditions.budget = 1 << 30
    in_ram = memory.array((300, 4), "float64")
    assert memory.on_disk(spilled) and not memory.on_disk(in_ram)
    for x in (spilled, in_ram):
        x[:] = np.arange(1200).reshape(300, 4)
        x *= 2
    np.testing.assert_array_equal(spilled, in_ram)
    assert float(spilled[:, 1].sum()) == float(in_ram[:, 1].sum())


@pytest.mark.parametrize("level", [Level.HIGH, Level.CRITICAL])
def test_high_pressure_sends_big_arrays_to_the_ssd(conditions: Conditions, level: Level) -> None:
    conditions.level = level
    big = memory.array(SMALL // 8, "float64")
    small = memory.array(SMALL // 8 - 1, "float64")
    assert memory.on_disk(big)
    assert not memory.on_disk(small)


def test_moderate_pressure_keeps_ram(conditions: Conditions) -> None:
    conditions.level = Level.MODERATE
    assert not memory.on_disk(memory.array(SMALL))


def test_big_arrays_read_the_pressure_level_small_ones_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def level() -> Level:
        calls.append(1)
        return Level.HIGH

    monkeypatch.setattr(pressure, "level_now", level)
    assert memory.on_disk(memory.array(2 * SMALL, "uint8"))
    assert len(calls) == 1
    assert not memory.on_disk(memory.array(100, "uint8"))
    assert len(calls) == 1


def test_free_returns_the_budget(conditions: Conditions) -> None:
    conditions.leave_room(MB)
    a = memory.array(MB, "uint8")
    assert memory.on_disk(memory.array(MB, "uint8"))
    memory.free(a[10:])  # any view frees the whole array
    assert not memory.on_disk(memory.array(MB, "uint8"))


def test_garbage_collection_returns_the_budget(conditions: Conditions) -> None:
    held = placement.ram_held()
    a = memory.array(MB, "uint8")
    view = a[::2]
    assert placement.ram_held() == held + MB
    del a
    gc.collect()
    assert placement.ram_held() == held + MB  # the view keeps it alive
    del view
    gc.collect()
    assert placement.ram_held() == held


def test_memory_error_in_ram_falls_back_to_a_spill_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = placement.ram_held()

    def no_ram(*args: object, **kwargs: object) -> None:
        raise MemoryError

    monkeypatch.setattr(np, "zeros", no_ram)
    x = memory.array(1000)
    assert memory.on_disk(x)
    assert placement.ram_held() == held


def test_accounting_is_thread_safe(conditions: Conditions) -> None:
    conditions.leave_room(20 * MB)
    made: list[np.ndarray] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        for _ in range(10):
            x = memory.array(MB, "uint8")
            with lock:
                made.append(x)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    in_ram = [x for x in made if not memory.on_disk(x)]
    assert len(made) == 80
    assert len(in_ram) == 20  # exactly the room, never more
    assert placement.ram_held() == conditions.budget


# -- on_disk, free ----------------------------------------------------------------------


def test_on_disk_for_views(conditions: Conditions) -> None:
    conditions.leave_room(0)
    x = memory.array((100, 10))
    for view in (x[5:], x[:, 3], np.asarray(x), x.T, x.reshape(-1)[::3]):
        assert memory.on_disk(view)
    assert not memory.on_disk(np.zeros(3))
    assert not memory.on_disk(x + 1)


def test_free_a_spilled_array_deletes_its_file_now(conditions: Conditions) -> None:
    conditions.leave_room(0)
    x = memory.array((1000, 100))
    x[:] = 2
    path = spill.spill_file_of(x).path  # type: ignore[union-attr]
    memory.free(x[10:20])
    assert not os.path.exists(path)
    assert not memory.on_disk(x)
    assert all(p.path != path for p in memory.report())
    memory.free(x)  # twice: nothing happens
    assert float(x[0, 0]) == 0.0  # a freed array holds nothing, but does not crash


def test_free_of_an_array_made_elsewhere_is_an_error() -> None:
    with pytest.raises(
        ValueError, match=r"takes an array made by memory\.array.*ndarray made elsewhere"
    ):
        memory.free(np.zeros(10))
    with pytest.raises(ValueError, match="list made elsewhere"):
        memory.free([1, 2])


# -- report -----------------------------------------------------------------------------


def test_placement_line_format(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    path = str(tmp_path / ".tierflow" / "spill" / "12-34" / "tmpab12.bin")
    line = Placement((200_000_000, 8), np.dtype("float32"), 6_400_000_000, "SSD", path)
    assert str(line) == "[200000000, 8] float32 5.960 GB SSD ~/.tierflow/spill/12-34/tmpab12.bin"
    ram = Placement((1000, 8), np.dtype("float64"), 64000, "RAM")
    assert str(ram) == "[1000, 8] float64 62.500 KB RAM"
    assert str(Placement((3,), np.dtype("int8"), 3, "cuda:0")) == "[3] int8 3 B cuda:0"


def test_report_lists_live_arrays_with_totals(conditions: Conditions) -> None:
    before = len(memory.report())
    conditions.leave_room(1000 * 8)
    a = memory.array((1000, 8), "uint8")
    b = memory.array((2000,), "float64")
    rep = memory.report()
    assert isinstance(rep, Report)
    mine = rep[before:]
    assert [p.tier for p in mine] == ["RAM", "SSD"]
    assert mine[1].path == spill.spill_file_of(b).path  # type: ignore[union-attr]
    text = str(rep)
    assert "[1000, 8] uint8 7.812 KB RAM" in text
    assert re.search(r"\[2000\] float64 15\.625 KB SSD \S+/tmp\w+\.bin", text)
    assert re.search(r"total: RAM [\d.]+ \w+ in \d+ arrays?, SSD [\d.]+ \w+ in \d+ arrays?", text)
    assert repr(rep) == text
    totals = rep.totals()
    assert totals["SSD"][0] >= 16000 and totals["RAM"][0] >= 8000
    page = rep._repr_html_()
    assert page.startswith("<table>") and "<td>SSD</td>" in page and "total RAM" in page
    del a, b
    gc.collect()
    assert len(memory.report()) == before


def test_empty_report_says_so() -> None:
    assert str(Report()) == "no arrays placed by memory.array"


# -- requests -------------------------------------------------------------------------


def test_int_shape_and_numpy_integers() -> None:
    assert memory.array(5).shape == (5,)
    assert memory.array(np.int64(3), "int8").shape == (3,)
    assert memory.array([2, np.uint8(3)]).shape == (2, 3)
    assert memory.array(()).shape == ()


def test_negative_shape() -> None:
    with pytest.raises(ValueError, match=r"negative dimension -3 in shape \(2, -3\)"):
        memory.array((2, -3))


def test_overflowing_shape() -> None:
    with pytest.raises(ValueError, match=r"needs 73786976294838206464 bytes.*2\*\*63"):
        memory.array((2**62, 2), "float64")


def test_bigger_than_the_free_disk(conditions: Conditions) -> None:
    conditions.leave_room(0)
    with pytest.raises(SpillError, match=r"no room for a spill file of 8\.000 TB") as info:
        memory.array((2**40,), "float64")
    assert info.value.errno == errno.ENOSPC


def test_bad_shape_type() -> None:
    with pytest.raises(TypeError, match=r"shape \(2\.5, 3\) is not an int or a tuple of ints"):
        memory.array((2.5, 3))  # type: ignore[arg-type]


def test_unknown_dtype() -> None:
    with pytest.raises(TypeError, match=r"unknown dtype 'flot'.*such as 'float32'"):
        memory.array(10, "flot")


@pytest.mark.parametrize("dtype", [object, np.dtype([("a", "f8"), ("b", "O")])])
def test_object_dtypes_are_refused(dtype: object) -> None:
    with pytest.raises(TypeError, match="holds Python objects, which cannot be placed in a spill"):
        memory.array(10, dtype)


def test_dtype_without_size() -> None:
    with pytest.raises(TypeError, match="has no size"):
        memory.array(10, "S")


def test_bad_device() -> None:
    with pytest.raises(ValueError, match="device='gpu': use 'cpu', 'auto' or 'cuda:N'"):
        memory.array(10, device="gpu")


def test_zero_size_needs_no_file(conditions: Conditions) -> None:
    conditions.leave_room(0)
    x = memory.array((0, 1000))
    assert x.shape == (0, 1000)
    assert not memory.on_disk(x)
    assert memory.report()[-1].nbytes == 0
    memory.free(x)


@settings(
    max_examples=examples(25),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from(
        ["float64", "float32", "int16", "uint8", "bool", "complex64", "S3", "f4,i2"]
    ),
    spilled=st.booleans(),
)
def test_matches_np_zeros(
    conditions: Conditions, shape: tuple[int, ...], dtype: str, spilled: bool
) -> None:
    conditions.budget = 0 if spilled else 1 << 30
    x = memory.array(shape, dtype)
    expected = np.zeros(shape, dtype)
    assert x.shape == expected.shape and x.dtype == expected.dtype
    np.testing.assert_array_equal(x, expected)
    assert memory.on_disk(x) == (spilled and expected.nbytes > 0)
    memory.free(x)


def test_spilling_is_logged(conditions: Conditions, caplog: pytest.LogCaptureFixture) -> None:
    conditions.leave_room(0)
    with caplog.at_level(logging.DEBUG, logger="tierflow.storage.placement"):
        memory.array(1000)
    assert "to the SSD" in caplog.text
