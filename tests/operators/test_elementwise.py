"""Expressions: building, validation, dtype inference against NumPy, keys."""

from __future__ import annotations

import numpy as np
import pytest

from tierflow.operators.elementwise import (
    Apply,
    Const,
    Input,
    astype,
    call,
    clip,
    evaluate,
    infer,
    input_count,
    result_dtype,
    round_,
    token,
    walk,
    where,
)

x = Input(0)
y = Input(1)


@pytest.mark.parametrize(
    ("build", "dtypes", "numpy"),
    [
        (lambda: x * 2.0, [np.float32], lambda a: a * 2.0),
        (lambda: x + 1, [np.int8], lambda a: a + 1),
        (lambda: x * np.float64(2), [np.float32], lambda a: a * np.float64(2)),
        (lambda: x / 2, [np.int32], lambda a: a / 2),
        (lambda: x + y, [np.int8, np.uint8], lambda a, b: a + b),
        (lambda: x + y, [bool, bool], lambda a, b: a + b),
        (lambda: x * 1.5, [np.int16], lambda a: a * 1.5),
        (
            lambda: call(np.add, x, x, dtype=np.float32),
            [np.int8],
            lambda a: np.add(a, a, dtype=np.float32),
        ),
        (
            lambda: where(call(np.greater, x, 0), x, 2.0),
            [np.float32],
            lambda a: np.where(a > 0, a, 2.0),
        ),
        (lambda: clip(x, 0, 200), [np.uint8], lambda a: np.clip(a, 0, 200)),
        (lambda: astype(x, np.int16), [np.float64], lambda a: a.astype(np.int16)),
        (lambda: round_(x, 2), [np.float16], lambda a: np.round(a, 2)),
        (lambda: call(np.less, x, 3), [np.float16], lambda a: np.less(a, 3)),
        (lambda: ~x, [np.uint8], lambda a: ~a),
        (lambda: call(np.power, x, 2), [np.int8], lambda a: np.power(a, 2)),
        (lambda: x // 2.0, [np.int64], lambda a: a // 2.0),
        (lambda: abs(x) % 3, [np.float16], lambda a: abs(a) % 3),
    ],
)
def test_result_dtype_is_numpys(build, dtypes, numpy) -> None:
    blocks = [np.ones((3,), dtype=d) for d in dtypes]
    assert result_dtype(build(), dtypes) == numpy(*blocks).dtype


def test_weak_python_scalars_follow_nep50() -> None:
    assert result_dtype(x * 2.0, [np.float32]) == np.float32
    assert result_dtype(x + 1, [np.uint8]) == np.uint8
    assert result_dtype(x * np.float64(2.0), [np.float32]) == np.float64


def test_python_integer_out_of_range_raises_at_build_time() -> None:
    with pytest.raises(OverflowError, match="Python integer 300 out of bounds for uint8"):
        result_dtype(x + 300, [np.uint8])


def test_unsupported_dtype_combination_raises_numpys_type_error() -> None:
    with pytest.raises(TypeError, match="invert"):
        result_dtype(~x, [np.float32])


def test_infer_row_shape_broadcasts_inputs_and_constants() -> None:
    means = np.arange(8, dtype=np.float32)
    inferred = infer((x - means) * y, [np.float32, np.float32], [(8,), (1,)])
    assert inferred.dtype == np.float32
    assert inferred.row_shape == (8,)
    assert infer(x - means.reshape(1, 8), [np.float64], [(8,)]).row_shape == (8,)


def test_infer_without_row_shapes_broadcasts_any_constant() -> None:
    assert infer(x + np.zeros((4, 5)), [np.int8]).row_shape == (4, 5)


def test_constant_that_does_not_broadcast_against_rows_is_refused() -> None:
    with pytest.raises(ValueError, match=r"shape \(3, 8\) does not broadcast against row blocks"):
        infer(x + np.zeros((3, 8)), [np.float32], [(8,)])
    with pytest.raises(ValueError, match="does not broadcast"):
        infer(x + np.zeros((1, 2, 8)), [np.float32], [(8,)])


def test_inputs_of_different_dimensions_are_refused() -> None:
    with pytest.raises(ValueError, match="same number of dimensions"):
        infer(x + y, [np.float32, np.float32], [(8,), ()])


def test_expression_without_input_is_refused() -> None:
    with pytest.raises(ValueError, match="reads no block input"):
        infer(Const(1.0) + 2, [np.float32])


def test_missing_input_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="reads input 1 but only 1 input dtype"):
        infer(x + y, [np.float32])


