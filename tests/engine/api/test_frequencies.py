"""np.unique, np.bincount and tw.value_counts on lazy arrays, against NumPy.

Property tests draw odd shapes, block sizes and dtypes (bool, integers, float16 to
float64 with NaN, infinities, signed zeros and many ties), in either byte order; results
must equal NumPy's, dtypes included. The spilling path is forced by a limit of a few
hundred bytes (a tiny budget), and its partition files must be gone after a success, an
error and Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tierflow as tw
from tierflow.engine.io.memory import ArraySink
from tierflow.engine.planning.plan import Target, build_plan, describe
from tierflow.engine.rowwide import distinct, frequencies
from tierflow.errors import OutOfMemoryError
from tierflow.storage import spill

from common import examples

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint64", "float16", "float32", "float64"]  # fmt: skip
SETTINGS = settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


def elements(dt: np.dtype) -> st.SearchStrategy[Any]:
    """Few distinct values (many ties), and the float specials."""
    if dt.kind == "f":
        specials = st.sampled_from([0.0, -0.0, 1.5, -2.0, 3.0, np.nan, np.inf, -np.inf])
        return specials | specials | st.floats(-4, 4, width=dt.itemsize * 8)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return st.sampled_from([0, 1, 2, 7, int(info.max), int(info.min)]) | st.integers(0, 20)
    return st.booleans()


@st.composite
def arrays(
    draw: st.DrawFn, row_shapes: list[tuple[int, ...]], dtypes: list[str] = DTYPES
) -> np.ndarray:
    dt = np.dtype(draw(st.sampled_from(dtypes)))
    rows = draw(st.sampled_from([0, 1, 2, 5, 13, 31, 64]))
    row_shape = draw(st.sampled_from(row_shapes))
    # Every element drawn (no fill value), so NaN and ties land in several blocks; in
    # either byte order (unique's keys are the values' bits).
    a = draw(hnp.arrays(dt, (rows, *row_shape), elements=elements(dt), fill=st.nothing()))
    return a.astype(dt.newbyteorder()) if draw(st.booleans()) else a


def same(result: Any, expected: Any) -> None:
    result, expected = np.asarray(result), np.asarray(expected)
    assert result.dtype == expected.dtype, (result.dtype, expected.dtype)
    assert result.shape == expected.shape, (result.shape, expected.shape)
    np.testing.assert_array_equal(result, expected)


def flags(data: st.DataObject, inverse: bool = True) -> dict[str, bool]:
    return {
        "return_index": data.draw(st.booleans(), label="index"),
        "return_inverse": inverse and data.draw(st.booleans(), label="inverse"),
        "return_counts": data.draw(st.booleans(), label="counts"),
    }


def check_unique(a: np.ndarray, rows: int, asked: dict[str, bool], axis: int | None) -> None:
    x = tw.from_array(a, rows=rows)
    result = np.unique(x, **asked, axis=axis)
    expected = np.unique(a, **asked, axis=axis)
    if isinstance(expected, tuple):
        assert isinstance(result, tuple) and len(result) == len(expected)
        computed = tw.compute(*result, progress=False)
        for r, e in zip(computed, expected, strict=True):
            same(r, e)
    else:
        same(result.compute(progress=False), expected)


@pytest.fixture
def spills(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A limit of 256 bytes for the distinct values held in RAM (a tiny budget: every
    merge spills); yields the folders of the spilled partials made."""
    monkeypatch.setattr(frequencies, "_MIN_LIMIT", 256)
    monkeypatch.setattr(frequencies, "LIMIT_SHARE", tw.memory.budget() // 256)
    made: list[str] = []
    init = distinct.Spilled.__init__

    def recording(self: distinct.Spilled, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self.folder)

    monkeypatch.setattr(distinct.Spilled, "__init__", recording)
    yield made


def left_in_spill() -> list[str]:
    root = spill.spill_root()
    return [
        os.path.join(d, f)
        for d, _, files in os.walk(root)
        for f in [*files, ""]
        if "unique-" in os.path.join(d, f)
    ]


# -- properties -----------------------------------------------------------------------


@pytest.mark.executors("threads")
@SETTINGS
@given(a=arrays([(), (1,), (3,), (2, 3)]), data=st.data())
def test_unique_of_the_flattened_array_is_numpys(a: np.ndarray, data: st.DataObject) -> None:
    check_unique(a, data.draw(st.integers(1, 9), label="rows per block"), flags(data), None)


@pytest.mark.executors("threads")
@SETTINGS
@given(a=arrays([(1,), (2,), (3,), (2, 2)]), data=st.data())
def test_unique_rows_are_numpys(a: np.ndarray, data: st.DataObject) -> None:
    asked = flags(data, inverse=not np.isnan(a).any() if a.dtype.kind == "f" else True)
    if a.dtype.kind == "f" and np.isnan(a).any():
        # Rows holding a NaN differ from every row yet sort together; NumPy keeps them
        # in order of first occurrence only on its stable path, with return_index.
        asked["return_index"] = True
    check_unique(a, data.draw(st.integers(1, 9), label="rows per block"), asked, 0)


@pytest.mark.executors("threads")
@SETTINGS
@given(a=arrays([(), (3,)]), data=st.data())
def test_unique_spilled_to_partition_files_is_numpys(
    a: np.ndarray, data: st.DataObject, spills: list[str]
) -> None:
    axis = data.draw(st.sampled_from([None, 0]), label="axis") if a.ndim > 1 else None
    asked = flags(data, inverse=False)
    if axis == 0 and a.dtype.kind == "f":
        asked["return_index"] = True
    check_unique(a, data.draw(st.integers(1, 5), label="rows per block"), asked, axis)
    assert not left_in_spill()


@pytest.mark.executors("threads")
@SETTINGS
@given(
    a=arrays([()], ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16"]),
    data=st.data(),
)
def test_bincount_is_numpys(a: np.ndarray, data: st.DataObject) -> None:
    a = np.abs(a.astype(np.int64) % 40).astype(a.dtype) if a.dtype.kind == "i" else a
    rows = data.draw(st.integers(1, 9), label="rows per block")
    minlength = data.draw(st.sampled_from([0, 1, 5, 50]), label="minlength")
    x = tw.from_array(a, rows=rows)
    same(
        np.bincount(x, minlength=minlength).compute(progress=False),
        np.bincount(a, minlength=minlength),
    )
    w = data.draw(
        hnp.arrays(
            data.draw(st.sampled_from(["float32", "float64", "int16"])),
            len(a),
            elements=st.integers(-3, 3),
        )
    )
    result = np.bincount(x, weights=w, minlength=minlength).compute(progress=False)
    same(result, np.bincount(a, weights=w, minlength=minlength))


@pytest.mark.executors("threads")
@SETTINGS
@given(a=arrays([(), (2,)]), data=st.data())
def test_value_counts_sorts_by_count_then_value(a: np.ndarray, data: st.DataObject) -> None:
    x = tw.from_array(a, rows=data.draw(st.integers(1, 9), label="rows per block"))
    values, counts = tw.compute(*tw.value_counts(x), progress=False)
    uniq, n = np.unique(a, return_counts=True)
    order = np.lexsort((np.arange(len(n)), -n))  # count descending, then value order
    same(values, uniq[order])
    same(counts, n[order])


# -- examples ---------------------------------------------------------------------------


@pytest.fixture
def data() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(300, 4)).astype(np.float32)


def test_unique_on_every_executor_with_all_outputs(data: np.ndarray) -> None:
    a = np.round(data[:, :2] * 3).astype(np.float32)
    a[::7, 0] = np.nan
    x = tw.from_array(a, rows=9)
    result = tw.compute(
        *np.unique(x, return_index=True, return_inverse=True, return_counts=True), progress=False
    )
    expected = np.unique(a, return_index=True, return_inverse=True, return_counts=True)
    for r, e in zip(result, expected, strict=True):
        same(r, e)


def test_unique_of_a_masked_array_and_its_inverse(data: np.ndarray) -> None:
    a = np.round(data[:, 0] * 4)
    x = tw.from_array(a, rows=11)
    masked = x[x > 0]
    values, inverse, counts = np.unique(masked, return_inverse=True, return_counts=True)
    expected = np.unique(a[a > 0], return_inverse=True, return_counts=True)
    for r, e in zip(tw.compute(values, inverse, counts, progress=False), expected, strict=True):
        same(r, e)


def test_unique_of_an_in_memory_result_is_numpys() -> None:
    a = np.array([3, 1, 3, 2])
    total = tw.from_array(a).sum(keepdims=True)
    values, counts = np.unique(total + np.array([1, 1, 2]), return_counts=True)
    same(values.compute(), np.array([10, 11]))
    same(counts.compute(), np.array([2, 1]))


def test_a_length_that_depends_on_an_in_memory_results_data_is_unknown_until_computed() -> None:
    columns = tw.from_array(np.array([[1, 2, 3], [1, 5, 3]]), rows=1).sum(axis=0)  # [2, 7, 6]
    u, b = np.unique(columns), np.bincount(columns)
    assert u.shape == (None,) and b.shape == (None,) and u[1:].shape == (None,)
    assert len(u) == 3 and u.shape == (3,)  # not the length of a stand-in
    same(u[::-1].compute(), np.array([7, 6, 2]))
    same(b[::-2].compute(), np.bincount([2, 7, 6])[::-2])
    assert len(b) == 8


def test_unique_spills_and_removes_its_files_after_success(spills: list[str]) -> None:
    a = np.random.default_rng(1).integers(0, 5000, 20_000)
    x = tw.from_array(np.sort(a), rows=1000)  # sorted: the first splitters fit nothing later
    result = tw.compute(*np.unique(x, return_index=True, return_counts=True), progress=False)
    for r, e in zip(
        result, np.unique(np.sort(a), return_index=True, return_counts=True), strict=True
    ):
        same(r, e)
    assert spills, "the tiny limit made no partial spill"
    assert not any(os.path.exists(f) for f in spills)
    assert not left_in_spill()


def _failing_at(last: int, error: type[BaseException]) -> Any:
    def fn(block: np.ndarray) -> np.ndarray:
        if len(block) and block[-1] == last:
            raise error("stopped at the last block")
        return block

    return fn


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.executors("threads", "serial")
def test_spill_files_are_removed_after_an_error_or_ctrl_c(
    error: type[BaseException], spills: list[str]
) -> None:
    a = np.arange(20_000)
    x = tw.from_array(a, rows=1000).map_blocks(
        _failing_at(19_999, error), dtype=a.dtype, row_shape=()
    )
    with pytest.raises((error, tw.errors.BlockError)):  # type: ignore[arg-type]
        tw.compute(*np.unique(x, return_counts=True), progress=False)
    assert spills, "no partial spilled before the error"
    assert not any(os.path.exists(f) for f in spills)
    assert not left_in_spill()


# unique's partials are merged and cut in the driver, whatever executor ran the blocks
@pytest.mark.executors("threads")
def test_a_partition_too_big_is_cut_again_and_read_in_order(spills: list[str]) -> None:
    a = np.arange(30_000)[::-1].copy()  # descending: later keys all fall in partition 0
    x = tw.from_array(a, rows=500)
    values, counts = tw.compute(*np.unique(x, return_counts=True), progress=False)
    same(values, np.arange(30_000))
    same(counts, np.ones(30_000, np.intp))
    assert len(spills) > 1  # the big partition was cut again


def test_the_inverse_is_a_second_pass_in_the_plan() -> None:
    x = tw.from_array(np.arange(100) % 7, rows=30)
    values, inverse = np.unique(x, return_inverse=True)
    assert (values.shape, inverse.shape) == ((None,), (100,))  # known once computed
    node = inverse._node
    plan = build_plan([Target(node, ArraySink(node))], workers=2, budget=64 << 20)
    text = describe(plan, tasks=True)
    for sink in plan.sinks:
        sink.abort()
    assert text.startswith("12 tasks in 2 stage(s), 2 pass(es)")
    assert "program 0: unique (4 blocks)" in text
    assert "program 1: unique inverse (4 blocks)" in text
    same(inverse.compute(progress=False), np.unique(np.arange(100) % 7, return_inverse=True)[1])


def test_unique_counts_and_index_are_one_pass() -> None:
    x = tw.from_array(np.arange(100) % 7, rows=30)
    values, index, counts = np.unique(x, return_index=True, return_counts=True)
    plan = build_plan(
        [Target(n._node) for n in (values, index, counts)], workers=2, budget=64 << 20
    )
    assert describe(plan).startswith("8 tasks in 1 stage(s), 1 pass(es)")
    assert "program 0: unique(counts, index)" in describe(plan, tasks=True)


def test_bincount_is_one_pass_and_grows_past_minlength() -> None:
    a = np.array([0, 1, 1, 9, 3, 3, 3])
    x = tw.from_array(a, rows=2)
    counts = np.bincount(x, minlength=4)
    plan = build_plan([Target(counts._node)], workers=2, budget=64 << 20)
    assert describe(plan).startswith("5 tasks in 1 stage(s), 1 pass(es)")
    same(counts.compute(progress=False), np.bincount(a, minlength=4))
    same(np.bincount(x[x > 100]).compute(progress=False), np.bincount(a[a > 100]))


def test_bincount_weights_may_be_in_memory_or_lazy_with_other_blocks() -> None:
    a = np.arange(50) % 6
    w = np.linspace(0, 1, 50)
    x = tw.from_array(a, rows=7)
    expected = np.bincount(a, weights=w)
    # Sums of weights are added block by block: the last bits differ, as a sum's do.
    for weights in (w, tw.from_array(w, rows=11)):
        result = np.bincount(x, weights=weights).compute(progress=False)
        assert result.dtype == expected.dtype
        np.testing.assert_allclose(result, expected, rtol=1e-14)


def test_bincount_weights_of_one_mask_with_other_blocks_or_in_memory() -> None:
    a = np.array([3, 0, 1, 4, 0, 0, 2, 0, 0, 0, 0])
    w = np.linspace(0.5, 5.5, 11)
    k, weights = tw.from_array(a, rows=3), tw.from_array(w, rows=5)
    m = k > 0
    np.testing.assert_allclose(
        np.bincount(k[m], weights=weights[m]).compute(), np.bincount(a[a > 0], weights=w[a > 0])
    )
    # Four values kept, four weights in memory: they line up once counted.
    got = np.bincount(k[k > 0], weights=np.ones(4)).compute()
    same(got, np.bincount(a[a > 0], weights=np.ones(4)))
    with pytest.raises(ValueError, match="The weights and list don't have the same length"):
        np.bincount(k[k > 0], weights=np.ones(5)).compute()


def test_unique_after_a_mask_is_computed_once_for_its_length(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a = np.arange(40) % 13 - 3
    x = tw.from_array(a, rows=6)
    u = np.unique(x[x > 0])
    want = np.unique(a[a > 0])
    assert u.shape == (None,) and u[1:].shape == (None,) and u.sum().shape == ()
    with caplog.at_level(logging.DEBUG, logger="tierflow.engine"):
        same(u[::-2].compute(), want[::-2])
    plans = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan of")]
    # One pass of np.unique over x: computed for its length first (or its length was
    # known from an earlier run of the same expression), then the slice in memory.
    assert sum(len(re.findall(r"\b\d+ unique\b", p)) for p in plans) == 1, plans
    assert len(u) == len(want) and u.shape == want.shape
    same((u * 2 + u[::-1]).compute(), want * 2 + want[::-1])


def test_bincount_refuses_what_numpy_refuses() -> None:
    x = tw.from_array(np.array([0, 3, -2, 1]), rows=2)
    with pytest.raises(
        ValueError, match=r"'list' argument must have no negative elements: found -2"
    ):
        np.bincount(x).compute(progress=False)
    with pytest.raises(TypeError, match=r"Cannot cast array data from dtype\('float64'\)"):
        np.bincount(tw.from_array(np.ones(3)))
    with pytest.raises(ValueError, match="object too deep for desired array"):
        np.bincount(tw.from_array(np.ones((3, 2), int)))
    with pytest.raises(ValueError, match="The weights and list don't have the same length"):
        np.bincount(x, weights=np.ones(5))
    with pytest.raises(ValueError, match="'minlength' must not be negative"):
        np.bincount(x, minlength=-1)


def test_bincount_refuses_counts_bigger_than_the_budget_before_making_them() -> None:
    # A value near int32's maximum makes counts of 16 GB: refused with the numbers, not
    # allocated in a worker that the kernel would kill for it (a worker process has half
    # the budget).
    tw.memory.budget("64MB")
    x = tw.from_array(np.array([3, 2**31 - 2, 5], np.int32), rows=2)
    with pytest.raises(
        OutOfMemoryError,
        match=r"holds the value 2147483646, so its counts take 16\.0+ GB.*"
        r"budget of (64|32)\.0+ MB; count only the values present with np\.unique",
    ):
        np.bincount(x).compute(progress=False)
    np.testing.assert_array_equal(  # counts that fit are made as before
        np.bincount(tw.from_array(np.array([3, 1000, 5]), rows=2)).compute(),
        np.bincount([3, 1000, 5]),
    )


def test_bincount_of_a_2d_array_suggests_calls_that_work_lazily() -> None:
    a = np.array([[0, 3], [1, 1], [5, 2], [2, 2], [0, 0], [7, 1]])
    x = tw.from_array(a, rows=2)
    with pytest.raises(ValueError, match=r"object too deep for desired array") as info:
        np.bincount(x)
    message = str(info.value)
    assert "np.bincount(x[:, j])" in message
    assert "np.unique(x, return_counts=True)" in message
    assert "reshape" not in message  # x.reshape(-1) is refused on a lazy array
    # What it suggests runs, and gives NumPy's counts.
    np.testing.assert_array_equal(np.bincount(x[:, 1]).compute(), np.bincount(a[:, 1]))
    values, counts = tw.compute(*np.unique(x, return_counts=True))
    every = np.bincount(a.reshape(-1))
    np.testing.assert_array_equal(values, np.flatnonzero(every))
    np.testing.assert_array_equal(counts, every[every > 0])


def test_unique_refuses_what_it_cannot_do_lazily(tmp_path: Path) -> None:
    x = tw.from_array(np.arange(12.0).reshape(6, 2), rows=4)
    with pytest.raises(ValueError, match=r"axis=1.*use axis=0 \(unique rows\) or axis=None"):
        np.unique(x, axis=1)
    with pytest.raises(np.exceptions.AxisError):
        np.unique(x, axis=2)
    with pytest.raises(TypeError, match="equal_nan=False"):
        np.unique(x, equal_nan=False)
    nan_rows = tw.from_array(np.array([[np.nan, 1.0], [np.nan, 1.0]]), rows=1)
    with pytest.raises(ValueError, match="rows of this block hold a NaN"):
        np.unique(nan_rows, axis=0, return_inverse=True)[1].compute(progress=False)


def test_first_indices_after_a_mask_count_the_rows_first() -> None:
    a = np.random.default_rng(3).integers(0, 6, (60, 3)).astype(np.float64)
    x = tw.from_array(a, rows=7)
    kept = a[a[:, 1] > 1]
    masked = x[x[:, 1] > 1]
    for axis, got_from, want_from in ((None, masked[:, 0], kept[:, 0]), (0, masked, kept)):
        got = tw.compute(
            *np.unique(got_from, return_index=True, return_counts=True, axis=axis),
            progress=False,
        )
        want = np.unique(want_from, return_index=True, return_counts=True, axis=axis)
        for g, w in zip(got, want, strict=True):
            same(g, w)


def test_value_counts_of_rows_and_of_an_in_memory_value() -> None:
    a = np.array([[1, 2], [3, 4], [1, 2], [0, 0], [3, 4], [1, 2]])
    values, counts = tw.compute(*tw.value_counts(tw.from_array(a, rows=4), axis=0), progress=False)
    same(values, np.array([[1, 2], [0, 0], [3, 4]])[[0, 2, 1]])
    same(counts, np.array([3, 2, 1], np.intp))
    v, c = tw.value_counts(tw.from_array(np.array([2, 2, 5])).max(keepdims=True))
    same(v.compute(), np.array([5]))
    same(c.compute(), np.array([1], np.intp))


@pytest.mark.executors("serial")
def test_merged_rows_with_nan_keep_the_order_of_first_occurrence() -> None:
    # Two rows [nan, 1] sort together but differ (NaN != NaN); NumPy's stable sort keeps
    # them in row order, whichever order the engine combines the partials in.
    want = distinct.Want(counts=True, first=True, tie_order=True)
    keys_dtype = np.dtype([("f0", "f8"), ("f1", "f8")])
    late = distinct.run_of(np.array([(np.nan, 1.0)], keys_dtype), 7, want)
    early = distinct.run_of(np.array([(np.nan, 1.0), (0.0, 2.0)], keys_dtype), 0, want)
    merged = distinct.merge_runs([late, early], want)
    same(merged.first, np.array([1, 0, 7]))
    same(merged.counts, np.array([1, 1, 1]))


@pytest.mark.executors("threads")
def test_an_interrupt_while_the_spilled_result_is_assembled_leaves_no_file(
    spills: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        assert any(name.startswith("unique-result-") for name in os.listdir(spill.process_dir()))
        raise KeyboardInterrupt

    monkeypatch.setattr(frequencies.placement, "array", interrupted)
    x = tw.from_array(np.arange(5000) % 3000, rows=500)
    with pytest.raises(KeyboardInterrupt):
        np.unique(x, return_counts=True)[1].compute(progress=False)
    assert spills
    assert not left_in_spill()
