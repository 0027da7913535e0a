"""Profiles: every task where it ran, memory samples, plans; summary, plot, HTML."""

from __future__ import annotations

import base64
import html
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.observe.profile import ComputeRecord, Profile, Sample, TaskRecord, tier_of
from tierflow.engine.program import halving
from tierflow.errors import install_command
from tierflow.system import budget

ROWS, COLS, BLOCK = 40_000, 4, 5_000


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return np.random.default_rng(3).uniform(1, 2, size=(ROWS, COLS)).astype("float32")


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    halving.forget()
    yield
    halving.forget()


def sampler_running() -> bool:
    return any(t.name == "tierflow-profile-sampler" for t in threading.enumerate())


def halves_above(limit: int) -> Any:
    """A block function that runs out of memory above ``limit`` rows."""

    def fn(b: np.ndarray) -> np.ndarray:
        if len(b) > limit:
            raise MemoryError("cannot allocate")
        return b * 2

    return fn


@pytest.mark.executors("threads", "serial", "processes", "dask", "ray")
def test_every_task_is_recorded_with_its_worker_times_rows_and_tier(
    src: Path, tmp_path: Path, data: np.ndarray, executor_name: str
) -> None:
    x = tw.from_npy(src, rows=BLOCK)
    with tw.profile() as p:
        mean, std = tw.compute(x.mean(axis=0), x.std(axis=0))
        ((x - mean) / std).to_npy(tmp_path / "z.npy")
    np.testing.assert_allclose(np.load(tmp_path / "z.npy"), (data - mean) / std, rtol=1e-5)

    assert [c.executor for c in p.computes] == [executor_name] * 2
    assert [len([t for t in p.tasks if t.compute == c.number]) for c in p.computes] == [
        c.tasks for c in p.computes
    ]
    blocks = [t for t in p.tasks if t.kind == "block"]
    for c in p.computes:  # every row was computed once per compute
        assert sum(t.rows for t in blocks if t.compute == c.number) == ROWS
    assert {t.kind for t in p.tasks} >= {"block", "finish", "commit"}
    for t in p.tasks:
        assert 0 <= t.start <= t.end <= p.now()
        assert t.worker and not t.error
    assert all(t.projected > 0 and t.inputs > 0 for t in blocks)  # each reads its rows
    workers = {t.worker for t in blocks}
    if executor_name == "threads":
        assert workers <= {f"tierflow-worker-{k}" for k in range(8)}
    elif executor_name == "serial":
        assert workers == {threading.current_thread().name}
    elif executor_name == "processes":
        assert all(re.fullmatch(r"tierflow-worker-\d+", w) for w in workers)
    else:  # a cluster's worker: its host and pid
        assert all(re.fullmatch(r".+:\d+", w) for w in workers)
    # The plan: one stage each (the mean and std are known before the second starts).
    assert [(c.stages, len(c.passes)) for c in p.computes] == [(1, 1), (1, 1)]
    assert p.computes[0].plan.startswith(f"{p.computes[0].tasks} tasks in 1 stage(s)")
    assert "mean(axis=0), std(axis=0)" in p.computes[0].passes[0][0]


