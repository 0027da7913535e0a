"""Pressure readings, the thresholds, level_now and the subscriber registry."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierflow import config, memory
from tierflow.system import limits
from tierflow.system import pressure as pressure_mod
from tierflow.system.pressure import (
    LEVEL_INTERVAL,
    THRESHOLDS,
    Pressure,
    classify,
    level_now,
    notify,
    recorded_level,
    relieve,
    subscribe,
    subscribers,
    unsubscribe,
)
from tierflow.system.types import Level

from common import fixed_memory

GB = 1 << 30


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts at a recorded ``ok`` with an empty subscriber table of its own
    (subscribers of other modules are back afterwards)."""
    monkeypatch.setattr(pressure_mod, "_subscribers", {})
    pressure_mod.reset()
    yield
    pressure_mod.reset()


class Recorder:
    """A subscriber that records what it was told and releases a fixed number of bytes."""

    def __init__(self, releases: object = 0) -> None:
        self.levels: list[Level] = []
        self.releases = releases
        self.relieved = 0

    def on_pressure(self, level: Level) -> None:
        self.levels.append(level)

    def relieve(self) -> int:
        self.relieved += 1
        return self.releases  # type: ignore[return-value]


class Raising(Recorder):
    def on_pressure(self, level: Level) -> None:
        super().on_pressure(level)
        raise RuntimeError("subscriber broke")

    def relieve(self) -> int:
        raise RuntimeError("cannot relieve")


def reading(level: Level | str = "ok") -> Pressure:
    return Pressure(Level.parse(level), 1 * GB, 2 * GB, 0.5, None, None)


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, object]:
    """Fixed memory figures behind pressure(), and a root without PSI."""
    config.set(proc_root=str(tmp_path))
    return fixed_memory(monkeypatch)


def write_psi(root: Path, some: float, full: float | None) -> None:
    path = root / "proc" / "pressure" / "memory"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"some avg10={some:.2f} avg60=0.00 avg300=0.00 total=1\n"
    if full is not None:
        text += f"full avg10={full:.2f} avg60=0.00 avg300=0.00 total=1\n"
    path.write_text(text)


# -- classify and the table -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free_fraction", "some", "full", "expected"),
    [
        (1.0, None, None, "ok"),
        (0.25, None, None, "ok"),  # at the bound: not below it
        (0.2499, None, None, "moderate"),
        (0.10, None, None, "moderate"),
        (0.0999, None, None, "high"),
        (0.05, None, None, "high"),
        (0.0499, None, None, "critical"),
        (0.0, None, None, "critical"),
        (0.9, 10.0, 0.0, "ok"),  # at the bound: not above it
        (0.9, 10.01, 0.0, "moderate"),
        (0.9, 100.0, 0.0, "moderate"),  # some alone never goes past moderate
        (0.9, 0.0, 5.0, "ok"),
        (0.9, 0.0, 5.01, "high"),
        (0.9, 0.0, 20.0, "high"),
        (0.9, 0.0, 20.01, "critical"),
        (0.9, 50.0, None, "moderate"),  # full unknown: ignored
        (0.2, 0.0, 6.0, "high"),  # the worst signal wins
        (0.08, 11.0, 0.0, "high"),
        (0.04, 0.0, 0.0, "critical"),  # PSI quiet does not lower the free-fraction level
    ],
)
def test_classify_at_every_threshold(
    free_fraction: float, some: float | None, full: float | None, expected: str
) -> None:
    assert classify(free_fraction, some, full) == expected


