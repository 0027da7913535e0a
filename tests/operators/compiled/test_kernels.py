"""Compiled fused reductions against the NumPy path: the same partials, NumPy's dtypes,
and the NumPy path wherever NumPy would warn."""

from __future__ import annotations

import random
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from tierflow.operators.compiled import (
    CompiledReduction,
    Unsupported,
    elementwise_source,
    load,
    reduction_source,
)
from tierflow.operators.compiled.kernels import CompiledBincount, kernel_folder, on_disk
from tierflow.operators.compiled.source import bincount_source
from tierflow.operators.elementwise import Const, Expr, Input, astype, call, clip, walk, where
from tierflow.operators.fused import FusedKernel, FusedReduction
from tierflow.operators.reductions import reduction

from ..helpers import DTYPES, random_array
from ..test_fused import _random_expr
from common import examples

x = Input(0)
y = Input(1)

_loaded: dict[str, Any] = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def _pair(
    expr: Expr, dtypes: list[Any], shape: tuple[int, ...], kind: str, folder: Path, **kw: Any
) -> tuple[FusedReduction, CompiledReduction]:
    kw.setdefault("axis", 0)
    op = reduction(kind, FusedKernel(expr, dtypes, [shape] * len(dtypes)).out_dtype, shape, **kw)
    fused = FusedReduction(FusedKernel(expr, dtypes, [shape] * len(dtypes)), op)
    source = reduction_source(expr, dtypes, [shape] * len(dtypes), op)
    if source.key not in _loaded:
        _loaded[source.key] = load(source, folder).function
    return fused, CompiledReduction(source, _loaded[source.key], op)


def _kernel_result(fused: FusedReduction, compiled: CompiledReduction, blocks: list[Any]) -> Any:
    rows = blocks[0].shape[0]
    held = fused._scratch.get(rows)

    def head(n: int) -> np.ndarray:
        return fused._program.evaluate([b[:n] for b in blocks], n, held)

    partial = compiled.partial(blocks, rows, head)
    return None if partial is None else fused.aggregate(partial)


def _assert_same(got: Any, want: Any, exact: bool) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    if exact or got.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
    else:
        rtol = 2e-6 if got.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(got, want, rtol=rtol, atol=0)


KINDS = ["sum", "prod", "mean", "min", "max", "nanmin", "nanmax", "any", "all",
         "count_nonzero", "var", "std", "argmin", "argmax"]  # fmt: skip


# Every kind on one integer and one float dtype; the kinds whose code differs by dtype
# (wrapping sums, integer bounds, truth) on the others.
PAIRS = [(k, d) for k in KINDS for d in ("int64", "float32")] + [
    (k, d)
    for d in ("bool", "int8", "uint8", "uint64", "float64")
    for k in ("sum", "max", "all", "var")
]


@pytest.mark.parametrize(("kind", "dtype"), PAIRS)
def test_a_reduction_of_the_input_itself_matches_the_numpy_path(
    kind: str, dtype: str, folder: Path
) -> None:
    if kind in ("nanmin", "nanmax") and dtype == "bool":
        pytest.skip("NumPy has no nanmin of bools")
    rng = np.random.default_rng(3)
    block = random_array(rng, np.dtype(dtype), (1237, 8), wide_ints=kind != "prod")
    fused, compiled = _pair(x, [dtype], (8,), kind, folder)
    got = _kernel_result(fused, compiled, [block])
    assert got is not None, "the kernel sent a block without NaN back"
    want = fused.aggregate(fused.chunk(block))
    exact = kind in ("min", "max", "nanmin", "nanmax", "any", "all", "count_nonzero",
                     "argmin", "argmax")  # fmt: skip
    _assert_same(got, want, exact)
    if kind in ("sum", "mean") and dtype.startswith("float"):
        # float64 sums: NumPy's float64 result rounded to the dtype (NumPy's own float32
        # sum is less accurate than both paths)
        exact64 = getattr(np, kind)(block, axis=0, dtype=np.float64).astype(dtype)
        _assert_same(got, exact64, False)


