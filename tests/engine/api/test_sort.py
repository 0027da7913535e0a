"""Sorting along the rows: np.sort/argsort(axis=0), tw.sort_rows, tw.topk, np.partition.

NumPy is the oracle: ``np.sort`` and ``np.argsort`` with ``kind="stable"``, and
``np.lexsort`` for ``sort_rows`` (descending: ``np.lexsort`` of the negated keys, NaN
still last). Results are compared bit for bit (``-0.0`` and ``0.0`` tie, so their order
shows whether the sort is stable).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tierflow as tw
from tierflow.engine.io.memory import ArraySink
from tierflow.engine.planning.plan import Target, build_plan, describe
from tierflow.engine.rowwide import external_sort
from tierflow.storage import spill

from common import examples

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"]
SETTINGS = settings(
    max_examples=examples(20),  # each example runs an external sort of run files
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def arrays(draw: st.DrawFn, row_shapes: tuple[tuple[int, ...], ...] = ((), (1,), (3,), (2, 3))):
    """Odd row counts, every dtype in either byte order; few distinct values (ties), NaN,
    -0.0, constant columns."""
    dt = np.dtype(draw(st.sampled_from(DTYPES)))
    rows = draw(st.sampled_from([0, 1, 2, 5, 13, 31, 64]))
    row_shape = draw(st.sampled_from(row_shapes))
    if dt.kind == "f":
        elements = st.sampled_from([np.nan, 0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, 7.0])
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        elements = st.sampled_from([int(info.min), 0, 1, 3, int(info.max)])
    else:
        elements = st.booleans()
    a = draw(hnp.arrays(dt, (rows, *row_shape), elements=elements))
    if rows and row_shape and draw(st.booleans()):
        a.reshape(rows, -1)[:, 0] = a.reshape(rows, -1)[0, 0]  # a constant column
    if draw(st.booleans()):  # the sort keys are the values' bits: the other order too
        a = a.astype(a.dtype.newbyteorder())
    return a


def lazy(a: np.ndarray, data: st.DataObject) -> tw.Array:
    return tw.from_array(a, rows=data.draw(st.integers(1, 9), label="rows per block"))


def same(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal dtype, shape and bits (NaN payloads and the sign of zeros included)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.tobytes() == expected.tobytes(), (got, expected)


def descending(column: np.ndarray) -> np.ndarray:
    """The oracle's descending key: NaN still last."""
    if column.dtype.kind == "f":
        return -column
    if column.dtype.kind == "b":
        return ~column
    return ~column


def leftovers() -> list[str]:
    """Files and sort folders left under the spill root."""
    root = spill.spill_root()
    found = []
    for folder, dirs, files in os.walk(root):
        found += [os.path.join(folder, d) for d in dirs if d.startswith("sort-")]
        found += [os.path.join(folder, f) for f in files]
    return found


# -- against NumPy ----------------------------------------------------------------------


@pytest.mark.executors("threads", "serial")
@SETTINGS
@given(a=arrays(), data=st.data())
def test_sort_along_the_rows_is_numpys_stable_sort(a: np.ndarray, data: st.DataObject) -> None:
    same(np.sort(lazy(a, data), axis=0).compute(), np.sort(a, axis=0, kind="stable"))


@pytest.mark.executors("threads", "serial")
@SETTINGS
@given(a=arrays(), data=st.data())
def test_argsort_along_the_rows_is_numpys_stable_argsort(
    a: np.ndarray, data: st.DataObject
) -> None:
    x = lazy(a, data)
    same(x.argsort(axis=0).compute(), np.argsort(a, axis=0, kind="stable"))
    same(np.argsort(x, axis=0).compute(), np.argsort(a, axis=0, kind="stable"))


@pytest.mark.executors("threads", "serial")
@SETTINGS
@given(a=arrays(row_shapes=((3,), (5,))), data=st.data())
def test_sort_rows_is_lexsort_of_the_key_columns(a: np.ndarray, data: st.DataObject) -> None:
    width = a.shape[1]
    by = data.draw(st.lists(st.integers(0, width - 1), min_size=1, max_size=3), label="by")
    down = data.draw(st.booleans(), label="descending")
    keys = [descending(a[:, c]) if down else a[:, c] for c in by]
    expected = a[np.lexsort(keys[::-1])]
    same(tw.sort_rows(lazy(a, data), by=by, descending=down).compute(), expected)