def test_classify_agrees_with_every_row_of_the_table() -> None:
    for row in THRESHOLDS:
        step = 1e-6 if row.signal == "free_fraction" else 1e-3
        past = row.bound - step if row.signal == "free_fraction" else row.bound + step
        at = {"free_fraction": 1.0, "psi_some": 0.0, "psi_full": 0.0}
        beyond = dict(at)
        at[row.signal], beyond[row.signal] = row.bound, past
        assert classify(at["free_fraction"], at["psi_some"], at["psi_full"]) < row.level, row
        level = classify(beyond["free_fraction"], beyond["psi_some"], beyond["psi_full"])
        assert level >= row.level, row


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1.5, None, None), r"free_fraction=1\.5 must be a fraction between 0 and 1"),
        ((-0.1, None, None), r"free_fraction=-0\.1 must be a fraction"),
        ((float("nan"), None, None), r"free_fraction=nan must be a fraction"),
        ((0.5, -1.0, None), r"psi_some=-1\.0 must be a percentage between 0 and 100"),
        ((0.5, None, 101.0), r"psi_full=101\.0 must be a percentage"),
        ((0.5, None, "3"), r"psi_full='3' must be a percentage"),
    ],
)
def test_classify_rejects_values_out_of_range(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        classify(*args)


# -- one reading -----------------------------------------------------------------------------


def test_str_with_psi(figures: dict[str, object], tmp_path: Path) -> None:
    figures.update(usable=int(5.86 * GB), free=int(5.8 * GB))
    write_psi(tmp_path, 0.0, 0.0)
    assert str(pressure_mod.pressure()) == (
        "ok: 5.8 GB free (99 %), stalls 0.0 % (some) / 0.0 % (full)"
    )


def test_str_without_psi(figures: dict[str, object]) -> None:
    figures.update(usable=int(5.86 * GB), free=int(5.8 * GB))
    assert str(pressure_mod.pressure()) == "ok: 5.8 GB free (99 %), stalls unknown (no PSI)"


def test_reading_fields_repr_and_html(figures: dict[str, object], tmp_path: Path) -> None:
    figures.update(usable=4 * GB, free=GB // 2, source="cgroup v1")
    write_psi(tmp_path, 12.5, 1.0)
    p = pressure_mod.pressure()
    assert (p.level, p.free, p.usable, p.free_fraction) == ("moderate", GB // 2, 4 * GB, 0.125)
    assert (p.psi_some, p.psi_full, p.source) == (12.5, 1.0, "cgroup v1")
    assert repr(p) == (
        "Pressure(level='moderate', free=512.0 MB, usable=4.0 GB (cgroup v1), "
        "free_fraction=0.125, psi_some=12.5, psi_full=1.0)"
    )
    html = p._repr_html_()
    assert html.startswith("<table>") and "moderate" in html
    assert "container (cgroup v1)" in html and "12.5 % (some)" in html


def test_reading_with_no_usable_memory_is_critical(figures: dict[str, object]) -> None:
    figures.update(usable=0, free=0)
    p = pressure_mod.pressure()
    assert (p.free_fraction, p.level) == (0.0, "critical")


def test_free_above_usable_is_capped(figures: dict[str, object]) -> None:
    figures.update(usable=GB, free=2 * GB)
    assert pressure_mod.pressure().free_fraction == 1.0


def test_reading_passes_root_to_read_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[str | None] = []

    def read_memory(root: str | None = None) -> limits.MemoryFigures:
        seen.append(root)
        return limits.MemoryFigures(GB, GB, "host", None, GB)

    monkeypatch.setattr(limits, "read_memory", read_memory)
    pressure_mod.pressure(str(tmp_path))
    assert seen == [str(tmp_path)]


def test_reading_this_machine() -> None:
    p = memory.pressure()
    assert isinstance(p.level, Level)
    assert p.usable > 0 and 0 <= p.free <= p.usable
    assert 0.0 <= p.free_fraction <= 1.0
    assert p.level == classify(p.free_fraction, p.psi_some, p.psi_full)


def test_reading_notifies_nobody(figures: dict[str, object]) -> None:
    sub = Recorder()
    subscribe(sub)
    figures["free"] = 0
    assert pressure_mod.pressure().level == "critical"
    assert sub.levels == [] and recorded_level() == "ok"


# -- level_now ---------------------------------------------------------------------------------


class FakeReader:
    """Replaces pressure(): counts readings and returns the level set in ``level``."""

    def __init__(self, level: str = "ok", delay: float = 0.0) -> None:
        self.level = level
        self.delay = delay
        self.reads = 0
        self.lock = threading.Lock()

    def __call__(self, root: str | None = None) -> Pressure:
        with self.lock:
            self.reads += 1
        if self.delay:
            time.sleep(self.delay)
        return reading(self.level)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """level_now's clock, driven by the test: ``clock[0]`` is the time in seconds."""
    now = [1000.0]
    monkeypatch.setattr(pressure_mod, "_clock", lambda: now[0])
    return now


@pytest.fixture
def reader(monkeypatch: pytest.MonkeyPatch) -> FakeReader:
    fake = FakeReader()
    monkeypatch.setattr(pressure_mod, "pressure", fake)
    return fake


def test_level_now_reads_at_most_once_per_interval(clock: list[float], reader: FakeReader) -> None:
    assert LEVEL_INTERVAL == 0.5
    assert level_now() == "ok" and reader.reads == 1
    reader.level = "high"
    for dt in (0.0, 0.1, 0.49):
        clock[0] = 1000.0 + dt
        assert level_now() == "ok", "between readings the recorded level is returned"
    assert reader.reads == 1
    clock[0] = 1000.5
    assert level_now() == "high"
    assert reader.reads == 2
    clock[0] = 1000.7
    assert level_now() == "high" and reader.reads == 2


def test_level_now_notifies_subscribers_on_change(clock: list[float], reader: FakeReader) -> None:
    sub = Recorder()
    subscribe(sub)
    level_now()
    assert sub.levels == []  # ok -> ok is no change
    reader.level = "critical"
    clock[0] += 1
    level_now()
    clock[0] += 1
    level_now()
    reader.level = "moderate"
    clock[0] += 1
    level_now()
    assert sub.levels == ["critical", "moderate"]
    assert recorded_level() == "moderate"


def test_level_now_reads_once_for_concurrent_callers(reader: FakeReader) -> None:
    reader.delay = 0.05
    barrier = threading.Barrier(8)
    results: list[Level] = []

    def call() -> None:
        barrier.wait()
        results.append(level_now())

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len(results) == 8 and set(results) == {Level.OK}
    assert reader.reads == 1


def test_level_now_keeps_the_recorded_level_when_reading_fails(
    clock: list[float], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    notify("high")

    def broken(root: str | None = None) -> Pressure:
        raise OSError("no /proc")

    monkeypatch.setattr(pressure_mod, "pressure", broken)
    with caplog.at_level(logging.DEBUG, logger="tierflow"):
        for _ in range(3):
            clock[0] += 1
            assert level_now() == "high"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot read memory pressure" in warnings[0].getMessage()


def test_notify_restarts_the_clock(clock: list[float], reader: FakeReader) -> None:
    level_now()
    clock[0] += 10
    notify("high")  # as a watcher or a test simulating pressure would
    assert level_now() == "high"
    assert reader.reads == 1
    clock[0] += LEVEL_INTERVAL
    assert level_now() == "ok" and reader.reads == 2


# -- the registry ------------------------------------------------------------------------------


def test_notify_on_change_only() -> None:
    sub = Recorder()
    subscribe(sub)
    notify(Level.OK)
    notify(Level.HIGH)
    notify("high")
    notify("critical")
    notify("ok")
    assert sub.levels == ["high", "critical", "ok"]
    assert all(isinstance(level, Level) for level in sub.levels)


def test_notify_rejects_unknown_level() -> None:
    with pytest.raises(ValueError, match="unknown pressure level 'severe'; use one of ok,"):
        notify("severe")
    assert recorded_level() == "ok"


def test_subscribers_are_called_in_order_and_once() -> None:
    order: list[str] = []

    class Named(Recorder):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def on_pressure(self, level: Level) -> None:
            order.append(self.name)

    a, b, c = Named("a"), Named("b"), Named("c")
    for sub in (a, b, c, a):
        subscribe(sub)
    notify("high")
    assert order == ["a", "b", "c"]


def test_unsubscribe() -> None:
    a, b = Recorder(), Recorder()
    subscribe(a)
    subscribe(b)
    unsubscribe(a)
    unsubscribe(a)  # twice is harmless
    unsubscribe(Recorder())  # never subscribed: harmless
    notify("high")
    assert (a.levels, b.levels) == ([], ["high"])


def test_unreferenced_subscriber_drops_out() -> None:
    kept = Recorder()
    dropped = Recorder()
    subscribe(kept)
    subscribe(dropped)
    assert subscribers() == [kept, dropped]
    del dropped
    gc.collect()
    assert subscribers() == [kept]
    notify("high")
    assert kept.levels == ["high"]


def test_raising_subscriber_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    first, broken, last = Recorder(), Raising(), Recorder()
    for sub in (first, broken, last):
        subscribe(sub)
    with caplog.at_level(logging.ERROR, logger="tierflow"):
        notify("high")
    assert first.levels == broken.levels == last.levels == ["high"]
    assert "raised in on_pressure(high)" in caplog.text
    assert "subscriber broke" in caplog.text


def test_subscribers_are_called_without_the_registry_lock() -> None:
    seen: list[object] = []

    class Reentrant(Recorder):
        def on_pressure(self, level: Level) -> None:
            # would deadlock if notify() held the registry lock while calling
            seen.append((recorded_level(), len(subscribers())))
            subscribe(self)

    sub = Reentrant()
    subscribe(sub)
    worker = threading.Thread(target=notify, args=("high",), daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "notify() deadlocked calling a subscriber"
    assert seen == [(Level.HIGH, 1)]


def test_a_newer_change_supersedes_a_delivery_in_progress() -> None:
    class Escalating(Recorder):
        def on_pressure(self, level: Level) -> None:
            super().on_pressure(level)
            if level == "high":
                notify("ok")  # e.g. it freed enough to end the episode at once

    first, second = Escalating(), Recorder()
    subscribe(first)
    subscribe(second)
    notify("high")
    assert first.levels == ["high", "ok"]
    assert second.levels == ["ok"], "the stale 'high' must not reach later subscribers"
    assert recorded_level() == "ok"


def test_entering_critical_collects_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    collected: list[int] = []
    monkeypatch.setattr(pressure_mod.gc, "collect", lambda *a: collected.append(1) or 0)
    notify("high")
    assert collected == []
    notify("critical")
    notify("critical")
    assert collected == [1]


def test_subscribe_rejects_objects_that_cannot_subscribe() -> None:
    class OnlyOnPressure:
        def on_pressure(self, level: Level) -> None: ...

    with pytest.raises(TypeError, match="OnlyOnPressure lacks relieve"):
        subscribe(OnlyOnPressure())  # type: ignore[arg-type]

    class Slotted:
        __slots__ = ()

        def on_pressure(self, level: Level) -> None: ...

        def relieve(self) -> int:
            return 0

    with pytest.raises(TypeError, match="add '__weakref__' to its __slots__"):
        subscribe(Slotted())


def test_reset_forgets_the_level_without_notifying() -> None:
    sub = Recorder()
    subscribe(sub)
    notify("high")
    pressure_mod.reset()
    assert recorded_level() == "ok"
    assert sub.levels == ["high"]
    notify("high")
    assert sub.levels == ["high", "high"]


# -- relieve ----------------------------------------------------------------------------------


def test_relieve_sums_what_subscribers_release(caplog: pytest.LogCaptureFixture) -> None:
    subs = [Recorder(100), Raising(), Recorder(200), Recorder("lots"), Recorder(-5), Recorder(0)]
    for sub in subs:
        subscribe(sub)
    with caplog.at_level(logging.WARNING, logger="tierflow"):
        assert relieve() == 300
        assert memory.relieve() == 300
    assert [s.relieved for s in subs if type(s) is Recorder] == [2, 2, 2, 2, 2]
    assert "raised in relieve()" in caplog.text and "cannot relieve" in caplog.text
    assert "returned 'lots' from relieve(), not a byte count" in caplog.text
    assert "returned -5" in caplog.text


def test_relieve_with_no_subscribers_is_zero() -> None:
    assert subscribers() == []
    assert relieve() == 0


def test_relieve_does_not_change_the_level() -> None:
    sub = Recorder(10)
    subscribe(sub)
    relieve()
    assert sub.levels == [] and recorded_level() == "ok"
