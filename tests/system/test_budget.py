"""The RAM budget: default, setting, environment variable (tierflow/system/budget.py)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from tierflow import config, memory
from tierflow.errors import ConfigError
from tierflow.system import budget as budget_module
from tierflow.system.budget import MIN_DEFAULT_BUDGET, budget, budget_bytes
from tierflow.system.limits import MemoryFigures

from .cgroupfs import GB, MB, FakeSystem

LOGGER = "tierflow.system"


@pytest.fixture
def fake(tmp_path: Path) -> FakeSystem:
    """A 16 GB host with 10 GB available; every test reads its figures from it."""
    tree = FakeSystem(tmp_path / "root", total=16 * GB, available=10 * GB)
    config.set(proc_root=tree.root)
    return tree


def use_env(monkeypatch: pytest.MonkeyPatch, value: str, fake: FakeSystem) -> None:
    monkeypatch.setenv("TIERFLOW_RAM_BUDGET", value)
    config.reset()  # the environment is read once; make it read again
    config.set(proc_root=fake.root)


# -- the default -----------------------------------------------------------------------------


def test_default_is_70_percent_of_free_memory(fake: FakeSystem) -> None:
    assert budget() == int(10 * GB * 0.7)
    assert budget_bytes() == int(10 * GB * 0.7)


def test_default_follows_a_cgroup_limit(fake: FakeSystem) -> None:
    fake.mount_v2("/job")
    fake.v2("/job", max=4 * GB, current=2 * GB, inactive_file=1 * GB)
    assert budget() == int(3 * GB * 0.7)


def test_default_is_fixed_at_first_use(fake: FakeSystem) -> None:
    first = budget_bytes()
    fake.meminfo(16 * GB, 2 * GB)  # the process filled memory since
    assert budget_bytes() == first


def test_budget_fraction_setting(fake: FakeSystem) -> None:
    budget_bytes()
    with config.set(budget_fraction=0.5):
        assert budget_bytes() == 5 * GB
    assert budget_bytes() == int(10 * GB * 0.7)


def test_reset_recomputes_the_default(fake: FakeSystem) -> None:
    budget_bytes()
    fake.meminfo(16 * GB, 2 * GB)
    config.reset()
    config.set(proc_root=fake.root)
    assert budget_bytes() == int(2 * GB * 0.7)


def test_default_never_drops_below_a_floor(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    fake.meminfo(16 * GB, 10 * MB)
    assert budget_bytes() == MIN_DEFAULT_BUDGET
    assert caplog.messages == [
        "only 10.0 MB of 16.0 GB usable memory is free; the RAM budget is 64.0 MB instead "
        "of 70 % of it. Free memory or set TIERFLOW_RAM_BUDGET"
    ]


def test_floor_is_at_most_half_of_a_tiny_limit(fake: FakeSystem) -> None:
    fake.mount_v1("/tiny")
    fake.v1("/tiny", limit=32 * MB, usage=32 * MB)
    assert budget_bytes() == 16 * MB


# -- setting it ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [(16, 16 * GB), (0.5, 512 * MB), ("512MB", 512 * MB), ("1.5 GB", 1536 * MB), ("4096", 4096)],
)
def test_setting_the_budget(fake: FakeSystem, value: float | str, expected: int) -> None:
    assert budget(value) == expected
    assert budget() == expected
    assert budget_bytes() == expected
    assert config.get("ram_budget") == expected


def test_setting_replaces_a_fixed_default(fake: FakeSystem) -> None:
    budget_bytes()
    budget(2)
    assert budget_bytes() == 2 * GB
    config.set(ram_budget=None)  # back to the default
    assert budget_bytes() == int(10 * GB * 0.7)


def test_config_set_as_a_context_manager(fake: FakeSystem) -> None:
    with config.set(ram_budget="1GB"):
        assert budget_bytes() == 1 * GB
    assert budget_bytes() == int(10 * GB * 0.7)


def test_facade_names() -> None:
    assert memory.budget is budget
    assert "budget" in memory.__all__ and "limits" in memory.__all__


def test_budget_above_usable_memory_warns_with_both_figures(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    fake.mount_v1("/job")
    fake.v1("/job", limit=6 * GB)
    assert budget(8) == 8 * GB
    assert caplog.messages == [
        "memory budget 8.0 GB is larger than the 6.0 GB of usable memory (cgroup v1); the "
        "kernel may kill the process before tierflow spills to disk. Lower it with "
        "memory.budget() or TIERFLOW_RAM_BUDGET"
    ]


def test_budget_within_usable_memory_is_quiet(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    budget(15)  # above the free 10 GB but below the usable 16 GB: allowed
    assert caplog.messages == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("12 parsecs", "memory.budget='12 parsecs' is not a size; write it like 12GB, 512MB"),
        ("-1GB", r"memory.budget='-1GB' must be a positive size"),
        ("", r"memory.budget='' is not a size"),
        ("0", r"memory.budget='0' must be a positive size, such as 12GB"),
        (0, r"memory.budget\(0\): the budget must be a positive number of GB, such as"),
        (-1, r"memory.budget\(-1\): the budget must be a positive number of GB"),
        (float("nan"), r"memory.budget\(nan\): the budget must be a positive number"),
        (float("inf"), r"memory.budget\(inf\): the budget must be a positive number"),
        (1e-12, r"memory.budget\(1e-12\): the budget must be a positive number"),
        (True, r"memory.budget\(True\): give a number of GB, such as memory.budget\(16\)"),
        ([16], r"memory.budget\(\[16\]\): give a number of GB"),
    ],
)
def test_bad_budgets_are_refused(fake: FakeSystem, value: object, message: str) -> None:
    before = budget_bytes()
    with pytest.raises(ConfigError, match=message):
        budget(value)  # type: ignore[arg-type]
    assert budget_bytes() == before


# -- the environment variable ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("12GB", 12 * GB), ("512MB", 512 * MB), ("1073741824", 1 * GB), (" 2 GiB ", 2 * GB)],
)
def test_environment_variable(
    fake: FakeSystem, monkeypatch: pytest.MonkeyPatch, value: str, expected: int
) -> None:
    use_env(monkeypatch, value, fake)
    assert budget_bytes() == expected


def test_setting_overrides_the_environment(
    fake: FakeSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_env(monkeypatch, "12GB", fake)
    assert budget(1) == 1 * GB


def test_empty_environment_variable_means_the_default(
    fake: FakeSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_env(monkeypatch, "", fake)
    assert budget_bytes() == int(10 * GB * 0.7)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "12 parsecs",
            r"^TIERFLOW_RAM_BUDGET='12 parsecs' is not a size; "
            r"write it like 12GB, 512MB or 1073741824$",
        ),
        ("-1GB", r"^TIERFLOW_RAM_BUDGET='-1GB' must be a positive size, such as 12GB"),
        ("0", r"^TIERFLOW_RAM_BUDGET='0' must be a positive size, such as 12GB$"),
        ("0MB", r"^TIERFLOW_RAM_BUDGET='0MB' must be a positive size, such as 12GB$"),
    ],
)
def test_malformed_environment_variable_names_it_and_an_example(
    fake: FakeSystem, monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    use_env(monkeypatch, value, fake)
    with pytest.raises(ConfigError, match=message):
        budget_bytes()
    with pytest.raises(ConfigError, match=message):
        memory.limits()


# -- cost and concurrency --------------------------------------------------------------------


def test_budget_bytes_reads_memory_only_once(
    fake: FakeSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = budget_module.read_memory

    def counting(root: str | None = None) -> MemoryFigures:
        calls.append(root)
        return real(root)

    monkeypatch.setattr(budget_module, "read_memory", counting)
    results = []
    threads = [threading.Thread(target=lambda: results.append(budget_bytes())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(1000):
        budget_bytes()
    assert len(calls) == 1
    assert results == [int(10 * GB * 0.7)] * 8


# -- the ledger of admitted bytes ----------------------------------------------------------


def test_ledger_admits_what_fits_and_alone_whatever_it_is() -> None:
    ledger = budget_module.Ledger()
    assert ledger.admit(60, 100) and not ledger.admit(50, 100)
    assert not ledger.admit(50, 100, alone=True)  # a task runs: alone is no excuse
    ledger.hold(30)  # a held result: 60 running + 30 held
    ledger.finish(60)
    assert not ledger.admit(80, 100)
    assert ledger.admit(200, 100, alone=True)  # nothing runs: admitted over the budget
    ledger.force(10)
    assert (ledger.running, ledger.held, ledger.admitted, ledger.peak) == (210, 30, 240, 240)
    ledger.finish(210)
    ledger.drop(30)
    ledger.reset_peak()
    assert (ledger.admitted, ledger.peak) == (0, 0)


def test_ledger_wakes_a_waiter_when_a_task_gives_its_bytes_back() -> None:
    ledger = budget_module.Ledger()
    ledger.force(100)
    woke = threading.Event()

    def waiter() -> None:
        ledger.wait_for_room(60)
        woke.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    deadline = time.monotonic() + 10
    while not ledger._waiting and time.monotonic() < deadline:  # until it waits inside
        threading.Event().wait(0.001)
    ledger.finish(100)
    assert woke.wait(10)
    thread.join()
    ledger.wait_for_room(60)  # nothing runs: returns at once


def test_a_watching_reader_gets_the_most_admitted_between_its_readings() -> None:
    ledger = budget_module.Ledger()
    first, second = object(), object()
    ledger.hold(10)
    ledger.watch(first)
    ledger.force(100)  # a task runs and finishes between two readings
    ledger.finish(100)
    ledger.watch(second)
    assert ledger.most_since(first) == 110
    assert ledger.most_since(first) == 10  # a new interval: only what is held now
    ledger.admit(30, room=1000)
    ledger.hold(5)
    ledger.finish(30)
    ledger.drop(5)
    assert ledger.most_since(second) == 45  # each reader its own interval
    assert ledger.most_since(first) == 45
    ledger.unwatch(first)
    ledger.force(500)
    ledger.finish(500)
    assert ledger.most_since(first) == 10  # no longer watching: what is admitted now
    assert ledger.most_since(second) == 510
    assert ledger.peak == 510
