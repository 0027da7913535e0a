"""FusedKernel and FusedReduction: bitwise NumPy results, sub-blocks, scratch, epilogues."""

from __future__ import annotations

import math
import random
import threading
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tierflow.operators import fused, reductions
from tierflow.operators.elementwise import (
    Const,
    Expr,
    Input,
    astype,
    call,
    clip,
    evaluate,
    round_,
    walk,
    where,
)
from tierflow.operators.fused import SUBBLOCK_BYTES, FusedKernel, FusedReduction, subblock_rows
from tierflow.operators.linalg import Matmul
from tierflow.operators.reductions import reduction
from tierflow.operators.types import BlockOp, ReductionOp

from .helpers import DTYPES, random_array, run_blockwise
from common import examples

x = Input(0)
y = Input(1)

UNARY = [
    np.negative, np.absolute, np.sqrt, np.exp, np.log1p, np.sin, np.floor, np.square,
    np.invert, np.logical_not, np.isnan, np.sign, np.positive, np.rint, np.cbrt, np.tanh,
    np.reciprocal, np.signbit,
]  # fmt: skip
BINARY = [
    np.add, np.subtract, np.multiply, np.true_divide, np.floor_divide, np.remainder,
    np.power, np.maximum, np.minimum, np.fmax, np.fmin, np.less, np.greater_equal, np.equal,
    np.logical_and, np.logical_xor, np.bitwise_and, np.bitwise_or, np.arctan2, np.hypot,
    np.copysign, np.heaviside, np.left_shift,
]  # fmt: skip
SCALARS: list[Any] = [2, -1, 0, 7, 0.5, 3.0, -2.5, True, np.float32(1.5), np.int8(3), np.uint8(2)]
# NumPy's scalar and SIMD loops of these order -0.0 and 0.0 differently
# (np.fmax(zeros(n), -zeros(n)) has the sign bit for n >= 8, not for n <= 3), so the sign
# of a zero they return depends on the length NumPy sees, and a sub-block is shorter.
SIGNED_ZERO_ORDER = {np.maximum, np.minimum, np.fmax, np.fmin}


def _zeros_made_positive(made: Expr) -> Expr:
    """``made`` with every zero +0.0, in the kernel and in the oracle alike, so the
    comparison stays bitwise for everything else, the operators downstream included."""
    return where(made, made, call(np.absolute, made))


def _random_expr(rng: random.Random, depth: int, n_inputs: int, row_shape: tuple[int, ...]) -> Expr:
    pool: list[Expr] = []

    def leaf() -> Any:
        r = rng.random()
        if r < 0.6:
            return Input(rng.randrange(n_inputs))
        if r < 0.85:
            return rng.choice(SCALARS)
        dtype = rng.choice([np.int8, np.float32, np.float64, np.uint8])
        shape = rng.choice([row_shape, (1, *row_shape)])
        return np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape) % 5

    def node(level: int) -> Any:
        if pool and rng.random() < 0.15:
            return rng.choice(pool)  # a shared sub-expression: the tree becomes a DAG
        if level == 0 or rng.random() < 0.2:
            return leaf()
        r = rng.random()
        if r < 0.35:
            made: Expr = call(rng.choice(UNARY), node(level - 1))
        elif r < 0.75:
            ufunc = rng.choice(BINARY)
            made = call(ufunc, node(level - 1), node(level - 1))
            if ufunc in SIGNED_ZERO_ORDER:
                made = _zeros_made_positive(made)
        elif r < 0.83:
            made = where(node(level - 1), node(level - 1), node(level - 1))
        elif r < 0.89:
            lo, hi = rng.choice([(0, 5), (None, 2), (-1.5, None), (leaf(), 3)])
            made = clip(node(level - 1), lo, hi)
        elif r < 0.95:
            made = astype(node(level - 1), rng.choice(DTYPES))
        else:
            made = round_(node(level - 1), rng.choice([0, 1, -1]))
        pool.append(made)
        return made

    expr: Expr = node(depth)
    return expr


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


