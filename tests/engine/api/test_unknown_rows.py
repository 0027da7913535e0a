"""Arrays of unknown row counts (after a boolean mask, a filter, files of varying rows)
take every operation that needs the row count: a first pass counts rows per block, then
the operation runs on known block boundaries (tierflow.engine.planning.counting). NumPy is the
oracle, errors included."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierflow as tw
from tierflow.engine.graph import block_operators
from tierflow.engine.planning import counting

from common import examples

SETTINGS = settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", value)`` or ``("error", (exception type, message))``."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            value = fn()
            if isinstance(value, tw.Array):
                value = value.compute()
            return "ok", np.asarray(value)
        except (IndexError, ValueError) as exc:
            return "error", (type(exc), str(exc))


def concat(v: Any, parts: list[Any]) -> Any:
    return (tw if isinstance(v, tw.Array) else np).concatenate(parts)


# Each case: (name, operation on the masked array, on NumPy's). The operation gets the
# masked array and the count NumPy found (for products over the rows).
CASES: dict[str, Callable[[Any, int], Any]] = {
    "[5:]": lambda v, n: v[5:],
    "[::-1]": lambda v, n: v[::-1],
    "[-3:]": lambda v, n: v[-3:],
    "[::2]": lambda v, n: v[::2],
    "[-2:1:-3]": lambda v, n: v[-2:1:-3],
    "[1:-1]": lambda v, n: v[1:-1],
    "[2]": lambda v, n: v[2],
    "[-1]": lambda v, n: v[-1],
    "[0, 1]": lambda v, n: v[0, 1],
    "[[3, 0, 7]]": lambda v, n: v[[3, 0, 7]],
    "[sorted picks]": lambda v, n: v[np.array([0, 1, 1, 4])],
    "[[-1, 0]]": lambda v, n: v[[-1, 0]],
    "argmax(0)": lambda v, n: v.argmax(axis=0),
    "argmin()": lambda v, n: v.argmin(),
    "argmax(0, keepdims)": lambda v, n: v.argmax(axis=0, keepdims=True),
    "concatenate with slices": lambda v, n: concat(v, [v, v[:3], v[::-1]]),
    "ones(n) @ x": lambda v, n: np.ones(n) @ v,
    "x[:, 0] @ ones(n)": lambda v, n: v[:, 0] @ np.arange(n, dtype=np.float64),
    "ones(n + 1) @ x": lambda v, n: np.ones(n + 1) @ v,
    "reversed + itself": lambda v, n: v[::-1] + v,
    "[1:] - [:-1]": lambda v, n: v[1:] - v[:-1],
    "[[3, 0, 7]][::-1]": lambda v, n: v[2:][::-1][1:],
    "reshape(n, 1, 3)": lambda v, n: v.reshape(n, 1, 3),
    "[::-1] + known rows": lambda v, n: v[::-1] + np.arange(3.0 * n).reshape(n, 3),
    "divmod(x, x[::-1] + 1)[1]": lambda v, n: np.divmod(v, v[::-1] + 1)[1],
    "stack with reversed": lambda v, n: (tw if isinstance(v, tw.Array) else np).stack(
        [v, v[::-1]], axis=1
    ),
    "map_blocks with reversed": lambda v, n: (
        v.map_blocks(np.add, v[::-1]) if isinstance(v, tw.Array) else v + v[::-1]
    ),
}


@st.composite
def masked(draw: st.DrawFn) -> tuple[np.ndarray, int, float]:
    rows = draw(st.sampled_from([0, 1, 7, 23, 40]))
    dtype = draw(st.sampled_from(["float64", "int32", "uint8"]))
    data = (np.arange(rows * 3).reshape(rows, 3) * 7 % 11).astype(dtype)
    block = draw(st.integers(1, 9), label="rows per block")
    # A high threshold keeps no row (all-False mask); others leave empty blocks.
    threshold = draw(st.sampled_from([-1, 3, 6, 9, 100]), label="mask: x[:, 0] >")
    return data, block, threshold


@SETTINGS
@given(case=masked(), name=st.sampled_from(sorted(CASES)))
def test_operations_after_a_mask_equal_numpy(
    case: tuple[np.ndarray, int, float], name: str
) -> None:
    a, block, threshold = case
    x = tw.from_array(a, rows=block)
    kept = a[a[:, 0] > threshold]
    op = CASES[name]
    want = outcome(lambda: op(kept, len(kept)))
    got = outcome(lambda: op(x[x[:, 0] > threshold], len(kept)))
    if want[0] == "error":
        assert got[0] == "error", got
        assert got[1][0] is want[1][0] or issubclass(got[1][0], want[1][0]), (got, want)
        return
    assert got[0] == "ok", got
    np.testing.assert_array_equal(got[1], want[1])
    assert got[1].dtype == want[1].dtype


def test_out_of_range_is_numpys_index_error_after_counting() -> None:
    a = np.arange(30.0).reshape(10, 3)
    x = tw.from_array(a, rows=3)
    picked = x[x[:, 0] > 10][50]  # built lazily: the rows are not counted yet
    with pytest.raises(IndexError, match="index 50 is out of bounds for axis 0 with size 6"):
        picked.compute()
    with pytest.raises(IndexError, match="index -7 is out of bounds for axis 0 with size 6"):
        x[x[:, 0] > 10][[0, -7]].compute()
    nothing = x[x[:, 0] > 1000]
    with pytest.raises(IndexError, match="index 0 is out of bounds for axis 0 with size 0"):
        nothing[0].compute()
    with pytest.raises(ValueError, match="attempt to get argmax of an empty sequence"):
        nothing.argmax(axis=0).compute()
    assert nothing[::-1].compute().shape == (0, 3)


def test_rows_that_differ_raise_numpys_error_after_counting() -> None:
    a = np.arange(30.0).reshape(10, 3)
    x = tw.from_array(a, rows=4)
    with pytest.raises(
        ValueError, match=r"could not be broadcast together with shapes \(6,3\) \(10,3\)"
    ):
        (x[x[:, 0] > 10] + x).compute()
    with pytest.raises(ValueError, match=r"matmul: Input operand 1 has a mismatch.*size 6 is"):
        (np.ones(5) @ x[x[:, 0] > 10]).compute()
    with pytest.raises(IndexError, match="boolean index did not match"):
        x[x[:, 0] > 10][x[:, 1] > 0].compute()


def test_masks_built_twice_from_one_expression_are_the_same_mask(tmp_path: Path) -> None:
    a = np.arange(60.0).reshape(20, 3)
    np.save(tmp_path / "x.npy", a)
    x = tw.from_npy(tmp_path / "x.npy", rows=7)
    both = x[x[:, 0] > 10] + x[x[:, 0] > 10]
    # Same key, same mask: the rows line up at once, with nothing to count.
    assert both._node.label() == "add" and both.shape == (None, 3)
    keep = a[:, 0] > 10
    np.testing.assert_array_equal(both.compute(), a[keep] + a[keep])
    y = tw.from_npy(tmp_path / "x.npy", rows=7) * 2
    np.testing.assert_array_equal((y[x[:, 0] > 10] - x[x[:, 0] > 10]).compute(), a[keep])


def test_len_and_shape_count_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = np.arange(90.0).reshape(30, 3)
    np.save(tmp_path / "x.npy", a)
    x = tw.from_npy(tmp_path / "x.npy", rows=4)
    xm = x[x[:, 1] % 2 == 0]
    assert xm.shape == (None, 3)
    with caplog.at_level(logging.DEBUG, logger="tierflow.engine"):
        n = len(xm)
        assert n == int((a[:, 1] % 2 == 0).sum())
        assert xm.shape == (n, 3) and xm.size == 3 * n
        # Counted once: the product over the rows, x[m] built again, a slice.
        np.testing.assert_array_equal((np.ones(n) @ xm).compute(), a[a[:, 1] % 2 == 0].sum(0))
        again = x[x[:, 1] % 2 == 0]
        assert again.shape == (n, 3)
        np.testing.assert_array_equal(again[::-1].compute(), a[a[:, 1] % 2 == 0][::-1])
    counts = [r for r in caplog.records if "count rows per block" in r.getMessage()]
    assert len(counts) == 1, [r.getMessage() for r in counts]


def test_len_of_files_of_no_files_makes_the_shape_known() -> None:
    # No files, so no blocks: the count is an empty tuple, and still a count.
    x = tw.from_files([], np.load, rows_per_file=None, dtype=np.float32, row_shape=(3,))
    assert x.shape == (None, 3) and x.size is None
    assert len(x) == 0
    assert x.shape == (0, 3) and x.size == 0 and x.nbytes == 0 and np.shape(x) == (0, 3)


def test_a_mask_over_no_rows_keeps_none_known_at_once() -> None:
    x = tw.from_array(np.zeros((0, 3), ">u2"), rows=1)
    mask = tw.from_array(np.zeros(0), rows=1) > 0.75
    for kept in (x[mask], x.filter(lambda b: b[:, 0] > 0), x[mask][mask[mask]]):
        assert kept.shape == (0, 3) and kept.blocks == ()
        np.testing.assert_array_equal(kept.compute(), np.zeros((0, 3), ">u2"))
    # Its row count is 0, so NumPy's answers over no rows (not the refusals of
    # functions that run along the rows only while the row count is unknown).
    np.testing.assert_array_equal(np.median(x[mask], axis=1).compute(), np.zeros(0))
    np.testing.assert_array_equal(x[mask].rechunk(5).compute(), np.zeros((0, 3)))


def test_describe_shows_the_counting_pass(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = np.arange(90.0).reshape(30, 3)
    np.save(tmp_path / "x.npy", a)
    x = tw.from_npy(tmp_path / "x.npy", rows=4)
    with caplog.at_level(logging.DEBUG, logger="tierflow.engine"):
        x[x[:, 0] > 20][::-1].sum(axis=0).compute()
    plans = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan of")]
    # The counting compute (its own plan), then the plan that says it was counted first.
    assert len(plans) == 2, plans
    assert "count rows per block (mask greater)" in plans[0]
    assert (
        plans[1].split(": ", 1)[1].startswith("pass 1: count rows per block (mask greater)\nthen ")
    ), plans[1]


def test_no_counting_pass_where_counts_are_not_needed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a = np.arange(90.0).reshape(30, 3)
    np.save(tmp_path / "x.npy", a)
    x = tw.from_npy(tmp_path / "x.npy", rows=4)
    xm = x[x[:, 0] > 20]
    with caplog.at_level(logging.DEBUG, logger="tierflow.engine"):
        np.testing.assert_array_equal(xm.compute(), a[a[:, 0] > 20])
        np.testing.assert_array_equal((xm * 2).sum(axis=0).compute(), 2 * a[a[:, 0] > 20].sum(0))
        np.testing.assert_array_equal(xm.head(2).compute(), a[a[:, 0] > 20][:2])
    messages = [r.getMessage() for r in caplog.records]
    assert messages and not any("count rows per block" in m for m in messages)
    assert xm.shape == (None, 3)  # nothing counted


def test_counting_fuses_the_mask_and_skips_the_rows() -> None:
    a = np.arange(90.0).reshape(30, 3)
    x = tw.from_array(a, rows=4)
    m = x[:, 0] > 20
    (reduce,) = [counting._count_node(x[m]._node)]  # type: ignore[arg-type]
    # The count reads the mask, not the masked rows.
    assert reduce.inputs[0] is m._node
    assert reduce.label() == "count rows per block (mask greater)"
    # A mask cut in other blocks than the array is counted on the masked rows instead.
    other = tw.from_array(a[:, 0] > 20, rows=5)
    picked = x[other]._node
    assert counting._count_node(picked).inputs[0] is picked  # type: ignore[arg-type]


def test_filters_files_and_masks_of_masks(tmp_path: Path) -> None:
    a = np.arange(120).reshape(40, 3) % 13
    x = tw.from_array(a, rows=6)
    # filter(fn): counted by the rows it keeps
    f = x.filter(lambda b: b[:, 0] % 2 == 0)
    kept = a[a[:, 0] % 2 == 0]
    np.testing.assert_array_equal(f[::-1].compute(), kept[::-1])
    # a mask of a masked array
    xm = x[x[:, 0] > 3]
    second = xm[xm[:, 1] < 9]
    want = a[a[:, 0] > 3]
    want = want[want[:, 1] < 9]
    np.testing.assert_array_equal(second[-4:].compute(), want[-4:])
    np.testing.assert_array_equal(second.argmax(axis=0).compute(), want.argmax(axis=0))
    # a mask of a slice of a masked array: counted in two rounds
    tail = a[a[:, 0] > 3][2:]
    np.testing.assert_array_equal(
        xm[2:][xm[2:][:, 1] < 9][::-1].compute(), tail[tail[:, 1] < 9][::-1]
    )
    # files of varying rows
    for i, rows in enumerate([3, 0, 5, 1]):
        np.save(tmp_path / f"f{i}.npy", np.full((rows, 2), i, np.int64))
    files = tw.from_files(
        [str(tmp_path / f"f{i}.npy") for i in range(4)], np.load, rows_per_file=None, rows=1
    )
    whole = np.concatenate([np.load(tmp_path / f"f{i}.npy") for i in range(4)])
    np.testing.assert_array_equal(files[-3:].compute(), whole[-3:])
    assert files[4].compute().tolist() == whole[4].tolist()
    assert len(files) == 9


def test_to_npy_and_persist_of_a_reversed_masked_array(tmp_path: Path) -> None:
    a = np.arange(90.0).reshape(30, 3)
    x = tw.from_array(a, rows=4)
    y = x[x[:, 0] % 4 == 0][::-1]
    y.to_npy(tmp_path / "y.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), a[a[:, 0] % 4 == 0][::-1])
    kept = y.persist()
    assert kept.shape == (len(a[a[:, 0] % 4 == 0]), 3)
    np.testing.assert_array_equal(kept[1].compute(), a[a[:, 0] % 4 == 0][::-1][1])


@pytest.mark.executors("processes")
def test_counted_rows_run_in_worker_processes(tmp_path: Path) -> None:
    a = np.arange(300.0).reshape(100, 3)
    np.save(tmp_path / "x.npy", a)
    x = tw.from_npy(tmp_path / "x.npy", rows=9)
    keep = a[:, 0] % 7 < 3
    got = x[x[:, 0] % 7 < 3][::-2].compute(executor="processes", workers=2)
    np.testing.assert_array_equal(got, a[keep][::-2])


def test_count_partials_add_up_over_pieces_of_blocks() -> None:
    # Known blocks: each piece's count goes to the block holding its first row.
    by_rows = counting.CountRows("nonzero", (0, 4, 8, 10), 3)
    parts = [
        by_rows.chunk(np.array([1, 0, 1, 1]), row_offset=4),
        by_rows.chunk(np.ones(2), row_offset=8),
    ]
    parts.append(by_rows.chunk(np.array([True, False]), row_offset=0))
    parts.append(by_rows.chunk(np.array([True, True]), row_offset=2))
    total = None
    for p in parts:
        total = by_rows.combine(total, p)
    assert by_rows.aggregate(total).tolist() == [3, 3, 2]
    # Blocks by index, merged in order: a piece at row 0 starts the next block.
    by_index = counting.CountRows("rows", None, 3)
    pieces = [(0, 2), (2, 3), (0, 0), (0, 1)]
    merged = by_index.combine(by_index.combine([pieces[0]], [pieces[1]]), pieces[2:])
    assert by_index.aggregate(merged).tolist() == [5, 0, 1]
    assert by_index.aggregate(None).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "op",
    [
        counting.CountRows("rows", None, 2),
        block_operators.Head(3, np.dtype(float), ()),
        block_operators.Collect(np.dtype(float), (), None),
    ],
    ids=repr,
)
def test_the_engines_reductions_pass_a_partial_through_a_block_without_rows(op: Any) -> None:
    partial = op.chunk(np.arange(2.0), row_offset=0)
    assert op.combine(None, partial) is partial
    assert op.combine(partial, None) is partial
    assert op.combine(None, None) is None
    merged = op.combine(partial, op.chunk(np.arange(2.0, 4.0), row_offset=2))
    assert len(merged) == (3 if isinstance(op, block_operators.Head) else 2)


def test_to_dask_needs_the_counts_and_computes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("dask.array")
    a = np.arange(60.0).reshape(20, 3) % 7
    np.save(tmp_path / "x.npy", a)  # a new file: its masks were never counted
    x = tw.from_npy(tmp_path / "x.npy", rows=3)
    y = x[x[:, 0] > 2][::-1]
    with pytest.raises(ValueError, match=r"call len\(\) on the array first"):
        y.to_dask()
    assert len(y) == int((a[:, 0] > 2).sum())
    np.testing.assert_array_equal(y.to_dask().compute(scheduler="sync"), a[a[:, 0] > 2][::-1])


def test_a_counted_block_projects_the_whole_blocks_it_is_cut_from() -> None:
    from tierflow.engine.planning.plan import Target, build_plan

    a = np.arange(3000.0).reshape(1000, 3)
    x = tw.from_array(a, rows=100)
    few = x[x[:, 0] > 2900]  # 33 rows, all from the last block of 100
    assert len(few) == 33

    def no_count(reductions: list[Any]) -> list[Any]:
        raise AssertionError("counted already")

    (built,), _ = counting.resolve([few[::-1].sum(axis=0)._node], no_count)
    plan = build_plan([Target(built)], workers=2, budget=1 << 30)
    (block,) = [t for t in plan.tasks if t.block]
    assert block.rows == 33
    # The filter computes its whole input block (100 rows of 3 float64) before the mask:
    # the counted step projects what that takes beyond 33 rows.
    (counted,) = [s for s in plan.programs[0].steps() if type(s).__name__ == "CountedStep"]
    assert counted.memory(33, False).temps >= (100 - 33) * 3 * 8
    assert block.memory.total >= counted.memory(33, False).total


def test_an_in_memory_operand_written_first_combines_with_masked_rows() -> None:
    a = np.arange(12.0).reshape(6, 2)
    x = tw.from_array(a, rows=4)
    kept = a[:, 0] > 3
    m = tw.from_array(kept, rows=4)
    row = np.array([1.0, -2.0])
    np.testing.assert_array_equal((row + x[m]).compute(), row + a[kept])
    np.testing.assert_array_equal(np.arctan2(row, x[m]).compute(), np.arctan2(row, a[kept]))


# -- results of a sort, a top k, np.unique, np.bincount or head after a mask ----------------
#
# Each is a lazy array like any other: every operation that needs its row count (or, for
# a value whose length depends on the data, its length) works on it as on an array of
# known length, NumPy's answer.

VALUES = np.array([4, -1, 7, 7, 0, 2, -3, 9, 2, 2, 5, -8, 1, 6, 6, -2, 3, 8, 0, 5, 1, 4, 7])
TABLE = np.stack([VALUES, VALUES[::-1] * 10], axis=1)


def _descending_first(a: np.ndarray, k: int) -> np.ndarray:
    return -np.sort(-a, axis=0, kind="stable")[:k]


# name: (the result on the lazy array, on NumPy's; each gets its array with the mask applied)
SORTED_AFTER_A_MASK: dict[str, tuple[Callable[[Any], Any], Callable[[np.ndarray], Any]]] = {
    "sort": (np.sort, lambda a: np.sort(a, kind="stable")),
    "argsort": (np.argsort, lambda a: np.argsort(a, kind="stable")),
    "sort_rows": (
        lambda x: tw.sort_rows(x, by=1, descending=True),
        lambda a: a[np.argsort(-a[:, 1], kind="stable")],
    ),
    "sort axis 0": (lambda x: np.sort(x, axis=0), lambda a: np.sort(a, axis=0, kind="stable")),
    "topk": (lambda x: tw.topk(x, 4), lambda a: _descending_first(a, 4)),
    "unique": (np.unique, np.unique),
    "bincount": (np.bincount, np.bincount),
    "head": (lambda x: x.head(6), lambda a: a[:6]),
}
# What each is made from: the 1-D values or the 2-D table.
TWO_D = {"sort_rows", "sort axis 0", "topk"}

FOLLOW_UPS: dict[str, Callable[[Any], Any]] = {
    "[1:]": lambda r: r[1:],
    "[::2]": lambda r: r[::2],
    "[::-1]": lambda r: r[::-1],
    "[-3:]": lambda r: r[-3:],
    "[-2:0:-2]": lambda r: r[-2:0:-2],
    "[:2]": lambda r: r[:2],
    "[-1]": lambda r: r[-1],
    "len": len,
    "[[2, 0, 1]]": lambda r: r[[2, 0, 1]],
    "[[0, 1, 1]]": lambda r: r[np.array([0, 1, 1])],
    "* 2": lambda r: r * 2,
    "+ itself reversed": lambda r: r + r[::-1],
    "[1:] - [:-1]": lambda r: r[1:] - r[:-1],
    "sum(0)": lambda r: r.sum(axis=0),
    "max()": lambda r: r.max(),
    "[::-1][1:][::2]": lambda r: r[::-1][1:][::2],
    "+ arange(len)": lambda r: r + np.arange(len(r)).reshape(-1, *[1] * (r.ndim - 1)),
    "[> 2]": lambda r: r[r > 2],
    "argmax(0)": lambda r: r.argmax(axis=0),
    "divmod(r, 3)[1]": lambda r: np.divmod(r, 3)[1],
    "concatenate with [:2]": lambda r: (tw if isinstance(r, tw.Array) else np).concatenate(
        [r, r[:2]]
    ),
}


@pytest.mark.executors("threads", "processes")
@pytest.mark.parametrize("follow_up", sorted(FOLLOW_UPS))
@pytest.mark.parametrize("made_by", sorted(SORTED_AFTER_A_MASK))
def test_a_result_after_a_mask_takes_any_operation_as_numpy(made_by: str, follow_up: str) -> None:
    lazy_fn, numpy_fn = SORTED_AFTER_A_MASK[made_by]
    a = TABLE if made_by in TWO_D else VALUES
    x = tw.from_array(a, rows=4)
    key = x[:, 0] if a.ndim == 2 else x
    # Keeps 15 of 23 rows; the block of rows 8-11 keeps one, and a mask cut as x is.
    masked = x[key > 0]
    op = FOLLOW_UPS[follow_up]
    want = np.asarray(op(numpy_fn(a[(a[:, 0] if a.ndim == 2 else a) > 0])))
    got = op(lazy_fn(masked))
    if isinstance(got, tw.Array):  # a length not known yet is None, never a wrong number
        assert len(got.shape) == want.ndim, (got.shape, want.shape)
        assert all(g in (None, w) for g, w in zip(got.shape, want.shape, strict=True))
        got = got.compute()
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    np.testing.assert_array_equal(got, want)


@pytest.mark.executors("threads", "processes")
@pytest.mark.parametrize("made_by", sorted(SORTED_AFTER_A_MASK))
def test_a_result_after_a_mask_is_written_whole_by_to_npy(made_by: str, tmp_path: Path) -> None:
    lazy_fn, numpy_fn = SORTED_AFTER_A_MASK[made_by]
    a = TABLE if made_by in TWO_D else VALUES
    x = tw.from_array(a, rows=4)
    key = x[:, 0] if a.ndim == 2 else x
    result = lazy_fn(x[key > 0])
    result.to_npy(tmp_path / "r.npy")
    result[::-1].to_npy(tmp_path / "reversed.npy")
    want = numpy_fn(a[(a[:, 0] if a.ndim == 2 else a) > 0])
    np.testing.assert_array_equal(np.load(tmp_path / "r.npy"), want)
    np.testing.assert_array_equal(np.load(tmp_path / "reversed.npy"), want[::-1])