@pytest.mark.executors("threads", "serial")
@SETTINGS
@given(a=arrays(row_shapes=((),)), data=st.data())
def test_sort_rows_of_a_1d_array_sorts_its_values(a: np.ndarray, data: st.DataObject) -> None:
    down = data.draw(st.booleans(), label="descending")
    expected = a[np.argsort(descending(a) if down else a, kind="stable")]
    same(tw.sort_rows(lazy(a, data), descending=down).compute(), expected)
    same(np.sort(lazy(a, data), axis=None).compute(), np.sort(a, kind="stable"))


@pytest.mark.executors("threads", "serial")
@SETTINGS
@given(a=arrays(row_shapes=((), (3,))), data=st.data())
def test_sort_after_a_mask_with_unknown_row_counts(a: np.ndarray, data: st.DataObject) -> None:
    keep = data.draw(hnp.arrays(np.bool_, a.shape[0]), label="mask")
    x = lazy(a, data)
    picked = x[tw.from_array(keep, rows=x.blocks[0][1] if x.blocks else 1)]
    kept = a[keep]
    assert picked.shape[0] == (0 if len(a) == 0 else None)  # none of none, known at once
    same(np.sort(picked, axis=0).compute(), np.sort(kept, axis=0, kind="stable"))
    same(np.argsort(picked, axis=0).compute(), np.argsort(kept, axis=0, kind="stable"))
    if a.ndim == 2:
        same(tw.sort_rows(picked, by=[2, 0]).compute(), kept[np.lexsort((kept[:, 0], kept[:, 2]))])


def top_oracle(a: np.ndarray, k: int) -> np.ndarray:
    """The first k rows of each column sorted descending, stably, NaN last."""
    order = np.argsort(descending(a), axis=0, kind="stable")
    return np.take_along_axis(a, order, axis=0)[:k]


@pytest.mark.executors("threads", "serial")
@SETTINGS
@given(a=arrays(), data=st.data())
def test_topk_is_the_k_largest_of_each_column_largest_first(
    a: np.ndarray, data: st.DataObject
) -> None:
    if len(a) == 0:
        return
    k = data.draw(st.integers(1, len(a)), label="k")
    same(tw.topk(lazy(a, data), k).compute(), top_oracle(a, k))


@pytest.mark.executors("threads", "serial")
@SETTINGS
@given(a=arrays(row_shapes=((), (3,))), data=st.data())
def test_partition_puts_every_kth_where_numpy_does(a: np.ndarray, data: st.DataObject) -> None:
    if len(a) == 0:
        return
    kth = data.draw(st.lists(st.integers(-len(a), len(a) - 1), min_size=1, max_size=3))
    got = np.partition(lazy(a, data), kth, axis=0).compute()
    expected = np.partition(a, kth, axis=0)
    for k in kth:
        np.testing.assert_array_equal(got[k], expected[k])
        ok = np.isnan(got[k]) if a.dtype.kind == "f" else np.zeros(got[k].shape, bool)
        assert np.all(ok | (got[:k] <= got[k]).all(axis=0) if k else True)
    same(np.sort(got, axis=0, kind="stable"), np.sort(a, axis=0, kind="stable"))


# -- a lazy array like any other ---------------------------------------------------------


def test_a_sorted_array_is_consumed_further(tmp_path: Path) -> None:
    a = np.random.default_rng(0).normal(size=(5000, 3)).astype(np.float32)
    x = tw.from_array(a, rows=700)
    s = np.sort(x, axis=0)
    expected = np.sort(a, axis=0, kind="stable")
    assert s.shape == a.shape and s.dtype == a.dtype
    np.testing.assert_allclose(
        s.sum(axis=0).compute(), expected.sum(axis=0, dtype=np.float64), rtol=1e-5
    )
    same(s[1234:3001:7].compute(), expected[1234:3001:7])
    same(s[-3:].compute(), expected[-3:])
    same((s * 2 + 1).compute(), expected * 2 + 1)
    same((s - x).compute(), expected - a)  # a sorted array has the rows of its input
    s.to_npy(tmp_path / "s.npy")
    same(np.load(tmp_path / "s.npy"), expected)
    order = np.argsort(x[:, 1], axis=0)
    same(order.compute(), np.argsort(a[:, 1], kind="stable"))
    assert leftovers() == []


