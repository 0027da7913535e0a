"""Compiled elementwise kernels: NumPy's values bit for bit (the sign of zero included),
the NumPy path wherever NumPy would warn, and the reasons for what is not compiled."""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from tierflow.operators.compiled import (
    CompiledElementwise,
    Unsupported,
    elementwise_source,
    load,
)
from tierflow.operators.elementwise import Const, Expr, Input, astype, call, clip, walk, where
from tierflow.operators.fused import FusedKernel

from ..helpers import DTYPES, random_array
from ..test_fused import _random_expr
from common import examples

x = Input(0)
y = Input(1)
_loaded: dict[str, Any] = {}


def _compiled(expr: Expr, dtypes: list[str], shape: tuple[int, ...], folder: Path) -> Any:
    source = elementwise_source(expr, dtypes, [shape] * len(dtypes))
    if source.key not in _loaded:
        _loaded[source.key] = load(source, folder).function
    return CompiledElementwise(source, _loaded[source.key])


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


EXPRESSIONS = {
    "(x-m)/s": (lambda: (x - Const(np.arange(4.0, dtype=np.float32))) / 3, ["float32"]),
    "minimum": (lambda: call(np.minimum, x, y), ["float32", "float32"]),
    "maximum": (lambda: call(np.maximum, x, y), ["float64", "float64"]),
    "clip": (lambda: clip(x, -0.0, 0.5), ["float32"]),
    "clip by rows": (
        lambda: clip(x, Const(np.array([-0.0, 0, 1, 0.5])), y),
        ["float32", "float32"],
    ),
    "where": (lambda: where(call(np.greater, x, y), x, -y), ["float64", "float64"]),
    "abs-neg": (lambda: abs(-x) * y, ["float32", "float32"]),
    "rounding": (
        lambda: call(np.floor, x) + call(np.ceil, y) - call(np.trunc, x) * call(np.rint, y),
        ["float64", "float64"],
    ),
    "sqrt": (lambda: call(np.sqrt, x * x + y * y), ["float32", "float32"]),
    "cast": (lambda: astype(x, np.float32) + astype(y, np.float32), ["float64", "int32"]),
    "compare": (lambda: call(np.less_equal, x, y), ["float32", "float32"]),
    "mixed ints": (lambda: x * y - 7, ["int16", "uint8"]),
    "int predicates": (
        lambda: call(np.logical_xor, call(np.isfinite, x), call(np.isnan, y)),
        ["int16", "uint8"],
    ),
    "doubled": (lambda: x * 2 - Const(np.float32(2)) * y, ["float32", "float32"]),
    "int divided": (lambda: x // 7 + x % -3 - y // Const(np.uint8(5)), ["int16", "uint8"]),
    "int64 divided": (lambda: x // -2 + x % 1000, ["int64"]),
    "uint64 divided": (lambda: x // 3 + x % Const(np.uint64(1 << 40)), ["uint64"]),
    "doubled float64": (lambda: 2.0 * x + x * Const(np.float32(2)), ["float64"]),
}

finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
special = st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.0e38, -3.0e38, 0.5, -0.5, 1.5])


@pytest.mark.parametrize("name", sorted(EXPRESSIONS))
@given(data=st.data())
@settings(max_examples=examples(15), deadline=None)
def test_the_kernel_writes_numpys_values_bit_for_bit(
    name: str, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    make, dtypes = EXPRESSIONS[name]
    expr = make()
    rows = data.draw(st.integers(1, 300))
    pool = data.draw(st.lists(st.one_of(finite, special), min_size=1, max_size=24))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    blocks = []
    for d in dtypes:
        values = rng.choice(np.array(pool, np.float64), size=(rows, 4))
        if np.dtype(d).kind in "iu":
            info = np.iinfo(d)
            low, high = max(int(info.min), -(2**53)), min(int(info.max), 2**53)  # exact
            blocks.append(np.clip(values * 1000, low, high).astype(d))
        else:
            blocks.append(values.astype(d))
    kernel = FusedKernel(expr, dtypes, [(4,)] * len(dtypes))
    compiled = _compiled(expr, dtypes, (4,), tmp_path_factory.getbasetemp() / "kernels-ew")
    out = np.empty((rows, 4), kernel.out_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            want = kernel.apply(*blocks)
        except RuntimeWarning:  # NumPy warns: the kernel must send the block back
            assert not compiled.apply(blocks, rows, out)
            return
    assert compiled.apply(blocks, rows, out), "sent back a block NumPy does not warn on"
    np.testing.assert_array_equal(_bits(out), _bits(want))


def test_nan_in_the_data_or_an_overflow_goes_back(tmp_path: Path) -> None:
    compiled = _compiled(x * 2, ["float32"], (4,), tmp_path)
    out = np.empty((3, 4), np.float32)
    block = np.ones((3, 4), np.float32)
    assert compiled.apply([block], 3, out)
    block[1, 2] = np.nan
    assert not compiled.apply([block], 3, out)
    assert not compiled.apply([np.full((3, 4), 3e38, np.float32)], 3, out)
    hidden = _compiled(call(np.greater, x * 2, 0), ["float32"], (4,), tmp_path)
    assert not hidden.apply([np.full((3, 4), 3e38, np.float32)], 3, np.empty((3, 4), bool))


@pytest.mark.parametrize(
    ("expr", "dtypes", "reason"),
    [
        (lambda: call(np.exp, x), ["float32"], "exp of float32: NumPy's vectorised loop"),
        (lambda: call(np.fmin, x, 1), ["float32"], "fmin of floats"),
        (lambda: x // y, ["int32", "int32"], "floor_divide on int32 is compiled by a constant"),
        (lambda: x % -1, ["int32"], "remainder on int32 is compiled by a constant divisor"),
        (lambda: x // 0, ["int8"], "divisor other than 0 and -1 only"),
        (lambda: astype(x, np.int32), ["float32"], "casts float32 to int32"),
        (lambda: x * 2, ["float16"], "float16, which the compiler does not handle"),
        (lambda: x * 2, ["complex64"], "complex64, which the compiler does not handle"),
        (lambda: x, ["float32"], "nothing to compute"),
    ],
)
def test_what_is_not_compiled_says_why(expr: Any, dtypes: list[str], reason: str) -> None:
    with pytest.raises(Unsupported, match=reason):
        elementwise_source(expr(), dtypes, [(4,)] * len(dtypes))


@settings(max_examples=examples(150), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 300),
    row_shape=st.sampled_from([(1,), (3,), (2, 3)]),
    depth=st.integers(1, 4),
)
def test_random_expressions_compiled_match_the_numpy_path_bitwise(
    seed: int,
    rows: int,
    row_shape: tuple[int, ...],
    depth: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The fused kernels' property test, over the compiled path: every expression the
    compiler takes gives the NumPy path's bits, or goes back where NumPy warns."""
    rng = random.Random(seed)
    n_inputs = rng.choice([1, 2])
    dtypes = [str(rng.choice(DTYPES)) for _ in range(n_inputs)]
    expr = _random_expr(rng, depth, n_inputs, row_shape)
    if not isinstance(expr, Expr) or not any(isinstance(n, Input) for n in walk(expr)):
        return
    try:
        with warnings.catch_warnings():  # NumPy's warnings on constants folded at build
            warnings.simplefilter("ignore")
            kernel = FusedKernel(expr, dtypes, [row_shape] * n_inputs)
        compiled = _compiled(expr, dtypes, row_shape, tmp_path_factory.getbasetemp() / "kr")
    except (TypeError, ValueError, OverflowError, Unsupported):
        return  # NumPy refuses it, or the compiler does not take it (tested above)
    data = np.random.default_rng(seed)
    blocks = [random_array(data, np.dtype(d), (rows, *row_shape)) for d in dtypes]
    out = np.empty((rows, *kernel.out_row_shape), kernel.out_dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            want = kernel.apply(*blocks)
        except Exception:  # NumPy raises on these values (a negative integer power)
            return
    done = compiled.apply(blocks, rows, out)
    if caught:
        assert not done, f"{expr!r}: NumPy warned {caught[0].message}, the kernel did not"
        return
    assert done, f"{expr!r}: sent back a block NumPy computes without a warning"
    np.testing.assert_array_equal(_bits(out), _bits(want))


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16"])
def test_integer_clip_bounds_outside_the_dtype_act_as_its_ends(dtype: str, tmp_path: Path) -> None:
    """np.clip(uint8, -1, 3) leaves 0 and 1 alone: a bound cast to uint8 would be 255."""
    block = np.array([[0, 1, 5, 100], [127, 2, 3, 4]], dtype)
    for lo, hi in [(-1, 3), (-300, 300), (2, 1000)]:
        expr = clip(x, lo, hi)
        compiled = _compiled(expr, [dtype], (4,), tmp_path)
        out = np.empty((2, 4), dtype)
        assert compiled.apply([block], 2, out)
        np.testing.assert_array_equal(out, np.clip(block, lo, hi))


def test_a_float_doubled_by_a_constant_is_written_as_an_addition() -> None:
    # the same bits, and no port taken from a square root (the constant is an argument:
    # the compiler cannot see it is 2)
    source = elementwise_source(call(np.sqrt, 2 * x + 1), ["float32"], [(4,)])
    assert "v0 + v0" in source.text and len(source.consts) == 1
    source = elementwise_source(x * Const(np.int8(2)), ["float32"], [(4,)])
    assert "v0 + v0" in source.text and not source.consts  # 2 in the loop's float32
    source = elementwise_source(x * 2.5 + x * Const(np.full(4, 2.0)), ["float64"], [(4,)])
    assert " + v0)" not in source.text and len(source.consts) == 2  # not 2; an array