@settings(max_examples=examples(300), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(0, 40),
    row_shape=st.sampled_from([(), (1,), (3,), (2, 3)]),
    subblock_bytes=st.sampled_from([1, 24, 200, 4096, SUBBLOCK_BYTES]),
    depth=st.integers(1, 5),
)
def test_random_expressions_match_numpy_bitwise(
    seed: int, rows: int, row_shape: tuple[int, ...], subblock_bytes: int, depth: int
) -> None:
    rng = random.Random(seed)
    data = np.random.default_rng(seed)
    n_inputs = rng.choice([1, 2])
    dtypes = [rng.choice(DTYPES) for _ in range(n_inputs)]
    # The second input may broadcast along its trailing axes (a column of size 1).
    shapes = [row_shape] + [tuple(rng.choice([n, 1]) for n in row_shape)] * (n_inputs - 1)
    expr = _random_expr(rng, depth, n_inputs, row_shape)
    assume(isinstance(expr, Expr) and any(isinstance(n, Input) for n in walk(expr)))
    blocks = [random_array(data, d, (rows, *s)) for d, s in zip(dtypes, shapes, strict=True)]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want: Any = None
        want_error: Exception | None = None
        try:
            want = evaluate(expr, *blocks)
        except Exception as exc:
            want_error = exc
        try:
            kernel = FusedKernel(expr, dtypes, shapes, subblock_bytes=subblock_bytes)
        except (TypeError, ValueError, OverflowError) as exc:
            # Refused at build time: plain NumPy fails on zero rows with the same error,
            # and on the real data too (maybe first on a value, e.g. a negative power).
            assert want_error is not None, f"build refused {expr!r}: {exc}"
            empty = [b[:0] for b in blocks]
            with pytest.raises(type(exc)) as raised:
                evaluate(expr, *empty)
            assert str(raised.value) == str(exc)
            return
        if want_error is not None:
            with pytest.raises(type(want_error)):
                kernel.apply(*blocks)
            return
        got = kernel.apply(*blocks)
    assert kernel.out_dtype == want.dtype
    assert kernel.out_row_shape == want.shape[1:]
    assert _same_bits(got, want), f"{expr!r} differs"


def test_sqrt_chain_on_float32_is_bitwise_numpy_and_stays_float32() -> None:
    block = random_array(np.random.default_rng(1), np.float32, (5000, 8), span=(0, 3))
    expr = call(np.sqrt, x * 2.0 + 1)
    kernel = FusedKernel(expr, [np.float32], [(8,)], subblock_bytes=4096)
    got = kernel.apply(block)
    assert got.dtype == np.float32
    assert _same_bits(got, np.sqrt(block * 2.0 + 1))


def test_subblock_rows_are_powers_of_two_within_budget() -> None:
    assert subblock_rows(32) == 16384
    assert subblock_rows(12) == 32768  # 512 KiB / 12 B = 43690, rounded down to a power of 2
    assert subblock_rows(10**7) == 1
    assert subblock_rows(0) == 1 << 30
    kernel = FusedKernel(x + 1.0, [np.float32], [(8,)])
    assert kernel.sub_rows == SUBBLOCK_BYTES // 32


def test_chain_of_elementwise_ops_reuses_one_register_in_place() -> None:
    expr: Expr = x
    for ufunc in (np.negative, np.absolute, np.sqrt, np.exp, np.sin):
        expr = call(ufunc, expr * 1.5)
    kernel = FusedKernel(expr, [np.float32], [(8,)], subblock_bytes=4096)
    # 10 operations, one float32 register of 128 rows x 8 columns.
    assert kernel.temp_bytes(10_000) == 128 * 8 * 4
    assert kernel.temp_bytes(3) == 3 * 8 * 4
    block = np.random.default_rng(0).random((1000, 8), dtype=np.float32)
    assert _same_bits(kernel.apply(block), evaluate(expr, block))


def test_where_with_a_float_condition_counts_nan_as_true() -> None:
    block = np.array([[0.0, np.nan, 2.0, -0.0]], dtype=np.float64)
    expr = where(x, 1, 0)
    got = FusedKernel(expr, [np.float64], [(4,)]).apply(block)
    np.testing.assert_array_equal(got, [[0, 1, 1, 0]])
    assert got.dtype == np.int64


