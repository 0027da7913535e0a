"""NumPy's argument checks, function by function of the function table: a bad ``axis``,
``kth``, ``q``, ``bins``, ``minlength``, ``ddof``, ``decimals``... raises NumPy's error
type with NumPy's message, when the pipeline is built where the shape is known, and at
the compute where it depends on a row count that a mask made unknown."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.api.dispatch import FUNCTIONS

A = np.arange(24.0).reshape(8, 3) % 7
COUNTS = A[:, 0].astype(np.int64)


class Case(NamedTuple):
    """``call`` of ``data`` is refused by NumPy. ``depends``: what NumPy's check reads
    besides the arguments: ``"shape"`` (known when built), ``"rows"`` (the row count,
    unknown after a mask until computed, or named in NumPy's message) or ``"values"``
    (the data: checked when computed)."""

    function: Any
    call: Callable[[Any], Any]
    data: np.ndarray = A
    depends: str = "shape"


CASES: dict[str, Case] = {
    "sum axis out of range": Case(np.sum, lambda x: np.sum(x, axis=2)),
    "sum axis not an integer": Case(np.sum, lambda x: np.sum(x, axis=1.0)),
    "sum axis twice": Case(np.sum, lambda x: np.sum(x, axis=(0, -2))),
    "sum dtype unknown": Case(np.sum, lambda x: np.sum(x, dtype="foo")),
    "prod axis": Case(np.prod, lambda x: np.prod(x, axis=-3)),
    "mean axis": Case(np.mean, lambda x: np.mean(x, axis=(1, 2))),
    "std ddof not a number": Case(np.std, lambda x: np.std(x, axis=0, ddof="a")),
    "var ddof not a number": Case(np.var, lambda x: np.var(x, axis=0, ddof=None)),
    "min axis": Case(np.min, lambda x: np.min(x, axis=5)),
    "max initial out of range": Case(
        np.max, lambda x: np.max(x, initial=300), COUNTS.astype(np.int8)
    ),
    "amin axis": Case(np.amin, lambda x: np.amin(x, axis=2)),
    "amax axis": Case(np.amax, lambda x: np.amax(x, axis=-3)),
    "any axis": Case(np.any, lambda x: np.any(x, axis=4)),
    "all axis": Case(np.all, lambda x: np.all(x, axis=(0, 0))),
    "argmin axis tuple": Case(np.argmin, lambda x: np.argmin(x, axis=(0, 1))),
    "argmax axis": Case(np.argmax, lambda x: np.argmax(x, axis=2)),
    "count_nonzero axis": Case(np.count_nonzero, lambda x: np.count_nonzero(x, axis=3)),
    "histogram bins negative": Case(
        np.histogram, lambda x: np.histogram(x, bins=-1, range=(0, 7)), A[:, 0]
    ),
    "histogram bins zero": Case(
        np.histogram, lambda x: np.histogram(x, bins=0, range=(0, 7)), A[:, 0]
    ),
    "histogram bins not an integer": Case(
        np.histogram, lambda x: np.histogram(x, bins=2.5, range=(0, 7)), A[:, 0]
    ),
    "histogram edges decreasing": Case(
        np.histogram, lambda x: np.histogram(x, bins=[3, 1, 2]), A[:, 0]
    ),
    "histogram range reversed": Case(
        np.histogram, lambda x: np.histogram(x, bins=3, range=(7, 0)), A[:, 0]
    ),
    "histogram range not finite": Case(
        np.histogram, lambda x: np.histogram(x, bins=3, range=(0, np.inf)), A[:, 0]
    ),
    "concatenate axis": Case(np.concatenate, lambda x: np.concatenate([x, x], axis=2)),
    "concatenate dimensions": Case(np.concatenate, lambda x: np.concatenate([x, x[:, 0]])),
    "clip min and max not numbers": Case(np.clip, lambda x: np.clip(x, "a", 3)),
    "round decimals not an integer": Case(np.round, lambda x: np.round(x, 1.5)),
    "around decimals not an integer": Case(np.around, lambda x: np.around(x, "a")),
    "where shapes": Case(np.where, lambda x: np.where(x > 1, x, np.ones(4)), depends="rows"),
    "dot shapes": Case(np.dot, lambda x: np.dot(x, np.ones(4)), depends="rows"),
    "dot rows": Case(np.dot, lambda x: np.dot(np.ones(5), x), depends="rows"),
    "stack axis": Case(np.stack, lambda x: np.stack([x, x], axis=3)),
    "reshape size": Case(np.reshape, lambda x: np.reshape(x, (5, -1)), depends="rows"),
    "reshape two unknown dimensions": Case(np.reshape, lambda x: np.reshape(x, (-1, -1))),
    "nansum axis": Case(np.nansum, lambda x: np.nansum(x, axis=2)),
    "sort axis": Case(np.sort, lambda x: np.sort(x, axis=2)),
    "sort kind along the rows": Case(np.sort, lambda x: np.sort(x, axis=0, kind="foo")),
    "sort kind along a row": Case(np.sort, lambda x: np.sort(x, axis=1, kind="foo")),
    "argsort axis": Case(np.argsort, lambda x: np.argsort(x, axis=-3)),
    "argsort kind": Case(np.argsort, lambda x: np.argsort(x, axis=0, kind="bar")),
    "cumsum axis": Case(np.cumsum, lambda x: np.cumsum(x, axis=2)),
    "cumprod axis": Case(np.cumprod, lambda x: np.cumprod(x, axis=5)),
    "nancumsum axis": Case(np.nancumsum, lambda x: np.nancumsum(x, axis=2)),
    "nancumprod axis": Case(np.nancumprod, lambda x: np.nancumprod(x, axis=2)),
    "diff order negative": Case(np.diff, lambda x: np.diff(x, n=-1, axis=1)),
    "diff axis": Case(np.diff, lambda x: np.diff(x, axis=2)),
    "size axis": Case(np.size, lambda x: np.size(x, 5)),
    "result_type of no dtype": Case(np.result_type, lambda x: np.result_type(x, "bogus")),
    "pad widths negative": Case(np.pad, lambda x: np.pad(x, -1)),
    "moveaxis source out of range": Case(np.moveaxis, lambda x: np.moveaxis(x, 5, 0)),
    "pad mode unknown": Case(np.pad, lambda x: np.pad(x, 1, mode="bogus")),
    "flip axis out of range": Case(np.flip, lambda x: np.flip(x, 7)),
    "flip axis twice": Case(np.flip, lambda x: np.flip(x, (0, 0))),
    "flipud of a 0-d array": Case(np.flipud, lambda x: np.flipud(x.sum())),
    "sliding_window_view window negative": Case(
        np.lib.stride_tricks.sliding_window_view,
        lambda x: np.lib.stride_tricks.sliding_window_view(x, -1, axis=1),
    ),
    "astype dtype unknown": Case(getattr(np, "astype", None), lambda x: np.astype(x, "foo")),
    "quantile q above one": Case(np.quantile, lambda x: np.quantile(x, 1.5, axis=0)),
    "quantile method unknown": Case(
        np.quantile, lambda x: np.quantile(x, 0.5, axis=0, method="foo")
    ),
    "quantile axis": Case(np.quantile, lambda x: np.quantile(x, 0.5, axis=2)),
    "percentile q above 100": Case(np.percentile, lambda x: np.percentile(x, 101, axis=0)),
    "percentile q negative": Case(np.percentile, lambda x: np.percentile(x, [-1, 50])),
    "nanquantile q": Case(np.nanquantile, lambda x: np.nanquantile(x, 2, axis=0)),
    "nanpercentile q not a number": Case(
        np.nanpercentile, lambda x: np.nanpercentile(x, np.nan, axis=0)
    ),
    "median axis": Case(np.median, lambda x: np.median(x, axis=2)),
    "nanmedian axis": Case(np.nanmedian, lambda x: np.nanmedian(x, axis=-3)),
    "unique axis": Case(np.unique, lambda x: np.unique(x, axis=2)),
    "bincount negative values": Case(np.bincount, lambda x: np.bincount(x - 3), COUNTS, "values"),
    "bincount minlength negative": Case(
        np.bincount, lambda x: np.bincount(x, minlength=-1), COUNTS
    ),
    "bincount minlength not an integer": Case(
        np.bincount, lambda x: np.bincount(x, minlength=1.5), COUNTS
    ),
    "bincount floats": Case(np.bincount, np.bincount, A[:, 0]),
    "bincount weights of other rows": Case(
        np.bincount, lambda x: np.bincount(x, weights=np.ones(3)), COUNTS, "rows"
    ),
    "bincount two dimensions": Case(np.bincount, np.bincount, A.astype(np.int64)),
    "transpose axes repeated": Case(np.transpose, lambda x: np.transpose(x, (0, 0))),
    "transpose axes out of range": Case(np.transpose, lambda x: np.transpose(x, (0, 2))),
    "cov ddof not an integer": Case(np.cov, lambda x: np.cov(x, rowvar=False, ddof=1.5)),
    "cov three dimensions": Case(np.cov, lambda x: np.cov(x.reshape(8, 3, 1))),
    "corrcoef three dimensions": Case(np.corrcoef, lambda x: np.corrcoef(x.reshape(8, 3, 1))),
    "norm ord for vectors": Case(np.linalg.norm, lambda x: np.linalg.norm(x, ord="foo", axis=0)),
    "norm ord for matrices": Case(np.linalg.norm, lambda x: np.linalg.norm(x, ord=3)),
    "norm axis": Case(np.linalg.norm, lambda x: np.linalg.norm(x, axis=2)),
    "norm axes repeated": Case(np.linalg.norm, lambda x: np.linalg.norm(x, axis=(0, 0))),
    "einsum subscripts": Case(np.einsum, lambda x: np.einsum("ij->k", x)),
    "einsum dimensions": Case(np.einsum, lambda x: np.einsum("ijk->j", x)),
    "vstack columns": Case(np.vstack, lambda x: np.vstack([x, np.ones((2, 4))])),
    "hstack dimensions": Case(np.hstack, lambda x: np.hstack([x, np.ones(8)])),
    "column_stack rows": Case(
        np.column_stack, lambda x: np.column_stack([x, np.ones(3)]), depends="rows"
    ),
    "nanmin axis": Case(np.nanmin, lambda x: np.nanmin(x, axis=2)),
    "nanmax axis": Case(np.nanmax, lambda x: np.nanmax(x, axis=(0, 0))),
    "nanargmin axis": Case(np.nanargmin, lambda x: np.nanargmin(x, axis=2)),
    "nanargmax axis": Case(np.nanargmax, lambda x: np.nanargmax(x, axis=-3)),
    "nanprod axis": Case(np.nanprod, lambda x: np.nanprod(x, axis=2)),
    "nanmean axis": Case(np.nanmean, lambda x: np.nanmean(x, axis=2)),
    "nanvar ddof not a number": Case(np.nanvar, lambda x: np.nanvar(x, axis=0, ddof="a")),
    "nanstd axis": Case(np.nanstd, lambda x: np.nanstd(x, axis=2)),
    "partition kth out of bounds": Case(
        np.partition, lambda x: np.partition(x, 8), A[:, 0], "rows"
    ),
    "partition kth negative": Case(np.partition, lambda x: np.partition(x, -9), A[:, 0], "rows"),
    "partition one kth of several": Case(
        np.partition, lambda x: np.partition(x, [1, 9]), A[:, 0], "rows"
    ),
    "partition kth along a row": Case(
        np.partition, lambda x: np.partition(x, 3, axis=1), depends="rows"
    ),
    "partition kth not an integer": Case(np.partition, lambda x: np.partition(x, 1.0), A[:, 0]),
    "partition kind": Case(np.partition, lambda x: np.partition(x, 1, kind="foo"), A[:, 0]),
    "partition axis": Case(np.partition, lambda x: np.partition(x, 1, axis=2)),
}
# Functions of the table with no argument NumPy checks.
UNCHECKED = {np.shape, np.ndim}


def _masked(a: np.ndarray) -> tw.Array:
    """``a`` behind a mask that keeps every row: the same values, rows unknown."""
    x = tw.from_array(a, rows=3)
    return x[tw.from_array(np.ones(len(a), bool), rows=3)]


def _numpy_error(case: Case) -> Exception:
    try:
        case.call(case.data)
    except Exception as exc:
        return exc
    raise AssertionError("NumPy accepts this call: the case checks nothing")


def _lazy_error(case: Case, x: tw.Array) -> tuple[str, Exception | None]:
    """Where the call on ``x`` failed (``"build"`` or ``"compute"``) and how."""
    try:
        result = case.call(x)
    except Exception as exc:
        return "build", exc
    try:
        parts = result if isinstance(result, tuple) else (result,)
        tw.compute(*[p for p in parts if isinstance(p, tw.Array)])
    except Exception as exc:
        return "compute", exc
    return "compute", None


def _assert_numpys(error: Exception | None, want: Exception, message: bool = True) -> None:
    assert error is not None, f"NumPy raises {want!r}; tierflow accepted it"
    assert isinstance(error, type(want)), f"{error!r} is not NumPy's {want!r}"
    if message:  # NumPy's message, maybe followed by what tierflow adds
        assert str(error).startswith(str(want).rstrip(".")), f"{error} is not NumPy's {want}"


def test_every_function_of_the_table_has_its_argument_checks_here() -> None:
    checked = {case.function for case in CASES.values()}
    missing = [getattr(f, "__name__", f) for f in FUNCTIONS if f not in checked | UNCHECKED]
    assert not missing


@pytest.mark.executors("threads")
@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_argument_raises_numpys_error_when_the_shape_is_known(name: str) -> None:
    case = CASES[name]
    if case.function is None:
        pytest.skip("not in this NumPy")
    want = _numpy_error(case)
    when, error = _lazy_error(case, tw.from_array(case.data, rows=3))
    _assert_numpys(error, want)
    assert when == ("compute" if case.depends == "values" else "build")


@pytest.mark.executors("threads")
@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_argument_raises_numpys_error_after_a_mask(name: str) -> None:
    """Checks that need no row count are made when the pipeline is built; those that
    need one when the rows are counted (NumPy's message then, or where NumPy's would
    name a row count tierflow does not know yet, NumPy's error type)."""
    case = CASES[name]
    if case.function is None:
        pytest.skip("not in this NumPy")
    want = _numpy_error(case)
    when, error = _lazy_error(case, _masked(case.data))
    _assert_numpys(error, want, message=case.depends != "rows")
    if case.depends == "shape":
        assert when == "build"


# -- the examples of the issue ------------------------------------------------------------


def test_partition_after_a_mask_checks_kth_when_computed() -> None:
    v = tw.from_array(np.arange(6.0), rows=2)
    kept = np.partition(v[v > 1], 5)  # 4 rows are kept
    with pytest.raises(ValueError, match=r"^kth\(=5\) out of bounds \(4\)"):
        kept.compute()
    np.testing.assert_array_equal(np.partition(v[v > 1], 3).compute(), [2.0, 3.0, 4.0, 5.0])


def test_partition_along_a_row_after_a_mask_raises_only_when_there_are_rows() -> None:
    a = np.arange(24.0).reshape(8, 3)
    x = tw.from_array(a, rows=3)
    with pytest.raises(ValueError, match=r"kth\(=5\) out of bounds \(3\)"):
        np.partition(x[x[:, 0] > 1], 5, axis=1).compute()
    assert np.partition(x[x[:, 0] > 100], 5, axis=1).compute().shape == (0, 3)


def test_reshape_with_two_unknown_dimensions_is_refused_not_answered() -> None:
    x = tw.from_array(A, rows=3)
    with pytest.raises(ValueError, match="can only specify one unknown dimension"):
        x.reshape(-1, -1)


def test_clip_without_bounds_is_numpys_answer() -> None:
    x = tw.from_array(A, rows=3)
    np.testing.assert_array_equal(np.clip(x, None, None).compute(), np.clip(A, None, None))
