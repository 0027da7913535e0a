"""The background pressure watcher (tierflow/system/watch.py)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tierflow import memory
from tierflow.system import pressure as pressure_mod
from tierflow.system.pressure import Pressure, subscribe
from tierflow.system.types import Level
from tierflow.system.watch import Watcher, on_pressure

from common import wait_for

GB = 1 << 30


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(pressure_mod, "_subscribers", {})
    pressure_mod.reset()
    yield
    pressure_mod.reset()


class FakeReader:
    """Stands in for pressure(): returns a reading at ``level`` and counts readings."""

    def __init__(self) -> None:
        self.level = Level.OK
        self.reads = 0
        self.fail = False

    def __call__(self, root: str | None = None) -> Pressure:
        self.reads += 1
        if self.fail:
            raise OSError("cannot read /proc/meminfo")
        return Pressure(self.level, GB, 8 * GB, 0.125, 12.0, 6.0)


@pytest.fixture
def reader(monkeypatch: pytest.MonkeyPatch) -> FakeReader:
    fake = FakeReader()
    monkeypatch.setattr(pressure_mod, "pressure", fake)
    return fake


@pytest.fixture
def start() -> Iterator[Callable[..., Watcher]]:
    """on_pressure, with every watcher stopped at the end of the test even if it fails."""
    started: list[Watcher] = []

    def _start(*args: Any, **kwargs: Any) -> Watcher:
        watcher = on_pressure(*args, **kwargs)
        started.append(watcher)
        return watcher

    yield _start
    for watcher in started:
        watcher.stop()


class Calls:
    """A callback that records the readings it got and when."""

    def __init__(self, raises: bool = False) -> None:
        self.readings: list[Pressure] = []
        self.times: list[float] = []
        self.raises = raises

    def __call__(self, reading: Pressure) -> None:
        self.readings.append(reading)
        self.times.append(time.monotonic())
        if self.raises:
            raise RuntimeError("callback failed")


def test_fires_with_the_reading_when_the_level_is_reached(
    reader: FakeReader, start: Callable[..., Watcher]
) -> None:
    reader.level = Level.HIGH
    fn = Calls()
    watcher = start(fn, level="high", every=0.02, repeat=0.05)
    wait_for(lambda: len(fn.readings) >= 1)
    assert fn.readings[0].level == "high" and fn.readings[0].free == GB
    assert watcher.last is not None and watcher.calls >= 1


def test_worse_levels_fire_too(reader: FakeReader, start: Callable[..., Watcher]) -> None:
    reader.level = Level.CRITICAL
    fn = Calls()
    start(fn, level="moderate", every=0.02)
    wait_for(lambda: len(fn.readings) >= 1)
    assert fn.readings[0].level is Level.CRITICAL


def test_repeats_every_repeat_seconds_while_it_lasts(
    reader: FakeReader, start: Callable[..., Watcher]
) -> None:
    reader.level = Level.HIGH
    fn = Calls()
    start(fn, level="high", every=0.02, repeat=0.05)
    wait_for(lambda: len(fn.times) >= 4)
    times = list(fn.times)  # a snapshot: the watcher keeps appending
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # readings come every 0.02 s, but fn is called again only after `repeat`
    assert min(gaps) >= 0.04, gaps
    assert reader.reads > len(fn.times)


def test_quiet_below_the_level(reader: FakeReader, start: Callable[..., Watcher]) -> None:
    reader.level = Level.MODERATE
    fn = Calls()
    watcher = start(fn, level="high", every=0.01)
    wait_for(lambda: reader.reads >= 5)
    assert fn.readings == [] and watcher.calls == 0


def test_once_per_episode_with_repeat_none(
    reader: FakeReader, start: Callable[..., Watcher]
) -> None:
    reader.level = Level.HIGH
    fn = Calls()
    start(fn, level="high", every=0.01, repeat=None)
    wait_for(lambda: reader.reads >= 5)
    assert len(fn.readings) == 1
    reader.level = Level.OK  # the episode ends ...
    seen = reader.reads
    wait_for(lambda: reader.reads >= seen + 3)
    reader.level = Level.CRITICAL  # ... and a new one calls at once
    wait_for(lambda: len(fn.readings) == 2)
    assert fn.readings[1].level == "critical"


def test_keeps_running_after_fn_raises(
    reader: FakeReader, start: Callable[..., Watcher], caplog: pytest.LogCaptureFixture
) -> None:
    reader.level = Level.HIGH
    fn = Calls(raises=True)
    with caplog.at_level(logging.ERROR, logger="tierflow"):
        watcher = start(fn, level="high", every=0.01, repeat=0.02)
        wait_for(lambda: watcher.errors >= 3)
    assert watcher.running
    assert "raised; the watcher keeps running" in caplog.text
    assert "callback failed" in caplog.text


def test_keeps_running_when_a_reading_fails(
    reader: FakeReader, start: Callable[..., Watcher], caplog: pytest.LogCaptureFixture
) -> None:
    reader.fail = True
    fn = Calls()
    with caplog.at_level(logging.DEBUG, logger="tierflow"):
        watcher = start(fn, level="high", every=0.01)
        wait_for(lambda: reader.reads >= 4)
        reader.level, reader.fail = Level.HIGH, False
        wait_for(lambda: len(fn.readings) >= 1)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning per failure streak, not one per tick"
    assert "cannot read memory pressure" in warnings[0].getMessage()
    assert watcher.running


def test_forwards_level_changes_to_subscribers(
    reader: FakeReader, start: Callable[..., Watcher]
) -> None:
    class Sub:
        def __init__(self) -> None:
            self.levels: list[Level] = []

        def on_pressure(self, level: Level) -> None:
            self.levels.append(level)

        def relieve(self) -> int:
            return 0

    sub = Sub()
    subscribe(sub)
    reader.level = Level.HIGH
    start(lambda r: None, level="critical", every=0.01)
    wait_for(lambda: sub.levels == ["high"])
    reader.level = Level.OK
    wait_for(lambda: sub.levels == ["high", "ok"])
    assert pressure_mod.recorded_level() == "ok"


def test_stop_is_prompt_and_joins(reader: FakeReader) -> None:
    watcher = on_pressure(lambda r: None, every=60)
    wait_for(lambda: reader.reads >= 1)
    began = time.monotonic()
    watcher.stop()
    assert time.monotonic() - began < 2.0, "stop() must wake the thread, not wait out `every`"
    assert not watcher.running  # its thread has ended: nothing more is read
    watcher.stop()  # twice is harmless
    assert not watcher.running


def test_context_manager_stops(reader: FakeReader) -> None:
    with on_pressure(lambda r: None, every=0.01) as watcher:
        assert watcher.running
        assert "running" in repr(watcher)
    assert not watcher.running
    assert "stopped" in repr(watcher)


def test_stop_from_inside_fn(reader: FakeReader) -> None:
    reader.level = Level.HIGH
    holder: list[Watcher] = []
    ready = threading.Event()

    def stop_myself(reading: Pressure) -> None:
        ready.wait(5)
        holder[0].stop()

    watcher = on_pressure(stop_myself, every=0.01)
    holder.append(watcher)
    ready.set()
    wait_for(lambda: not watcher.running)
    assert watcher.calls == 1


def test_repr_and_html(reader: FakeReader, start: Callable[..., Watcher]) -> None:
    def alert(reading: Pressure) -> None: ...

    watcher = start(alert, level="moderate", every=0.5, repeat=None)
    text = repr(watcher)
    assert text.startswith("<Watcher ")
    assert "alert at level >= moderate, every 0.5 s, once per episode" in text
    wait_for(lambda: watcher.last is not None)
    assert "last reading: ok: 1.0 GB free" in watcher._repr_html_()


def test_the_facade_exports_it(reader: FakeReader) -> None:
    with memory.on_pressure(lambda r: None, every=0.01) as watcher:
        assert isinstance(watcher, Watcher)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"fn": 3}, TypeError, "on_pressure needs a function fn\\(reading\\) to call, got int 3"),
        ({"level": "severe"}, ValueError, "unknown pressure level 'severe'; use one of ok,"),
        ({"every": 0}, ValueError, "every=0 must be a positive number of seconds"),
        ({"every": -1.5}, ValueError, "every=-1.5 must be a positive number of seconds"),
        ({"every": float("nan")}, ValueError, "every=nan must be a positive"),
        ({"every": float("inf")}, ValueError, "every=inf must be a positive"),
        ({"every": True}, ValueError, "every=True must be a positive"),
        ({"every": "1"}, ValueError, "every='1' must be a positive"),
        ({"repeat": 0}, ValueError, "repeat=0 must be a positive number of seconds \\(or None"),
        ({"repeat": -2}, ValueError, "repeat=-2 must be a positive"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    args: dict[str, Any] = {"fn": lambda r: None, **kwargs}
    before = threading.active_count()
    with pytest.raises(error, match=message):
        on_pressure(**args)
    assert threading.active_count() == before, "no thread may be left behind"