def test_round_of_integers_to_tens() -> None:
    block = np.array([[14, 15, 26, -35]], dtype=np.int16)
    expr = round_(x, -1)
    assert _same_bits(FusedKernel(expr, [np.int16], [(4,)]).apply(block), np.round(block, -1))


def test_constant_subexpressions_fold_with_numpys_dtype() -> None:
    # np.add(1.0, 1.0) is a strong float64, so the float32 block is promoted — as in NumPy.
    expr = x * call(np.add, 1.0, 1.0)
    kernel = FusedKernel(expr, [np.float32], [(2,)])
    block = np.ones((3, 2), np.float32)
    assert kernel.out_dtype == np.float64
    assert _same_bits(kernel.apply(block), evaluate(expr, block))


def test_identity_expression_copies_the_block() -> None:
    block = np.arange(6, dtype=np.int32).reshape(3, 2)
    got = FusedKernel(x, [np.int32], [(2,)]).apply(block)
    assert got is not block
    np.testing.assert_array_equal(got, block)


def test_apply_writes_into_out() -> None:
    block = np.arange(12, dtype=np.float64).reshape(6, 2)
    out = np.empty((6, 2))
    kernel = FusedKernel(x * 2, [np.float64], [(2,)], subblock_bytes=16)
    assert kernel.apply(block, out=out) is out
    np.testing.assert_array_equal(out, block * 2)


def test_out_of_the_wrong_shape_dtype_or_overlapping_an_input_is_refused() -> None:
    kernel = FusedKernel(x * 2, [np.float64], [(2,)])
    block = np.zeros((4, 2))
    with pytest.raises(
        ValueError, match=r"out has shape \(4, 3\) and dtype float64, expected shape \(4, 2\)"
    ):
        kernel.apply(block, out=np.empty((4, 3)))
    with pytest.raises(ValueError, match="dtype float32"):
        kernel.apply(block, out=np.empty((4, 2), np.float32))
    with pytest.raises(ValueError, match="out overlaps input block 0"):
        kernel.apply(block, out=block)


def test_blocks_that_do_not_match_the_kernel_are_refused() -> None:
    kernel = FusedKernel(x + y, [np.float32, np.float32], [(2,), (2,)])
    a = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="takes 2 block"):
        kernel.apply(a)
    with pytest.raises(
        ValueError, match=r"built for block 1 of dtype float32 .* got dtype float64"
    ):
        kernel.apply(a, np.zeros((4, 2)))
    with pytest.raises(ValueError, match=r"got dtype float32 and shape \(4, 3\)"):
        kernel.apply(a, np.zeros((4, 3), np.float32))
    with pytest.raises(ValueError, match="block 0 has 4 rows and block 1 has 5"):
        kernel.apply(a, np.zeros((5, 2), np.float32))
    with pytest.raises(TypeError, match="not a NumPy array"):
        kernel.apply(a, [[0, 0]] * 4)  # type: ignore[arg-type]


def test_zero_rows_give_an_empty_block() -> None:
    got = FusedKernel(call(np.sqrt, x), [np.float16], [(3,)]).apply(np.empty((0, 3), np.float16))
    assert got.shape == (0, 3)
    assert got.dtype == np.float16


def test_kernel_is_a_block_op() -> None:
    kernel = FusedKernel(x + 1, [np.int8], [(2,)])
    assert isinstance(kernel, BlockOp)
    assert kernel.row_independent
    assert kernel.n_inputs == 1


def test_rowwise_reduction_epilogue_is_bitwise_numpy() -> None:
    block = np.random.default_rng(2).random((3000, 16), dtype=np.float32)
    expr = call(np.sqrt, x * 2 + 1)
    epilogue = reduction("sum", np.float32, (16,), axis=1)
    kernel = FusedKernel(expr, [np.float32], [(16,)], epilogue=epilogue, subblock_bytes=4096)
    assert kernel.out_row_shape == ()
    assert _same_bits(kernel.apply(block), np.sqrt(block * 2 + 1).sum(axis=1))