@pytest.mark.executors("threads", "serial", "processes")
def test_halvings_in_a_task_are_counted_on_that_task(data: np.ndarray) -> None:
    x = tw.from_array(data, rows=BLOCK)
    y = x.map_blocks(halves_above(BLOCK // 2), dtype=data.dtype, row_shape=(COLS,))
    (out,) = tw.compute(y, profile=True)
    np.testing.assert_array_equal(out, data * 2)
    p = tw.last_profile()
    assert p is not None
    halved = [t for t in p.tasks if t.halvings]
    assert halved and halved[0].kind == "block"
    # The first block halves; later ones start at the remembered size (in the process
    # that ran the first: other worker processes halve once each too).
    assert 1 <= sum(t.halvings for t in p.tasks) <= 8
    assert p.summary().retries == sum(t.halvings for t in p.tasks)


@pytest.mark.executors("threads", "serial")  # the store is opened in this process
def test_cache_hits_are_counted_on_the_tasks_that_read_the_cache(src: Path, tmp_path: Path) -> None:
    y = tw.from_npy(src, rows=BLOCK) * 3
    y.compute(cache=str(tmp_path / "store"))
    with tw.profile() as p:
        y.compute(cache=str(tmp_path / "store"))
    hits = [t for t in p.tasks if t.cache_hits]
    assert len(hits) == ROWS // BLOCK and all(t.kind == "block" for t in hits)
    assert p.summary().cache_hits == ROWS // BLOCK


@pytest.mark.executors("threads")
def test_an_array_a_task_places_on_the_ssd_is_a_spill_of_that_task(data: np.ndarray) -> None:
    tw.memory.budget("256KB")

    def to_ssd(b: np.ndarray) -> np.ndarray:
        scratch = tw.memory.array((100_000,), "float32")  # over the budget: a spill file
        scratch[:10] = 1
        return b + scratch[0]

    x = tw.from_array(data[:1000], rows=500)
    y = x.map_blocks(to_ssd, dtype=data.dtype, row_shape=(COLS,))
    with tw.profile() as p:
        y.sum(axis=0).compute()
    blocks = [t for t in p.tasks if t.kind == "block"]  # 2 blocks, or pieces of them
    assert len(blocks) >= 2
    assert all(t.spills == 1 and t.spilled_bytes == 400_000 for t in blocks)
    assert not any(t.spills for t in p.tasks if t.kind != "block")
    assert p.summary().bytes_spilled == len(blocks) * 400_000


@pytest.mark.executors("threads")
def test_samples_come_every_interval_with_memory_by_tier_budget_and_level(
    data: np.ndarray,
) -> None:
    p = Profile(interval=0.01)
    seen = threading.Event()

    def wait_for_samples(b: np.ndarray) -> np.ndarray:
        first = len(p.samples)
        while len(p.samples) < first + 3:  # the sampler's own thread adds them
            seen.wait(0.005)
        return b + 1

    x = tw.from_array(data, rows=ROWS // 2)
    y = x.map_blocks(wait_for_samples, dtype=data.dtype, row_shape=(COLS,))
    (out,) = tw.compute(y, profile=p)
    np.testing.assert_array_equal(out, data + 1)
    assert not sampler_running()  # stopped with the compute that started it
    times = [s.t for s in p.samples]
    assert len(times) >= 7 and times == sorted(times)
    assert all(s.rss > 0 and s.anon > 0 and s.budget == budget.budget_bytes() for s in p.samples)
    assert {s.level for s in p.samples} <= {"ok", "moderate", "high", "critical"}
    # While the tasks ran, their projected bytes were admitted: RAM held.
    during = [s for s in p.samples if p.computes[0].start < s.t < p.computes[0].end]
    assert max(s.ram for s in during) >= data.nbytes // 2
    assert p.summary().peak_held["RAM"] == max(s.ram for s in p.samples)
    assert p.summary().peak_rss == max(s.rss for s in p.samples)


@pytest.mark.executors("threads", "serial", "processes")
def test_a_compute_shorter_than_a_sample_still_shows_what_it_held(data: np.ndarray) -> None:
    x = tw.from_array(data, rows=BLOCK)
    with Profile(interval=3600) as p:  # no sample falls inside the compute
        tw.compute(x.mean(axis=0), x.std(axis=0))
    (record,) = p.computes
    # Samples at the start, at the compute's end and at the stop: the one at the end
    # holds the most admitted during the compute.
    assert len(p.samples) == 3
    assert p.samples[1].ram >= record.peak_bytes > 0
    assert p.summary().peak_held["RAM"] >= record.peak_bytes


@pytest.mark.executors("serial")
def test_a_sample_takes_the_recorded_pressure_level(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierflow.engine.observe import profile as profile_module
    from tierflow.system.types import Level

    monkeypatch.setattr(profile_module.pressure, "recorded_level", lambda: Level.HIGH)
    assert Profile().sample().level == "high"


@pytest.mark.executors("threads")
def test_a_sample_that_fails_does_not_fail_the_compute(
    data: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierflow.engine.observe import profile as profile_module

    def unreadable(pid: int | None = None) -> Any:
        raise OSError("no /proc here")

    monkeypatch.setattr(profile_module, "resident", unreadable)
    with tw.profile(interval=0.01) as p:
        (total,) = tw.compute(tw.from_array(data, rows=BLOCK).sum(axis=0))
    np.testing.assert_allclose(total, data.sum(axis=0, dtype=np.float64), rtol=1e-6)
    assert p.samples == [] and len(p.tasks) == p.computes[0].tasks
    assert not sampler_running()


@pytest.mark.executors("processes")
def test_worker_processes_resident_memory_is_sampled(data: np.ndarray, src: Path) -> None:
    x = tw.from_npy(src, rows=BLOCK)
    with tw.profile() as p:
        tw.compute(x.sum(axis=0))  # its last sample is taken before it lets the pool go
    during = [s for s in p.samples if s.t <= p.computes[0].end]
    assert any(s.workers_rss > 0 for s in during)


@pytest.mark.executors("threads")
def test_profile_off_records_nothing_and_runs_no_sampler(data: np.ndarray) -> None:
    x = tw.from_array(data, rows=BLOCK)
    with tw.profile() as p:
        assert sampler_running()
        tw.compute(x.sum(axis=0), profile=False)
    assert p.tasks == [] and p.computes == []
    assert not sampler_running()
    before = tw.last_profile()
    tw.compute(x.sum(axis=0))
    assert tw.last_profile() is before and not sampler_running()


@pytest.mark.executors("threads")
def test_profile_true_inside_a_with_block_records_there(data: np.ndarray) -> None:
    x = tw.from_array(data, rows=BLOCK)
    with tw.profile() as p:
        tw.compute(x.sum(axis=0), profile=True)
        x.persist(profile=True)
    assert len(p.computes) == 2 and tw.last_profile() is p


@pytest.mark.executors("threads")
def test_a_failed_task_is_recorded_as_failed(data: np.ndarray) -> None:
    def boom(b: np.ndarray) -> np.ndarray:
        raise ValueError("no")

    y = tw.from_array(data, rows=BLOCK).map_blocks(boom, dtype=data.dtype, row_shape=(COLS,))
    with tw.profile() as p, pytest.raises(tw.errors.BlockError):
        y.compute()
    assert any(t.error for t in p.tasks)
    assert p.computes[0].error is not None and "no" in p.computes[0].error


@pytest.mark.executors("threads")
def test_profile_option_is_refused_when_it_is_not_a_profile(data: np.ndarray) -> None:
    with pytest.raises(TypeError, match="profile must be True, False, None or a Profile"):
        tw.compute(tw.from_array(data).sum(), profile="yes")


@pytest.mark.executors("serial")
def test_the_tier_of_a_result_is_where_its_biggest_array_lives() -> None:
    in_ram = np.ones(1000)
    tw.memory.budget("16KB")
    on_ssd = tw.memory.array((10_000,), "float64")  # 80 KB: over the budget
    assert [tier_of(v) for v in (in_ram, on_ssd, None, (None, None))] == ["RAM", "SSD", "-", "-"]
    assert tier_of((np.ones(2), on_ssd)) == "SSD" and tier_of((in_ram, np.ones(2))) == "RAM"
    assert tier_of({"count": 3}) == "value"


# -- what you get: plot, summary, HTML ---------------------------------------------------


def made_up() -> Profile:
    """A profile of two workers and seven tasks, a budget of 8 GB and a high band."""
    p = Profile()
    record = ComputeRecord(0, what="made up", executor="threads", workers=2, budget=8 << 30)
    record.start, record.end, record.stage_starts, record.tasks = 0.0, 1.0, [0, 4], 7
    p.computes.append(record)
    for k in range(7):
        worker = f"tierflow-worker-{k % 2}"
        kind = "block" if k not in (3, 6) else "finish"
        name = f"block {k} of x.sum()" if kind == "block" else "finish sum"
        p.tasks.append(
            TaskRecord(
                0, k, name, kind, worker, k * 0.1, k * 0.1 + 0.09, 100, 4 << 20, 1 << 20, "-"
            )
        )
    levels = ["ok"] * 5 + ["high"] * 5 + ["ok"] * 5
    for k, level in enumerate(levels):
        gb = 1 << 30
        p.samples.append(Sample(k * 0.07, 3 * gb, 2 * gb, gb, 2 * gb, gb // 2, 0, 8 * gb, level))
    return p


@pytest.mark.executors("serial")
def test_plot_has_a_lane_per_worker_a_rectangle_per_task_and_the_budget_line() -> None:
    p = made_up()
    fig = p.plot()
    tasks_ax, memory_ax = fig.axes[:2]
    (bars,) = [c for c in tasks_ax.collections if c.get_gid() == "tasks"]
    assert len(bars.get_paths()) == len(p.tasks) == 7
    assert [t.get_text() for t in tasks_ax.get_yticklabels()] == [
        "tierflow-worker-0",
        "tierflow-worker-1",
    ]
    # Colours by kind: blocks and finishes differ.
    assert len({tuple(c) for c in bars.get_facecolors()}) == 2
    lines = {line.get_label(): line for line in memory_ax.get_lines()}
    assert set(np.asarray(lines["budget"].get_ydata(), dtype=float)) == {8.0}  # GB
    assert set(np.asarray(lines["RSS"].get_ydata(), dtype=float)) == {3.0}
    bands = [a for a in memory_ax.patches if a.get_gid() == "pressure"]
    assert len(bands) == 1  # the five "high" samples
    (band,) = bands
    start, stop = band.get_x(), band.get_x() + band.get_width()  # type: ignore[attr-defined]
    assert (start, stop) == pytest.approx((5 * 0.07, 10 * 0.07))  # to the next "ok" sample
    stacks = [c for c in memory_ax.collections if c.get_label() in ("RAM held", "SSD held")]
    assert len(stacks) == 2
    legend = [t.get_text() for t in memory_ax.get_legend().get_texts()]
    assert "pressure high" in legend and "pressure critical" not in legend  # what occurred


@pytest.mark.executors("serial")
def test_summary_gives_time_per_stage_bytes_and_peaks() -> None:
    s = made_up().summary()
    assert s.tasks == 7 and s.computes == 1
    assert s.stages == pytest.approx({"stage 0: x.sum()": 0.39, "stage 1: x.sum()": 0.29})
    assert s.bytes_read == 5 * (1 << 20)  # the five block tasks' inputs
    assert s.peak_held == {"RAM": 2 << 30, "SSD": 1 << 29, "GPU": 0}
    assert s.peak_rss == 3 << 30
    assert s.busy == pytest.approx({"tierflow-worker-0": 0.36, "tierflow-worker-1": 0.27})


@pytest.mark.executors("serial")
def test_repr_html_is_an_inline_picture_and_the_summary() -> None:
    text = made_up()._repr_html_()
    match = re.search(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", text)
    assert match is not None
    assert base64.b64decode(match.group(1)).startswith(b"\x89PNG\r\n\x1a\n")
    assert "<th style='text-align:left;padding-right:1em'>peak RSS</th>" in text


@pytest.mark.executors("serial")
def test_save_writes_one_html_file_that_fetches_nothing(tmp_path: Path) -> None:
    path = made_up().save(tmp_path / "run.html")
    assert path == str(tmp_path / "run.html")
    text = Path(path).read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:|//)", text)
    assert "<script" not in text and "<link" not in text
    assert text.count("data:image/png;base64,") == 1
    assert "made up" in text  # the compute's plan section
    assert [p.name for p in tmp_path.iterdir()] == ["run.html"]  # no temporary left


@pytest.mark.executors("serial")
def test_save_without_matplotlib_writes_the_figures_and_says_why_there_is_no_picture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    with pytest.warns(UserWarning) as caught:
        path = made_up().save(tmp_path / "run.html")
    reason = f"a profile picture needs the optional package 'matplotlib': {install_command('plot')}"
    (warning,) = caught
    assert str(warning.message) == f"the profile at {path} has no picture: {reason}"
    assert warning.filename == __file__  # the line that saved
    text = Path(path).read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert "data:image/png" not in text
    assert f"No picture: {html.escape(reason)}" in text
    assert "<th style='text-align:left;padding-right:1em'>peak RSS</th>" in text  # figures
    assert "made up" in text  # the plans
    assert [p.name for p in tmp_path.iterdir()] == ["run.html"]