def test_call_refuses_what_is_not_an_elementwise_ufunc() -> None:
    with pytest.raises(TypeError, match="not a NumPy ufunc"):
        call(np.sum, x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="generalized ufunc"):
        call(np.matmul, x, x)
    with pytest.raises(TypeError, match="has 2 outputs"):
        call(np.divmod, x, 2)
    with pytest.raises(TypeError, match="takes 2 operand"):
        call(np.add, x)
    with pytest.raises(ValueError, match=r"keyword\(s\) out are not supported"):
        call(np.add, x, 1, out=None)


def test_const_copies_arrays_and_refuses_objects() -> None:
    source = np.arange(3.0)
    node = Const(source)
    source[0] = 99.0
    assert node.value[0] == 0.0
    assert not node.value.flags.writeable
    assert Const([1, 2]).value.dtype == np.int64
    with pytest.raises(TypeError, match="dtype object"):
        Const(np.array([object()]))


def test_python_scalars_stay_python_scalars() -> None:
    assert type(Const(2.0).value) is float
    assert type(Const(np.float32(2.0)).value) is np.float32


def test_operators_build_ufunc_nodes() -> None:
    cases = {
        np.add: x + 1,
        np.subtract: 1 - x,
        np.multiply: np.float32(2) * x,
        np.true_divide: x / 2,
        np.floor_divide: x // 2,
        np.remainder: x % 2,
        np.power: 2**x,
        np.bitwise_and: x & 1,
        np.bitwise_or: 1 | x,
        np.bitwise_xor: x ^ 1,
        np.left_shift: x << 1,
        np.right_shift: x >> 1,
        np.negative: -x,
        np.positive: +x,
        np.absolute: abs(x),
        np.invert: ~x,
    }
    for ufunc, node in cases.items():
        assert isinstance(node, Apply)
        assert node.ufunc is ufunc
    reflected = 1 - x
    assert isinstance(reflected, Apply)
    assert isinstance(reflected.args[0], Const)
    assert reflected.args[1] is x


def test_walk_lists_shared_nodes_once_operands_first() -> None:
    shared = x * 3
    expr = shared + call(np.sin, shared)
    order = walk(expr)
    assert sum(node is shared for node in order) == 1
    assert order.index(x) < order.index(shared) < order.index(expr)
    assert order[-1] is expr
    assert input_count(expr) == 1
    assert input_count(x + Input(2)) == 3


def test_evaluate_is_plain_numpy() -> None:
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    b = np.ones((3, 1), dtype=np.float32)
    shared = x * 3
    expr = where(call(np.greater, shared, 4), shared + y, clip(round_(shared / 7, 1), 0, 1))
    want = np.where(a * 3 > 4, a * 3 + b, np.clip(np.round(a * 3 / 7, 1), 0, 1))
    np.testing.assert_array_equal(evaluate(expr, a, b), want)
    with pytest.raises(ValueError, match="reads input 1 but 1 block"):
        evaluate(x + y, a)


def test_token_is_deterministic_and_content_sensitive() -> None:
    def build(value: float, means: np.ndarray) -> Apply:
        return call(np.sqrt, Input(0) * value + means)

    means = np.arange(4.0)
    assert token(build(2.0, means)) == token(build(2.0, means.copy()))
    assert token(build(2.0, means)) != token(build(3.0, means))
    assert token(build(2.0, means)) != token(build(2.0, means + 1))
    # A weak Python float and a strong NumPy float give different results, so different keys.
    assert token(Input(0) * 2.0) != token(Input(0) * np.float64(2.0))
    assert token(astype(x, np.int8)) != token(astype(x, np.int16))