def test_matmul_epilogue() -> None:
    block = np.random.default_rng(3).random((500, 4))
    w = np.arange(8.0).reshape(4, 2)
    kernel = FusedKernel(
        call(np.exp, x), [np.float64], [(4,)], epilogue=Matmul(np.float64, (4,), w)
    )
    np.testing.assert_allclose(kernel.apply(block), np.exp(block) @ w, rtol=1e-13)


def test_epilogue_must_take_the_expression_result() -> None:
    wrong = reduction("sum", np.float64, (16,), axis=1)
    with pytest.raises(ValueError, match="built for blocks of dtype float64 and row shape"):
        FusedKernel(x * 2, [np.float32], [(16,)], epilogue=wrong)


@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [
        ("sum", {"axis": 0}),
        ("sum", {}),
        ("mean", {"axis": 0}),
        ("var", {"axis": 0, "ddof": 1}),
        ("min", {"axis": 0}),
        ("argmax", {}),
        ("argmin", {"axis": 0}),
        ("count_nonzero", {"axis": 0}),
    ],
)
def test_fused_reduction_matches_numpy_on_the_evaluated_block(
    kind: str, kwargs: dict[str, Any]
) -> None:
    rng = np.random.default_rng(4)
    data = rng.random((2500, 8), dtype=np.float32)
    expr = call(np.sqrt, x * 2 + 1) - 1.5
    kernel = FusedKernel(expr, [np.float32], [(8,)], subblock_bytes=4096)
    fused = FusedReduction(kernel, reduction(kind, np.float32, (8,), **kwargs))
    assert isinstance(fused, ReductionOp)
    got = run_blockwise(fused, data, 700, rng)
    evaluated = evaluate(expr, data)
    want = getattr(np, kind)(evaluated, **kwargs)
    oracle = getattr(np, kind)(evaluated.astype(np.float64), **kwargs)
    assert np.asarray(got).dtype == np.asarray(want).dtype
    if kind in ("min", "argmax", "argmin", "count_nonzero"):
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, oracle.astype(np.float32), rtol=2e-7, atol=1e-6)


def test_fused_reduction_chunk_of_no_rows_is_none() -> None:
    kernel = FusedKernel(x + 1, [np.float64], [(2,)])
    fused = FusedReduction(kernel, reduction("max", np.float64, (2,), axis=0))
    assert fused.chunk(np.empty((0, 2))) is None
    with pytest.raises(ValueError, match="zero-size array to reduction operation maximum"):
        fused.aggregate(None)


def test_fused_reduction_refuses_rowwise_reductions_and_epilogues() -> None:
    kernel = FusedKernel(x + 1, [np.float64], [(2,)])
    with pytest.raises(ValueError, match="pass it as the kernel's epilogue"):
        FusedReduction(kernel, reduction("sum", np.float64, (2,), axis=1))  # type: ignore[arg-type]
    with_epilogue = FusedKernel(
        x + 1, [np.float64], [(2,)], epilogue=reduction("sum", np.float64, (2,), axis=1)
    )
    with pytest.raises(ValueError, match="without an epilogue"):
        FusedReduction(with_epilogue, reduction("sum", np.float64, (), axis=0))  # type: ignore[arg-type]


def test_scratch_is_kept_between_calls_and_released_on_demand() -> None:
    kernel = FusedKernel(call(np.sqrt, x * 2 + 1), [np.float32], [(8,)], subblock_bytes=4096)
    assert kernel.scratch_bytes() == 0
    kernel.apply(np.ones((10, 8), np.float32))
    assert kernel.scratch_bytes() == 10 * 32  # sized to the first, small block
    kernel.apply(np.ones((1000, 8), np.float32))
    held = kernel.scratch_bytes()
    assert held == 128 * 32  # grown to one full sub-block, not to the block
    kernel.apply(np.ones((1000, 8), np.float32))
    assert kernel.scratch_bytes() == held
    assert kernel.release_scratch() == held
    assert kernel.scratch_bytes() == 0