def test_sort_rows_of_a_file_into_a_new_npy(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 50, size=(20_011, 4)).astype(np.float32)
    a[rng.random(20_011) < 0.05, 2] = np.nan
    np.save(tmp_path / "in.npy", a)
    x = tw.from_npy(tmp_path / "in.npy", rows=1500)
    tw.sort_rows(x, by=2, descending=True).to_npy(tmp_path / "out.npy")
    expected = a[np.lexsort((-a[:, 2],))]
    same(np.load(tmp_path / "out.npy"), expected)
    assert np.isnan(np.load(tmp_path / "out.npy")[-1, 2])  # NaN last, also descending
    assert leftovers() == []


def test_topk_after_a_mask_and_of_a_small_result() -> None:
    a = np.arange(40.0).reshape(20, 2)
    x = tw.from_array(a, rows=3)
    same(tw.topk(x[x[:, 0] < 20], 2).compute(), np.array([[18.0, 19.0], [16.0, 17.0]]))
    same(tw.topk(x.sum(axis=1), 1).compute(), np.array([77.0]))
    with pytest.raises(ValueError, match=r"topk: k=5 is more than the 3 rows"):
        tw.topk(x[x[:, 0] < 6], 5).compute()


def test_sorting_a_value_in_memory_is_numpys() -> None:
    a = np.array([[3, 1], [1, 2], [3, 0]])
    m = tw.from_array(a, rows=2).sum(axis=0, keepdims=True) * np.ones((3, 1), int)
    same(tw.sort_rows(m, by=0).compute(), np.array([[7, 3]] * 3))
    same(tw.sort_rows(tw.from_array(a).max(axis=1)).compute(), np.array([2, 3, 3]))


# -- out of core --------------------------------------------------------------------------


