"""Property tests: random arrays, blocks and operator chains against NumPy as the oracle.

Shapes include 0 and 1 rows, block sizes that do not divide the rows, every dtype from
bool to float64. Elementwise and selection results are identical to NumPy's (values and
dtype); integer reductions are exact; float reductions, which tierflow accumulates in
float64, match NumPy's float64 result cast to NumPy's dtype within tight tolerances.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tierflow as tw

from common import examples

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"]
SETTINGS = settings(
    max_examples=examples(120),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def arrays(draw: st.DrawFn, dtype: str | None = None) -> np.ndarray:
    dt = np.dtype(dtype or draw(st.sampled_from(DTYPES)))
    rows = draw(st.sampled_from([0, 1, 2, 5, 13, 31]))
    row_shape = draw(st.sampled_from([(), (1,), (3,), (2, 3)]))
    if dt.kind == "f":
        elements = st.floats(
            -100, 100, width=dt.itemsize * 8, allow_nan=False, allow_infinity=False
        ) | st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0])
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        elements = st.integers(int(info.min), int(info.max))
    else:
        elements = st.booleans()
    return draw(hnp.arrays(dt, (rows, *row_shape), elements=elements))


def lazy(a: np.ndarray, data: st.DataObject) -> tw.Array:
    block = data.draw(st.integers(1, 7), label="rows per block")
    return tw.from_array(a, rows=block)


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", value)`` or ``("error", exception type)``, warnings silenced."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            return "ok", fn()
        except (TypeError, ValueError, OverflowError, IndexError, ZeroDivisionError) as exc:
            return "error", type(exc)


def same(result: Any, expected: Any) -> None:
    result = np.asarray(result)
    expected = np.asarray(expected)
    assert result.dtype == expected.dtype, (result.dtype, expected.dtype)
    assert result.shape == expected.shape, (result.shape, expected.shape)
    np.testing.assert_array_equal(result, expected)


UNARY = [
    np.negative, np.absolute, np.sqrt, np.square, np.sign, np.isnan, np.logical_not,
    np.exp, np.floor, np.invert, np.reciprocal, np.log1p,
]  # fmt: skip
BINARY = [
    np.add, np.subtract, np.multiply, np.true_divide, np.floor_divide, np.remainder,
    np.power, np.maximum, np.minimum, np.less, np.greater_equal, np.equal,
    np.bitwise_and, np.logical_or, np.arctan2,
]  # fmt: skip
# NumPy's scalar and SIMD loops of these order -0.0 and 0.0 differently, so the sign of a
# zero they return depends on the length NumPy sees, and a block is shorter than the array.
SIGNED_ZERO_ORDER = {np.maximum, np.minimum, np.fmax, np.fmin}


def scalar(data: st.DataObject) -> Any:
    return data.draw(
        st.sampled_from([0, 1, 2, -1, 3, 300, 2.5, -0.5, True, np.float32(1.5), np.int8(3),
                         np.uint16(7), np.float64(-2.0)]),
        label="scalar",
    )  # fmt: skip


def binary(f: Any, build: Callable[[], Any], oracle: Callable[[], Any]) -> tuple[Any, Any]:
    """``build`` and ``oracle`` of the ufunc ``f``, with every zero made +0.0 on both sides
    where ``f`` leaves the sign of a zero to NumPy's loop: a later reciprocal or arctan2
    would turn that sign into a different value."""
    if f not in SIGNED_ZERO_ORDER:
        return build, oracle

    def lazy_positive() -> Any:
        r = build()
        return tw.where(r, r, np.absolute(r))

    def numpy_positive() -> Any:
        r = oracle()
        return np.where(r, r, np.absolute(r))

    return lazy_positive, numpy_positive


def step(x: tw.Array, a: np.ndarray, data: st.DataObject) -> tuple[Any, Any]:
    """One random operation applied to the lazy array and to its NumPy twin."""
    kind = data.draw(
        st.sampled_from(["unary", "scalar", "rscalar", "row", "self", "astype", "round",
                         "clip", "where", "operator"]),
        label="operation",
    )  # fmt: skip
    if kind == "unary":
        f = data.draw(st.sampled_from(UNARY), label="ufunc")
        return (lambda: f(x)), (lambda: f(a))
    if kind in ("scalar", "rscalar"):
        f = data.draw(st.sampled_from(BINARY), label="ufunc")
        s = scalar(data)
        if kind == "scalar":
            return binary(f, lambda: f(x, s), lambda: f(a, s))
        return binary(f, lambda: f(s, x), lambda: f(s, a))
    if kind == "row":
        f = data.draw(st.sampled_from(BINARY), label="ufunc")
        row = (
            np.arange(1, 1 + int(np.prod(a.shape[1:])))
            .reshape(a.shape[1:])
            .astype(data.draw(st.sampled_from(DTYPES), label="row dtype"))
        )
        return binary(f, lambda: f(x, row), lambda: f(a, row))
    if kind == "self":
        f = data.draw(st.sampled_from(BINARY), label="ufunc")
        return binary(f, lambda: f(x, x + 1), lambda: f(a, a + 1))
    if kind == "astype":
        dt = data.draw(st.sampled_from(DTYPES), label="dtype")
        return (lambda: x.astype(dt)), (lambda: a.astype(dt))
    if kind == "round":
        d = data.draw(st.integers(-1, 2), label="decimals")
        return (lambda: x.round(d)), (lambda: np.round(a, d))
    if kind == "clip":
        lo, hi = data.draw(st.sampled_from([(0, 5), (-1.5, None), (None, 2), (3, 1)]))
        return (lambda: np.clip(x, lo, hi)), (lambda: np.clip(a, lo, hi))
    if kind == "where":
        return (lambda: tw.where(x > 0, x, 0)), (lambda: np.where(a > 0, a, 0))
    op = data.draw(st.sampled_from(["-", "~", "abs", "%", "**", "//", "<<", "&"]))
    table: dict[str, tuple[Any, Any]] = {
        "-": (lambda: -x, lambda: -a),
        "~": (lambda: ~x, lambda: ~a),
        "abs": (lambda: abs(x), lambda: abs(a)),
        "%": (lambda: x % 3, lambda: a % 3),
        "**": (lambda: x**2, lambda: a**2),
        "//": (lambda: 7 // x, lambda: 7 // a),
        "<<": (lambda: x << 1, lambda: a << 1),
        "&": (lambda: x & x, lambda: a & a),
    }
    return table[op]


@SETTINGS
@pytest.mark.executors("threads", "serial", "processes", "dask", "ray")
@given(a=arrays(), data=st.data())
def test_random_elementwise_chains_equal_numpy(a: np.ndarray, data: st.DataObject) -> None:
    x = lazy(a, data)
    expected: Any = a
    for _ in range(data.draw(st.integers(1, 4), label="length")):
        build, oracle = step(x, expected, data)
        want = outcome(oracle)
        got = outcome(build)
        if want[0] == "error":
            # NumPy refuses (a bad dtype, a Python int out of range): so must tierflow,
            # when the pipeline is built or at the latest when it runs.
            if got[0] == "ok":
                got = outcome(lambda v=got[1]: v.compute())
            assert got == want
            return
        assert got[0] == "ok", got
        x, expected = got[1], want[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = x.compute()
    same(result, expected)


def _rows_slice(data: st.DataObject) -> slice:
    start = data.draw(st.sampled_from([None, 0, 1, 3, -2, 40]))
    stop = data.draw(st.sampled_from([None, 0, 2, 5, -1, 100]))
    stepn = data.draw(st.sampled_from([None, 1, 2, 3, -1, -2]))
    return slice(start, stop, stepn)


def _take(x: tw.Array, expected: np.ndarray, data: st.DataObject) -> tuple[tw.Array, Any]:
    """Rows picked by position (after a mask too: its rows are counted first)."""
    n = expected.shape[0]
    picks = st.integers(-n, n - 1) if n else st.nothing()
    idx = data.draw(st.lists(picks, max_size=12 if n else 0), label="rows picked")
    if data.draw(st.booleans(), label="sorted"):
        idx = sorted(idx, key=lambda i: i % n)
    return x[idx], expected[idx]


def _mask(x: tw.Array, expected: np.ndarray) -> tuple[tw.Array, Any]:
    """The rows whose first value is above the lowest (unchanged without values)."""
    width = int(np.prod(expected.shape[1:]))
    if width == 0:
        return x, expected
    flat = expected.reshape(expected.shape[0], width)
    low = flat[:, 0].min(initial=0)
    with np.errstate(all="ignore"):
        keep = flat[:, 0] > low
    lazy_keep = x.reshape(-1, width)[:, 0] > low
    return x[lazy_keep], expected[keep]


@SETTINGS
@pytest.mark.executors("threads", "serial", "processes", "dask", "ray")
@given(a=arrays(), data=st.data())
def test_random_selections_equal_numpy(a: np.ndarray, data: st.DataObject) -> None:
    x = lazy(a, data)
    expected = a
    for _ in range(data.draw(st.integers(1, 3), label="length")):
        kinds = ["slice", "mask", "column", "concat", "head", "filter", "take"]
        kind = data.draw(st.sampled_from(kinds))
        if kind == "take":
            x, expected = _take(x, expected, data)
            if x._node.kind == "value":
                break  # rows picked out of order come back in memory
        elif kind == "slice":
            key = _rows_slice(data)
            x, expected = x[key], expected[key]
        elif kind == "mask":
            x, expected = _mask(x, expected)
        elif kind == "column" and expected.ndim > 1:
            col = data.draw(st.integers(0, expected.shape[1] - 1))
            key2: Any = data.draw(st.sampled_from([col, [col, 0], slice(None, None, -1)]))
            x, expected = x[:, key2], expected[:, key2]
        elif kind == "concat":
            cut = data.draw(st.integers(0, 3))
            x = tw.concatenate([x, x[:cut], tw.from_array(expected, rows=2)])
            expected = np.concatenate([expected, expected[:cut], expected])
        elif kind == "head":
            n = data.draw(st.integers(0, 8))
            x, expected = x.head(n), expected[:n]
            break  # head of a masked array is an in-memory value
        elif kind == "filter":
            # The filter sees blocks, so the oracle needs the blocks' own row numbers:
            # keeping the rows whose first value is true needs none.
            width = int(np.prod(expected.shape[1:]))
            if width == 0:
                continue
            x = x.filter(lambda b, w=width: b.reshape(len(b), w)[:, 0].astype(bool))
            expected = expected[expected.reshape(expected.shape[0], width)[:, 0].astype(bool)]
    same(x.compute(), expected)


REDUCTIONS = ["sum", "prod", "mean", "min", "max", "std", "var", "any", "all", "argmin",
              "argmax", "count_nonzero"]  # fmt: skip


def _float_oracle(kind: str, a: np.ndarray, kwargs: dict[str, Any]) -> Any:
    """NumPy's reduction in float64 (tierflow's accumulator), cast to NumPy's dtype."""
    native = getattr(np, kind)(a, **kwargs)
    wide = getattr(np, kind)(a.astype(np.float64), **kwargs)
    return np.asarray(wide).astype(np.asarray(native).dtype)