def test_threads_share_a_kernel_with_their_own_scratch() -> None:
    expr = call(np.sqrt, x * 2 + 1) * y
    kernel = FusedKernel(expr, [np.float32, np.float32], [(8,), (1,)], subblock_bytes=2048)
    rng = np.random.default_rng(5)
    inputs = [
        (rng.random((3000, 8), dtype=np.float32), rng.random((3000, 1), dtype=np.float32))
        for _ in range(4)
    ]
    results: dict[int, np.ndarray] = {}
    start = threading.Barrier(4)

    def work(i: int) -> None:
        start.wait()
        for _ in range(5):
            results[i] = kernel.apply(*inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (a, b) in enumerate(inputs):
        assert _same_bits(results[i], evaluate(expr, a, b))
    assert kernel.scratch_bytes() == 4 * kernel.temp_bytes(3000)


def test_constant_row_vector_broadcasts_in_every_subblock() -> None:
    means = np.arange(8, dtype=np.float32)
    block = np.random.default_rng(6).random((999, 8), dtype=np.float32)
    expr = (x - means) / Const(means.reshape(1, 8) + 1)
    got = FusedKernel(expr, [np.float32], [(8,)], subblock_bytes=1000).apply(block)
    assert _same_bits(got, (block - means) / (means.reshape(1, 8) + 1))


def test_a_freed_register_serves_a_later_unrelated_operation() -> None:
    doubled = astype(x, np.float64) * 2  # float64 register r0, dead after the cast below
    narrowed = astype(doubled, np.float32)  # float32 register r1
    scaled = x * np.float64(3)  # reads only the input: takes the freed r0, no new register
    expr = narrowed + scaled
    kernel = FusedKernel(expr, [np.float32], [(4,)])
    assert kernel.temp_bytes(10**9) == kernel.sub_rows * 4 * (8 + 4)
    block = np.random.default_rng(7).random((100, 4), dtype=np.float32)
    assert _same_bits(kernel.apply(block), evaluate(expr, block))


# The wide view (row-vector constants) and the fixed cost of a call. Every result is
# compared bitwise with plain NumPy on the whole block; the path taken is pinned by making
# the other one fail.


def _only(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make every _Program run take ``path`` ("wide" or "narrow"): the other one fails."""
    other = "_run_narrow" if path == "wide" else "_run_wide"

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{other} ran; expected the {path} path")

    monkeypatch.setattr(fused._Program, other, refuse)


ROW_CONSTANT_CASES: list[tuple[tuple[int, ...], tuple[int, ...]]] = [
    ((8,), (8,)),
    ((8,), (1, 8)),
    ((3,), (3,)),
    ((2, 3), (3,)),  # broadcasts along the first trailing axis
    ((2, 3), (2, 1)),  # broadcasts along the last
    ((2, 3), (1, 3)),
    ((2, 3), (2, 3)),  # the full trailing shape
    ((2, 3), (1, 2, 3)),
    ((4, 1, 5), (1, 5)),
]


@pytest.mark.parametrize(("row_shape", "const_shape"), ROW_CONSTANT_CASES)
@pytest.mark.parametrize("subblock_bytes", [96, 4096, SUBBLOCK_BYTES])
def test_row_constants_take_the_wide_path_bitwise(
    monkeypatch: pytest.MonkeyPatch,
    row_shape: tuple[int, ...],
    const_shape: tuple[int, ...],
    subblock_bytes: int,
) -> None:
    rng = np.random.default_rng(20)
    m = rng.uniform(-2, 2, const_shape).astype(np.float32)
    s = rng.uniform(0.5, 2, const_shape).astype(np.float32)
    expr = (x - m) / s
    kernel = FusedKernel(expr, [np.float32], [row_shape], subblock_bytes=subblock_bytes)
    program = kernel._program
    if kernel.sub_rows == 1:  # a sub-block of one row has no room for a wide row
        assert program.fold == 1
        _only(monkeypatch, "narrow")
    else:
        assert program.fold > 1
        assert program.width == program.fold * math.prod(row_shape)
        _only(monkeypatch, "wide")
    fold, sub = program.fold, kernel.sub_rows
    # Fewer rows than a wide row, whole wide rows, remainders, several sub-blocks.
    for rows in sorted({1, fold - 1, fold, fold + 1, 2 * fold + 3, sub, sub + 1, 3 * sub + 7}):
        block = random_array(rng, np.dtype(np.float32), (rows, *row_shape))
        want = (block - m) / s
        assert _same_bits(kernel.apply(block), want), rows
        out = np.empty_like(want)
        assert kernel.apply(block, out=out) is out
        assert _same_bits(out, want), rows


@pytest.mark.parametrize(
    "dtype", [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64, bool]
)
def test_wide_path_keeps_numpys_dtypes_and_bits(
    monkeypatch: pytest.MonkeyPatch, dtype: Any
) -> None:
    rng = np.random.default_rng(21)
    dtype = np.dtype(dtype)
    row_shape = (2, 3)
    block = random_array(rng, dtype, (1000, *row_shape))
    ints = np.arange(6, dtype=np.int8).reshape(row_shape) % 3 + 1
    floats = np.linspace(-1.5, 2.5, 3).astype(np.float32)
    flags = np.array([True, False, True])
    exprs: list[Expr] = [
        x * ints + 1,  # strong int8 row vector: NumPy's promotion decides the dtype
        x - floats,  # float32 row vector
        where(flags, x, ints),  # boolean condition constant
        clip(x, ints - 2, ints + 2),  # bounds as row vectors
        astype(x, np.float64) * floats,
        call(np.maximum, x, ints) * call(np.minimum, x, floats),
    ]
    _only(monkeypatch, "wide")
    with np.errstate(all="ignore"):
        for expr in exprs:
            try:
                want = evaluate(expr, block)
            except TypeError:  # e.g. bool - float32 is not defined: nothing to compare
                continue
            kernel = FusedKernel(expr, [dtype], [row_shape], subblock_bytes=4096)
            assert kernel._program.fold > 1, expr
            got = kernel.apply(block)
            assert got.dtype == want.dtype
            assert _same_bits(got, want), (expr, dtype)


def test_blocks_that_are_not_c_contiguous_take_the_narrow_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(22)
    m = np.arange(8, dtype=np.float32)
    expr = (x - m) * y
    kernel = FusedKernel(expr, [np.float32, np.float32], [(8,), (8,)], subblock_bytes=4096)
    assert kernel._program.fold > 1
    _only(monkeypatch, "narrow")
    strided = rng.random((1000, 16), dtype=np.float32)[:, ::2]
    fortran = np.asfortranarray(rng.random((1000, 8), dtype=np.float32))
    plain = rng.random((1000, 8), dtype=np.float32)
    for a, b in [(strided, plain), (plain, fortran), (strided, fortran)]:
        assert _same_bits(kernel.apply(a, b), (a - m) * b)
    # A C-contiguous input with a strided output block: the output decides too.
    out = np.empty((1000, 16), np.float32)[:, ::2]
    kernel.apply(plain, plain, out=out)
    assert _same_bits(np.ascontiguousarray(out), (plain - m) * plain)


def test_no_wide_path_without_row_vectors_or_with_broadcasting_inputs() -> None:
    assert FusedKernel((x + 1) * 2, [np.float32], [(8,)])._program.fold == 1  # scalars
    assert FusedKernel(x * np.float32(2), [np.float32], [(8,)])._program.fold == 1
    assert FusedKernel(x * np.ones((1, 1)), [np.float32], [(8,)])._program.fold == 1
    m = np.arange(8.0)
    assert FusedKernel(x - m + y, [np.float64] * 2, [(8,), (1,)])._program.fold == 1
    assert FusedKernel(x - m, [np.float64], [(1,)])._program.fold == 1  # m widens the rows
    # Rows wider than half a wide row are wide enough already.
    assert FusedKernel(x - np.arange(9000.0), [np.float64], [(9000,)])._program.fold == 1
    assert FusedKernel(x - m, [np.float64], [(8,)])._program.fold > 1


def test_wide_path_feeds_epilogues_and_reductions_with_row_shaped_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(23)
    m = rng.random(8).astype(np.float32)
    expr = call(np.sqrt, x + m) * m
    data = rng.random((3000, 8), dtype=np.float32)
    evaluated = evaluate(expr, data)
    _only(monkeypatch, "wide")
    epilogue = reduction("max", np.float32, (8,), axis=1)
    kernel = FusedKernel(expr, [np.float32], [(8,)], epilogue=epilogue, subblock_bytes=4096)
    assert kernel._program.fold > 1
    assert _same_bits(kernel.apply(data), evaluated.max(axis=1))
    base = FusedKernel(expr, [np.float32], [(8,)], subblock_bytes=4096)
    for kind in ("sum", "mean", "var", "min", "argmax", "count_nonzero"):
        fused_op = FusedReduction(base, reduction(kind, np.float32, (8,), axis=0))
        got = run_blockwise(fused_op, data, 1100, rng)
        if kind in ("min", "argmax", "count_nonzero"):
            np.testing.assert_array_equal(got, getattr(np, kind)(evaluated, axis=0))
        else:
            oracle = getattr(np, kind)(evaluated.astype(np.float64), axis=0)
            np.testing.assert_allclose(got, oracle.astype(np.float32), rtol=4e-7)


def test_many_block_sizes_reuse_bounded_caches() -> None:
    m = np.arange(3, dtype=np.float64)
    kernel = FusedKernel(x * m + 1, [np.float64], [(3,)], subblock_bytes=512)
    fold = kernel._program.fold
    data = np.random.default_rng(24).random((5 * fold + 100, 3))
    for rows in range(1, 5 * fold + 100, 3):  # more sizes than the caches keep
        assert _same_bits(kernel.apply(data[:rows]), data[:rows] * m + 1), rows
    assert len(kernel._program._tails) <= fused._CACHED_VIEWS
    held = kernel._scratch.get(1)
    assert len(held._views) <= fused._CACHED_VIEWS


def test_threads_share_a_wide_kernel() -> None:
    m = np.arange(8, dtype=np.float32)
    kernel = FusedKernel((x - m) * 3, [np.float32], [(8,)], subblock_bytes=2048)
    rng = np.random.default_rng(25)
    blocks = [rng.random((rows, 8), dtype=np.float32) for rows in (1000, 777, 64, 3001)]
    results: dict[int, list[np.ndarray]] = {}
    start = threading.Barrier(len(blocks))

    def work(i: int) -> None:
        start.wait()
        results[i] = [kernel.apply(blocks[i]) for _ in range(5)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(blocks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, block in enumerate(blocks):
        for got in results[i]:
            assert _same_bits(got, (block - m) * 3)


def test_a_call_checks_its_blocks_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = fused.check_blocks

    def counting(blocks: Any, dtypes: Any, row_shapes: Any, what: str) -> int:
        calls.append(what)
        return real(blocks, dtypes, row_shapes, what)

    monkeypatch.setattr(fused, "check_blocks", counting)
    monkeypatch.setattr(reductions, "check_blocks", counting)
    data = np.random.default_rng(26).random((5000, 8), dtype=np.float32)
    kernel = FusedKernel(call(np.sqrt, x + 1), [np.float32], [(8,)], subblock_bytes=4096)
    for kind in ("sum", "argmin", "var"):
        calls.clear()
        op = FusedReduction(kernel, reduction(kind, np.float32, (8,), axis=0))
        op.chunk(data)  # 40 sub-blocks
        assert calls == ["FusedReduction"], kind


def test_where_casts_python_numbers_like_numpy() -> None:
    cond = np.array([[True, False, True]])
    block = np.array([[1, 2, 3]], np.uint8)
    for a, b in [(-1, x), (x, 300), (-1, 3.5)]:
        expr = where(Input(1), a, b)
        want = evaluate(expr, block, cond)
        kernel = FusedKernel(expr, [np.uint8, bool], [(3,), (3,)])
        assert _same_bits(kernel.apply(block, cond), want)


def test_a_kernel_is_one_generated_function() -> None:
    kernel = FusedKernel(call(np.sqrt, x * 2 + 1), [np.float32], [(8,)])
    program = kernel._program
    assert [s.fn for s in program.steps] == [np.multiply, np.add, np.sqrt]
    assert program._consts == [2, 1]
    held = kernel._scratch.get(4)
    block = np.arange(32, dtype=np.float32).reshape(4, 8)
    out = np.empty_like(block)
    program._function((block,), held.narrow(4), out, program._consts)
    assert _same_bits(out, np.sqrt(block * 2 + 1))