@pytest.mark.executors("threads", "serial")
def test_a_tiny_budget_cuts_the_sort_into_many_small_runs(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    a = rng.integers(-1000, 1000, size=(60_000, 4)).astype(np.int32)
    tw.memory.budget("256KB")
    x = tw.from_array(a, rows=20_000)  # three blocks of 320 KB: each is cut in pieces
    s = tw.sort_rows(x, by=[1, 3])
    plan = build_plan([Target(s._node, ArraySink(s._node))], workers=2, budget=256 << 10)
    runs = [t for t in plan.tasks if t.name.startswith("block") and "sort runs" in t.name]
    assert len(runs) > 3 * 4 and max(t.memory.total for t in plan.tasks) <= 256 << 10
    s.to_npy(tmp_path / "s.npy")
    same(np.load(tmp_path / "s.npy"), a[np.lexsort((a[:, 3], a[:, 1]))])
    same(np.argsort(x, axis=0).compute(), np.argsort(a, axis=0, kind="stable"))
    assert leftovers() == []


def test_describe_shows_the_two_passes() -> None:
    x = tw.from_array(np.zeros((1000, 2), np.float32), rows=250)
    s = tw.sort_rows(x, by=1, descending=True)
    plan = build_plan([Target(s._node, ArraySink(s._node))], workers=2, budget=1 << 30)
    text = describe(plan, tasks=True)
    assert text.startswith("11 tasks in 2 stage(s), 2 pass(es)")
    assert "program 0: sort runs for sort_rows(by=[1], descending) (4 blocks)" in text
    assert "program 1: merge runs of sort_rows(by=[1], descending) (4 blocks)" in text
    assert "finish sort runs for sort_rows" in text and "prepare merge runs of" in text
    assert plan.scratch and leftovers() == []  # planning wrote nothing


def test_unknown_row_counts_merge_into_equal_shares(tmp_path: Path) -> None:
    a = np.arange(100, 0, -1)
    x = tw.from_array(a, rows=10)
    s = np.sort(x[x % 3 != 0], axis=0)  # 67 rows in 10 blocks of unknown size
    assert s.shape == (None,) and s.nblocks == 10
    same(s.compute(), np.sort(a[a % 3 != 0]))
    s.to_npy(tmp_path / "s.npy")  # appended block by block
    same(np.load(tmp_path / "s.npy"), np.sort(a[a % 3 != 0]))
    same(np.sort(x[x > 1000], axis=0).compute(), np.zeros(0, a.dtype))


def test_a_sort_after_a_mask_is_reversed_sliced_and_counted_as_numpy() -> None:
    a = np.arange(20.0) - 5
    v = tw.from_array(a, rows=3)
    kept = a[a > 0]
    same(np.sort(v[v > 0])[::-1].compute(), np.sort(kept)[::-1])
    assert len(np.sort(v[v > 0])) == len(kept)
    same(np.argsort(v[v > 0][1:]).compute(), np.argsort(kept[1:], kind="stable"))
    t = np.arange(40.0).reshape(20, 2) % 7 - 2
    x = tw.from_array(t, rows=3)
    m = x[:, 0] > 0
    rows = t[t[:, 0] > 0]
    same(tw.sort_rows(x[m])[:2].compute(), rows[np.lexsort((rows[:, 1], rows[:, 0]))][:2])
    same(tw.topk(x[m], 2)[::-1].compute(), (-np.sort(-rows, axis=0))[:2][::-1])
    assert leftovers() == []


def test_len_of_a_sort_after_a_mask_counts_the_mask_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a = np.arange(30) % 7
    v = tw.from_array(a, rows=4)
    s = np.sort(v[v > 2])
    with caplog.at_level(logging.DEBUG, logger="tierflow.engine"):
        n = len(s)
        assert n == int((a > 2).sum()) and s.shape == (n,)
        same(s[-2:].compute(), np.sort(a[a > 2])[-2:])
    counts = [r for r in caplog.records if r.getMessage().startswith("plan of count rows")]
    assert len(counts) <= 1, [r.getMessage() for r in counts]  # none if counted before
    runs = s._node.inputs[0]
    assert not runs.cacheable and runs.scratch is not None  # type: ignore[attr-defined]
    assert leftovers() == []


# -- run files ------------------------------------------------------------------------------


def _run_folder(s: tw.Array) -> external_sort.RunFiles:
    runs = s._node.inputs[0]
    return runs.scratch  # type: ignore[attr-defined, no-any-return]


@pytest.mark.executors("threads", "serial")  # observes the run folder from map_blocks
def test_run_files_are_removed_after_success() -> None:
    a = np.random.default_rng(3).random((3000, 2))
    s = np.sort(tw.from_array(a, rows=100), axis=0)
    seen: list[list[str]] = []
    probe = s.map_blocks(lambda b: seen.append(_run_folder(s).live()) or b)
    same(probe.compute(), np.sort(a, axis=0))
    assert max(len(files) for files in seen) == 30  # one run per block while merging
    assert _run_folder(s).live() == [] and leftovers() == []


@pytest.mark.executors("threads", "serial")  # observes the run folder from map_blocks
def test_run_files_are_removed_after_an_error_in_the_pipeline() -> None:
    a = np.random.default_rng(4).random((3000, 2))
    s = tw.sort_rows(tw.from_array(a, rows=100), by=0)
    seen: list[int] = []

    def fails(b: np.ndarray) -> np.ndarray:
        seen.append(len(_run_folder(s).live()))
        if b[0, 0] > 0.5:
            raise ValueError("bad block")
        return b

    with pytest.raises(tw.errors.BlockError, match="bad block"):
        s.map_blocks(fails).sum().compute()
    assert seen and max(seen) == 30 and leftovers() == []


@pytest.mark.executors("threads", "serial")  # raises KeyboardInterrupt in this process
def test_run_files_are_removed_after_keyboard_interrupt(tmp_path: Path) -> None:
    a = np.random.default_rng(5).random((3000, 2))
    s = np.argsort(tw.from_array(a, rows=100), axis=0)
    merging = threading.Event()

    def interrupted(b: np.ndarray) -> np.ndarray:
        merging.set()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        s.map_blocks(interrupted).to_npy(tmp_path / "k.npy")
    assert merging.is_set() and leftovers() == [] and not (tmp_path / "k.npy").exists()


@pytest.mark.executors("threads", "serial")
def test_run_files_are_removed_when_the_first_pass_fails() -> None:
    calls = []

    def fails_late(b: np.ndarray) -> np.ndarray:
        calls.append(1)
        if len(calls) > 5:
            raise KeyboardInterrupt
        return b

    x = tw.from_array(np.arange(2000.0), rows=100).map_blocks(fails_late)
    with pytest.raises(KeyboardInterrupt):
        np.sort(x, axis=0).compute()
    assert len(calls) > 5 and leftovers() == []


# -- what is refused ---------------------------------------------------------------------------


def test_what_sorting_refuses_says_what_to_do() -> None:
    x = tw.from_array(np.zeros((10, 3)), rows=4)
    with pytest.raises(TypeError, match=r"order=\.\.\.\) sorts structured arrays"):
        np.sort(x, axis=0, order="a")
    with pytest.raises(ValueError, match=r"sort kind must be one of .* \(got 'bogus'\)"):
        np.argsort(x, axis=0, kind="bogus")
    with pytest.raises(TypeError, match=r"sorts booleans, integers and floats, not complex128"):
        np.sort(x.astype(complex), axis=0)
    with pytest.raises(IndexError, match=r"key column 3 is out of range for 3 columns"):
        tw.sort_rows(x, by=[0, 3])
    with pytest.raises(ValueError, match=r"sort_rows of a 1-D array sorts by its values"):
        tw.sort_rows(x[:, 0], by=0)
    with pytest.raises(ValueError, match=r"reshape it to \[rows, columns\]"):
        tw.sort_rows(x.reshape(10, 3, 1), by=0)
    with pytest.raises(ValueError, match=r"topk: k=11 is more than the 10 rows"):
        tw.topk(x, 11)
    with pytest.raises(ValueError, match=r"topk runs along the rows \(axis=0\), not axis=1"):
        tw.topk(x, 2, axis=1)
    with pytest.raises(ValueError, match=r"kth\(=10\) out of bounds \(10\)"):
        np.partition(x, 10, axis=0)
    with pytest.raises(ValueError, match=r"axis=None\) works on the flattened array"):
        np.sort(x, axis=None)


@pytest.mark.parametrize("dtype", ["complex64", ">f4", "int8"])
def test_a_sort_of_no_rows_is_numpys_whatever_the_dtype(dtype: str) -> None:
    # Nothing to sort: NumPy's answer, complex data too (refused only where rows are).
    a = np.zeros((0, 2), dtype)
    x = tw.from_array(a, rows=3)
    masked = tw.from_array(np.ones((0, 2), dtype), rows=3)
    masked = masked[masked[:, 0] != 0]  # a mask over no rows: no rows, known at once
    for v in (x, masked):
        for function, kwargs in ((np.sort, {}), (np.argsort, {"kind": "stable"})):
            got, want = function(v, axis=0, **kwargs).compute(), function(a, axis=0, **kwargs)
            assert got.dtype == want.dtype and got.shape == want.shape
        for kth in (0, 5, [1, -3]):
            got = np.partition(v, kth, axis=0).compute()
            assert got.dtype == a.dtype and got.shape == (0, 2)


def test_sorted_runs_are_not_cached(tmp_path: Path) -> None:
    a = np.random.default_rng(6).random((500, 2))
    s = tw.sort_rows(tw.from_array(a, rows=50), by=1)
    first = s.sum(axis=0).compute(cache=str(tmp_path / "store"))
    again = s.sum(axis=0).compute(cache=str(tmp_path / "store"))
    np.testing.assert_allclose(first, a.sum(axis=0))
    np.testing.assert_allclose(again, first)
    assert leftovers() == []


def test_an_unusable_spill_folder_fails_the_sort_before_it_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    tw.config.set(spill_dir=str(blocker / "spill"))
    x = tw.from_array(np.arange(100.0), rows=10)
    with pytest.raises(tw.errors.SpillError):
        np.sort(x, axis=0).to_npy(tmp_path / "s.npy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-folder"]


@pytest.mark.executors("threads", "serial")  # the step is read in this process
def test_runs_sampled_every_few_keys_split_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(external_sort, "SAMPLE_STEP", 3)
    rng = np.random.default_rng(7)
    a = rng.integers(0, 40, size=(2000, 3)).astype(np.float32)
    a[rng.random(a.shape) < 0.05] = np.nan
    x = tw.from_array(a, rows=170)
    same(np.sort(x, axis=0).compute(), np.sort(a, axis=0, kind="stable"))
    same(np.argsort(x, axis=0).compute(), np.argsort(a, axis=0, kind="stable"))
    same(tw.sort_rows(x, by=[1, 0]).compute(), a[np.lexsort((a[:, 0], a[:, 1]))])