@SETTINGS
@pytest.mark.executors("threads", "serial", "processes", "dask", "ray")
@given(a=arrays(), data=st.data())
def test_reductions_equal_numpy(a: np.ndarray, data: st.DataObject) -> None:
    x = lazy(a, data)
    if data.draw(st.booleans(), label="after an elementwise step"):
        # A fused elementwise tree under the reduction (FusedReduction / epilogue).
        build, oracle = step(x, a, data)
        got, want = outcome(build), outcome(oracle)
        if got[0] == "ok" and want[0] == "ok":
            x, a = got[1], np.asarray(want[1])
    kind = data.draw(st.sampled_from(REDUCTIONS), label="kind")
    axes: list[Any] = [None, 0, -1] + ([(0, 1), 1] if a.ndim > 1 else [])
    kwargs: dict[str, Any] = {"axis": data.draw(st.sampled_from(axes), label="axis")}
    if kind in ("argmin", "argmax") and isinstance(kwargs["axis"], tuple):
        kwargs["axis"] = 0
    if kind not in ("argmin", "argmax"):
        kwargs["keepdims"] = data.draw(st.booleans(), label="keepdims")
    if kind in ("std", "var"):
        kwargs["ddof"] = data.draw(st.sampled_from([0, 1]), label="ddof")
    if kind == "sum" and data.draw(st.booleans(), label="with dtype"):
        kwargs["dtype"] = data.draw(st.sampled_from(["int64", "float64", "float32"]))
    fn = np.count_nonzero if kind == "count_nonzero" else getattr(np, kind)
    want = outcome(lambda: fn(a, **kwargs))
    got = outcome(lambda: np.asarray(fn(x, **kwargs).compute()))
    if want[0] == "error":
        assert got == want
        return
    assert got[0] == "ok", got
    result, expected = np.asarray(got[1]), np.asarray(want[1])
    assert result.dtype == expected.dtype and result.shape == expected.shape
    if expected.dtype.kind in "fc" and kind not in ("min", "max", "argmin", "argmax"):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            wide = (
                _float_oracle(kind, a, kwargs)
                if a.dtype.kind in "fc" or kind in ("mean", "std", "var")
                else expected
            )
        tol = {2: 2e-3, 4: 2e-5, 8: 1e-9}[expected.dtype.itemsize]
        np.testing.assert_allclose(result, wide, rtol=tol, atol=tol, equal_nan=True)
    else:
        np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_and_one_rows_keep_numpy_results(dtype: str) -> None:
    for rows in (0, 1):
        a = np.ones((rows, 3), dtype)
        x = tw.from_array(a, rows=2)
        same((x + 1).compute(), a + 1)
        same(x.sum(axis=0).compute(), a.sum(axis=0))
        same(x[::-1].compute(), a[::-1])
