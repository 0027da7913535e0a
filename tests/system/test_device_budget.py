"""GPU budgets: free memory less a margin, fixed once read; levels; the device ledger."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tierflow import config
from tierflow.errors import ConfigError
from tierflow.system import device_budget
from tierflow.system.device_budget import DeviceLedger, level_of, margin_bytes
from tierflow.system.devices import Device, FakeGpus, use_provider
from tierflow.system.types import Level

MB = 1 << 20
GB = 1 << 30


class ChangingGpus:
    """One fake GPU whose free memory a test changes (another process taking memory)."""

    backend = "fake"

    def __init__(self, free: int, total: int) -> None:
        self.free = free
        self.total = total

    def gpus(self) -> list[Device]:
        return [Device("cuda", 0, "Changing GPU", self.free, self.total, backend="fake")]


@pytest.fixture(autouse=True)
def _settings() -> Iterator[None]:
    yield
    config.reset()


def test_default_margin_is_256_mb_or_10_percent_of_the_total_whichever_is_larger() -> None:
    assert margin_bytes(1 * GB) == 256 * MB
    assert margin_bytes(80 * GB) == 8 * GB


def test_margin_setting_overrides_the_default() -> None:
    with config.set(gpu_margin="1GB"):
        assert margin_bytes(80 * GB) == GB
    with config.set(gpu_margin=0):
        assert margin_bytes(80 * GB) == 0


def test_margin_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERFLOW_GPU_MARGIN", "512MB")
    config.reset()
    assert margin_bytes(80 * GB) == 512 * MB


@pytest.mark.parametrize("bad", ["lots", "-1GB", True])
def test_a_bad_margin_names_the_setting(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"gpu_margin\b"):
        config.set(gpu_margin=bad)


@pytest.mark.parametrize("bad", [0, -2, "two", 1.5, True])
def test_slots_must_be_a_whole_number_of_at_least_one(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"gpu_slots=.*whole number of slots >= 1"):
        config.set(gpu_slots=bad)


def test_slots_default_to_two_and_follow_the_setting() -> None:
    assert device_budget.slots() == 2
    with config.set(gpu_slots="3"):
        assert device_budget.slots() == 3


def test_budget_is_free_memory_less_the_margin_per_gpu() -> None:
    with use_provider(FakeGpus([(6 * GB, 8 * GB), (2 * GB, 40 * GB), (100 * MB, GB)])):
        assert device_budget.budgets() == {
            "cuda:0": 6 * GB - int(0.10 * 8 * GB),
            "cuda:1": 0,  # the 2 GB margin takes all of it
            "cuda:2": 0,  # 100 MB free, 256 MB margin
        }


def test_budget_is_fixed_at_first_reading_and_read_again_for_a_new_margin() -> None:
    gpu = ChangingGpus(6 * GB, 8 * GB)
    with use_provider(gpu), config.set(gpu_margin="1GB"):
        assert device_budget.budgets() == {"cuda:0": 5 * GB}
        gpu.free = 2 * GB  # tierflow's own tensors, or another process
        assert device_budget.budgets() == {"cuda:0": 5 * GB}
        with config.set(gpu_margin="512MB"):
            assert device_budget.budgets() == {"cuda:0": 2 * GB - 512 * MB}


def test_a_new_provider_reads_the_budgets_again() -> None:
    with use_provider(FakeGpus([(6 * GB, 8 * GB)])), config.set(gpu_margin="1GB"):
        assert device_budget.budgets() == {"cuda:0": 5 * GB}
    with use_provider(FakeGpus([(3 * GB, 8 * GB)])), config.set(gpu_margin="1GB"):
        assert device_budget.budgets() == {"cuda:0": 2 * GB}


@pytest.mark.parametrize(
    ("free", "level"),
    [(0.5, Level.OK), (0.25, Level.OK), (0.2, Level.MODERATE), (0.08, Level.HIGH),
     (0.04, Level.CRITICAL)],
)  # fmt: skip
def test_level_comes_from_the_free_fraction_by_the_ram_thresholds(
    free: float, level: Level
) -> None:
    assert level_of(int(free * 100 * GB), 100 * GB) is level


def test_levels_are_read_again_at_most_twice_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(device_budget, "_clock", lambda: now[0])
    gpu = ChangingGpus(6 * GB, 8 * GB)
    with use_provider(gpu):
        assert device_budget.levels_now() == {"cuda:0": Level.OK}
        gpu.free = GB // 4
        now[0] += 0.1
        assert device_budget.levels_now() == {"cuda:0": Level.OK}  # recorded
        now[0] += device_budget.LEVEL_INTERVAL
        assert device_budget.levels_now() == {"cuda:0": Level.CRITICAL}


BUDGETS = {"cuda:0": 40 * MB, "cuda:1": 20 * MB}
OK = {"cuda:0": Level.OK, "cuda:1": Level.OK}


def test_a_task_is_seated_on_the_gpu_with_the_most_room_and_never_beyond_its_budget() -> None:
    ledger = DeviceLedger()
    seats = []
    while (seat := ledger.seat(["cuda:0", "cuda:1"], 10 * MB, BUDGETS, OK, slots=8)) is not None:
        seats.append(seat.device)
    # Room 40/20 -> 30/20 -> 20/20 (tie: the first) -> 10/20 -> 10/10 -> 0/10 -> full.
    assert seats == ["cuda:0", "cuda:0", "cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert ledger.admitted("cuda:0") == ledger.peak("cuda:0") == 40 * MB
    assert ledger.admitted("cuda:1") == ledger.peak("cuda:1") == 20 * MB


def test_slots_limit_the_tasks_of_one_gpu_and_are_given_back() -> None:
    ledger = DeviceLedger()
    first = ledger.seat(["cuda:0"], MB, BUDGETS, OK, slots=2)
    second = ledger.seat(["cuda:0"], MB, BUDGETS, OK, slots=2)
    assert first is not None and second is not None
    assert (first.slot, second.slot) == (0, 1)
    assert ledger.seat(["cuda:0"], MB, BUDGETS, OK, slots=2) is None
    ledger.release(first)
    again = ledger.seat(["cuda:0"], MB, BUDGETS, OK, slots=2)
    assert again is not None and again.slot == 0
    assert ledger.running("cuda:0") == 2 and ledger.admitted("cuda:0") == 2 * MB


def test_a_gpu_at_high_pressure_takes_one_task_only_while_it_holds_nothing() -> None:
    ledger = DeviceLedger()
    high = {"cuda:0": Level.HIGH}
    seat = ledger.seat(["cuda:0"], MB, BUDGETS, high, slots=8)
    assert seat is not None
    assert ledger.seat(["cuda:0"], MB, BUDGETS, high, slots=8) is None
    ledger.release(seat)
    assert ledger.admitted("cuda:0") == 0
    assert ledger.seat(["cuda:0"], MB, BUDGETS, high, slots=8) is not None


def test_a_gpu_without_a_budget_is_never_chosen() -> None:
    ledger = DeviceLedger()
    assert ledger.seat(["cuda:7"], MB, BUDGETS, OK, slots=8) is None


def test_force_seats_a_task_whatever_is_taken() -> None:
    ledger = DeviceLedger()
    assert ledger.seat(["cuda:1"], 20 * MB, BUDGETS, OK, slots=1) is not None
    forced = ledger.force("cuda:1", 20 * MB)
    assert forced.slot == 1
    assert ledger.admitted("cuda:1") == ledger.peak("cuda:1") == 40 * MB
    ledger.reset_peak()
    ledger.release(forced)
    assert ledger.peak("cuda:1") == 40 * MB and ledger.admitted("cuda:1") == 20 * MB


def test_device_budgets_report_each_gpu_as_a_tier() -> None:
    with use_provider(FakeGpus([(6 * GB, 8 * GB)], names=["Test GPU"])):
        seat = device_budget.ledger.force("cuda:0", 100 * MB)
        try:
            (tier,) = device_budget.device_budgets()
        finally:
            device_budget.ledger.release(seat)
    assert (tier.id, tier.name, tier.free, tier.total) == ("cuda:0", "Test GPU", 6 * GB, 8 * GB)
    assert tier.margin == int(0.10 * 8 * GB)
    assert tier.budget == 6 * GB - tier.margin
    assert tier.admitted == 100 * MB
    assert tier.level is Level.OK
    assert str(tier) == (
        "cuda:0 budget 5.2 GB (6.0 GB free of 8.0 GB, margin 819.2 MB), tierflow holds "
        "100.0 MB, pressure ok"
    )
    assert tier.as_dict()["level"] == "ok"