EXPRESSIONS = {
    "sqrt(|x|*2+1)": (lambda: call(np.sqrt, abs(x) * 2 + 1), ["float32"]),
    "(x-m)/s": (lambda: (x - Const(np.arange(8.0))) / Const(np.arange(1.0, 9.0)), ["float32"]),
    "where": (lambda: where(call(np.greater, x, 0.5), x, 0), ["float64"]),
    "clip": (lambda: clip(x, 0.25, 0.75), ["float32"]),
    "minimum": (lambda: call(np.minimum, x, y), ["float32", "float32"]),
    "abs(-x)": (lambda: abs(-x), ["int16"]),
    "int wrap": (lambda: x * 3 + 7, ["int64"]),
    "uint wrap": (lambda: x - 200, ["uint8"]),
    "mixed": (lambda: x * y + 1.5, ["int32", "float32"]),
    "astype": (lambda: astype(x, np.float64) * 3, ["float32"]),
    "compare": (lambda: call(np.less, x, y), ["int8", "int8"]),
    "logical": (lambda: call(np.logical_and, x, call(np.logical_not, y)), ["bool", "bool"]),
}


@pytest.mark.parametrize("kind", ["sum", "min", "var", "count_nonzero"])
@pytest.mark.parametrize("name", sorted(EXPRESSIONS))
def test_an_expression_reduced_matches_the_numpy_path(kind: str, name: str, folder: Path) -> None:
    make, dtypes = EXPRESSIONS[name]
    expr = make()
    rng = np.random.default_rng(7)
    blocks = [random_array(rng, np.dtype(d), (999, 8), span=(-2, 2)) for d in dtypes]
    try:
        fused, compiled = _pair(expr, dtypes, (8,), kind, folder)
    except TypeError:
        pytest.skip(f"NumPy has no {kind} of this expression's dtype")
    got = _kernel_result(fused, compiled, blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = fused.aggregate(fused.chunk(*blocks))
    assert got is not None
    _assert_same(got, want, kind in ("min", "max", "any", "count_nonzero"))


@pytest.mark.parametrize("ufunc", [np.exp, np.log1p, np.sin, np.tanh, np.arctan2, np.power])
def test_what_numpy_vectorises_and_numba_calls_libm_for_keeps_the_numpy_path(
    ufunc: np.ufunc,
) -> None:
    # one libm call per element: 0.1-0.7x NumPy's vectorised loops
    expr = call(ufunc, x) if ufunc.nin == 1 else call(ufunc, x, 2.0)
    op = reduction("sum", np.float64, (8,), axis=0)
    with pytest.raises(Unsupported, match=f"{ufunc.__name__} of float64: NumPy's vectorised"):
        reduction_source(call(np.sqrt, x) + expr, ["float64"], [(8,)], op)


@given(
    values=st.lists(
        st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=300
    ),
    kind=st.sampled_from(["sum", "min", "max", "mean", "var", "count_nonzero"]),
)
@settings(max_examples=examples(60), deadline=None)
def test_edge_values_give_the_numpy_paths_answer_or_go_back_to_it(
    values: list[float], kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.getbasetemp() / "kernels-edge"
    rows = len(values) // 2 or 1
    block = np.resize(np.array(values, np.float32), (rows, 2))
    fused, compiled = _pair(call(np.sqrt, x * 2 + 1), ["float32"], (2,), kind, folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = fused.aggregate(fused.chunk(block))
    got = _kernel_result(fused, compiled, [block])
    # NaN or infinity in the data, or NumPy's warning: the NumPy path; else the kernel
    if caught or not np.isfinite(block).all():
        assert got is None, f"kept a block NumPy warns on: {[str(w.message) for w in caught]}"
        return
    assert got is not None, "sent back a block that is fine"
    _assert_same(got, want, kind in ("min", "max", "count_nonzero"))


def test_a_floating_point_error_sends_the_block_to_the_numpy_path(folder: Path) -> None:
    block = np.linspace(-1, 1, 4000, dtype=np.float32).reshape(500, 8)
    for kind in ("sum", "min", "count_nonzero"):
        # min and count_nonzero do not show the NaN: a witness lane does
        fused, compiled = _pair(call(np.sqrt, x), ["float32"], (8,), kind, folder)
        assert _kernel_result(fused, compiled, [block]) is None
        with pytest.warns(RuntimeWarning, match="invalid value encountered in sqrt"):
            fused.chunk(block)


def test_an_error_hidden_by_a_comparison_still_goes_back(folder: Path) -> None:
    block = np.full((300, 8), 1e30, np.float32)
    fused, compiled = _pair(call(np.greater, x * x, 0), ["float32"], (8,), "sum", folder)
    assert _kernel_result(fused, compiled, [block]) is None  # x * x overflows float32


def test_a_float64_sum_that_overflows_goes_back(folder: Path) -> None:
    block = np.full((300, 8), 1e308, np.float64)
    fused, compiled = _pair(x, ["float64"], (8,), "sum", folder)
    assert _kernel_result(fused, compiled, [block]) is None


def test_underflow_under_errstate_raise_goes_back(folder: Path) -> None:
    block = np.full((300, 8), 1e-30, np.float32)
    fused, compiled = _pair(x * x, ["float32"], (8,), "sum", folder)
    assert _kernel_result(fused, compiled, [block]) is not None
    with np.errstate(under="raise"):
        assert _kernel_result(fused, compiled, [block]) is None


def test_a_block_that_is_not_contiguous_goes_back(folder: Path) -> None:
    block = np.ones((300, 16), np.float32)[:, ::2]
    fused, compiled = _pair(x, ["float32"], (8,), "sum", folder)
    assert _kernel_result(fused, compiled, [block]) is None


@pytest.mark.parametrize("shape", [(1,), (3,), (3, 5), (2000,)])
@pytest.mark.parametrize("rows", [1, 7, 1000])
def test_row_shapes_and_trailing_axes(shape: tuple[int, ...], rows: int, folder: Path) -> None:
    rng = np.random.default_rng(1)
    block = random_array(rng, np.dtype(np.float64), (rows, *shape))
    for axis in (0, None):
        fused, compiled = _pair(x * 2, ["float64"], shape, "sum", folder, axis=axis)
        got = _kernel_result(fused, compiled, [block])
        _assert_same(got, (block * 2).sum(axis=axis), False)


@pytest.mark.parametrize("kind", ["argmin", "argmax"])
@pytest.mark.parametrize("axis", [0, None])
@given(
    values=st.lists(
        st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, np.nan, np.inf, -np.inf]),
        min_size=6,
        max_size=200,
    ),
    split=st.integers(1, 100),
)
@settings(max_examples=examples(40), deadline=None)
def test_argmin_and_argmax_give_numpys_first_index_across_blocks(
    kind: str,
    axis: int | None,
    values: list[float],
    split: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    rows = len(values) // 3
    data = np.array(values[: rows * 3], np.float64).reshape(rows, 3)
    fused, compiled = _pair(
        x, ["float64"], (3,), kind, tmp_path_factory.getbasetemp() / "ka", axis=axis
    )
    cut = min(split, rows - 1) if rows > 1 else rows
    partials = []
    for start, block in ((0, data[:cut]), (cut, data[cut:])):
        if len(block):
            head = lambda n, b=block: b[:n]  # noqa: E731
            partial = compiled.partial([block], len(block), head, start)
            assert partial is not None
            partials.append(partial)
    combined = partials[0] if len(partials) == 1 else fused.combine(*partials)
    got = fused.aggregate(combined)
    want = getattr(np, kind)(data, axis=axis)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize(
    ("bins", "limits"),
    [
        (64, (1, 1.75)),
        (10, (0.0, 1.0)),
        (7, (0.1, 0.9)),
        (3, (0.5, 0.5)),
        (5, (-3, 40)),
        (4, (np.float64(0.2), np.float64(0.7))),
    ],
)
def test_a_histogram_counts_what_numpys_does(
    dtype: str, bins: int, limits: tuple[Any, Any], folder: Path
) -> None:
    from tierflow.operators.compiled.kernels import CompiledHistogram
    from tierflow.operators.compiled.source import histogram_source
    from tierflow.operators.reductions import Histogram

    rng = np.random.default_rng(11)
    values = rng.random(20_000) * (2 if dtype != "int32" else 50)
    edges = np.histogram_bin_edges(values.astype(dtype), bins=bins, range=limits)
    values[:40] = np.resize(edges, 40)  # every edge, exactly
    if dtype != "int32":
        values[40:44] = [np.nan, np.inf, -np.inf, -0.0]
    column = values.astype(dtype)
    histogram = Histogram(np.dtype(dtype), bins, limits)

    class Counts:  # what the engine's histogram reduction holds
        def __init__(self, h: Any) -> None:
            self.histogram = h

    source = histogram_source(x, [dtype], [()], histogram)
    if source.key not in _loaded:
        _loaded[source.key] = load(source, folder).function
    compiled = CompiledHistogram(source, _loaded[source.key], Counts(histogram))
    strided = np.stack([column, column], axis=1)[:, 0]  # a column of a wider block
    for block in (column, strided):
        got = compiled.partial([block], len(block), lambda n, b=block: b[:n])
        np.testing.assert_array_equal(got, np.histogram(column, bins=bins, range=limits)[0])


def test_a_histogram_of_bin_edges_is_not_compiled() -> None:
    from tierflow.operators.compiled.source import Unsupported, histogram_source
    from tierflow.operators.reductions import Histogram

    with pytest.raises(Unsupported, match="bins given as edges"):
        histogram_source(x, ["float32"], [()], Histogram(np.float32, [0, 1, 5]))


@settings(max_examples=examples(100), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 400),
    kind=st.sampled_from(["sum", "min", "max", "mean", "var", "argmax", "any", "count_nonzero"]),
    depth=st.integers(1, 4),
)
def test_random_expressions_reduced_match_the_numpy_path(
    seed: int, rows: int, kind: str, depth: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The fused kernels' random expressions, reduced on both paths: the same result
    (float sums within float64's rounding), or the kernel goes back where NumPy warns."""
    rng = random.Random(seed)
    n_inputs = rng.choice([1, 2])
    dtypes = [str(rng.choice(DTYPES)) for _ in range(n_inputs)]
    expr = _random_expr(rng, depth, n_inputs, (3,))
    if not isinstance(expr, Expr) or not any(isinstance(n, Input) for n in walk(expr)):
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fused, compiled = _pair(expr, dtypes, (3,), kind, tmp_path_factory.getbasetemp() / "kr")
    except (TypeError, ValueError, OverflowError, Unsupported):
        return
    data = np.random.default_rng(seed)
    blocks = [random_array(data, np.dtype(d), (rows, 3)) for d in dtypes]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            want = fused.aggregate(fused.chunk(*blocks))
        except Exception:
            return
    got = _kernel_result(fused, compiled, blocks)
    if caught:
        assert got is None, f"{expr!r}: NumPy warned {caught[0].message}, the kernel did not"
        return
    if got is None:  # NaN or infinity reached a checked lane without a warning: allowed
        return
    try:  # values bit for bit NumPy's (no exp, log, ...: a unit in the last place apart)
        elementwise_source(expr, dtypes, [(3,)] * n_inputs)
        bitwise = True
    except Unsupported:
        bitwise = False
    exact = kind in ("any", "count_nonzero") or (bitwise and kind in ("min", "max", "argmax"))
    if kind == "argmax" and not exact:
        return  # the first of two values a unit apart may differ
    if exact or np.asarray(want).dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(
            got, want, rtol=1e-5 if np.asarray(want).dtype.itemsize < 8 else 1e-9
        )


_ASK_AND_EXIT = """
import sys
import numpy as np
from tierflow.operators.compiled import load, reduction_source
from tierflow.operators.compiled.tiered import CompiledSlot
from tierflow.operators.elementwise import Const, Input
from tierflow.operators.fused import FusedKernel
from tierflow.operators.reductions import reduction

expr = Input(0) * Const(np.float32(3)) + Const(np.float32(1))
op = reduction("sum", FusedKernel(expr, [np.float32], [(4,)]).out_dtype, (4,), axis=0)
source = reduction_source(expr, [np.float32], [(4,)], op)
print(source.key)
if sys.argv[2] == "ask":  # then end at once: the kernel is still to compile
    CompiledSlot(source, op).start(sys.argv[1])
else:
    from tierflow.operators.compiled.kernels import kernel_folder
    print(load(source, kernel_folder(sys.argv[1])).compiled)
"""


def test_a_kernel_asked_for_by_a_process_that_ends_at_once_is_compiled_for_the_next(
    tmp_path: Path,
) -> None:
    def run(mode: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", _ASK_AND_EXIT, str(tmp_path), mode],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return done.stdout.split()

    expr = x * Const(np.float32(3)) + Const(np.float32(1))
    op = reduction("sum", FusedKernel(expr, [np.float32], [(4,)]).out_dtype, (4,), axis=0)
    source = reduction_source(expr, [np.float32], [(4,)], op)
    assert run("ask") == [source.key]
    deadline = time.monotonic() + 60
    while not on_disk(source, kernel_folder(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert on_disk(source, kernel_folder(tmp_path)), "not compiled after its process ended"
    assert run("load") == [source.key, "False"]  # read from disk: nothing compiled


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int32", "uint32", "int64"])
def test_a_compiled_bincount_counts_what_numpy_does_and_grows_its_counts(
    dtype: str, folder: Path
) -> None:
    source = bincount_source(Input(0), [dtype], [()])
    compiled = CompiledBincount(source, load(source, folder).function)
    rng = np.random.default_rng(11)
    top = 2 if dtype == "bool" else min(5000, int(np.iinfo(dtype).max) + 1)
    small = rng.integers(0, min(top, 1000), 3001).astype(dtype)
    big = rng.integers(0, top, 3001).astype(dtype)
    np.testing.assert_array_equal(compiled.partial([small], 3001, _no_pilot), np.bincount(small))
    first = compiled.partial([big], 3001, _no_pilot)
    if int(big.max()) >= 1024:  # past the first counts: the NumPy path, and room later
        assert first is None
        first = compiled.partial([big], 3001, _no_pilot)
    np.testing.assert_array_equal(first, np.bincount(big))
    assert first.dtype == np.intp


def test_a_compiled_bincount_sends_back_what_numpy_refuses_or_it_cannot_read(
    folder: Path,
) -> None:
    source = bincount_source(Input(0), ["int64"], [()])
    compiled = CompiledBincount(source, load(source, folder).function)
    assert compiled.partial([np.array([3, -1, 2])], 3, _no_pilot) is None  # NumPy raises
    assert compiled.partial([np.array([3, 1, 2], ">i8")], 3, _no_pilot) is None  # byte order
    assert compiled.partial([np.array([1 << 40])], 1, _no_pilot) is None  # past 32 MB of counts
    assert compiled.capacity == 1024
    for dtype in ("uint64", "float32"):
        with pytest.raises(Unsupported, match=f"a bincount of {dtype} values is not compiled"):
            bincount_source(Input(0), [dtype], [()])
    with pytest.raises(Unsupported, match="complex64, which the compiler does not handle"):
        bincount_source(Input(0), ["complex64"], [()])
    with pytest.raises(Unsupported, match="bincount counts one value per row"):
        bincount_source(Input(0), ["int32"], [(2,)])


def _no_pilot(rows: int) -> np.ndarray:
    raise AssertionError("a bincount takes no pilot")
