"""Floating-point warnings and errors of fused kernels and built-in operators name the
line of user code that built the operation (tierflow.engine.program.float_errors), on every
executor; the errstate in force around compute() is the one that applies."""

from __future__ import annotations

import re
import sys
import traceback
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

import tierflow as tw
from tierflow.operators import fused

HERE = __file__


def _line() -> int:
    """The caller's line number."""
    return sys._getframe(1).f_lineno


@pytest.fixture
def caught() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning, each time it is issued."""
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        yield found


def _float_warnings(caught: list[warnings.WarningMessage]) -> list[tuple[str, int, str]]:
    return sorted(
        (w.filename, w.lineno, str(w.message))
        for w in caught
        if issubclass(w.category, RuntimeWarning) and "encountered in" in str(w.message)
    )


def _blocks(values: np.ndarray) -> tw.Array:
    """``values`` as a lazy array of several blocks (3 rows each)."""
    return tw.from_array(values, rows=3)


def _with_a_zero() -> tw.Array:
    return _blocks(np.arange(40, dtype=np.float64).reshape(10, 4))  # only [0, 0] is 0


@pytest.mark.executors("threads", "serial", "processes", "dask", "ray")
@pytest.mark.parametrize("result", ["blocks", "reduction"])
def test_a_warning_in_a_fused_kernel_names_the_line_that_built_the_operation(
    result: str, caught: list[warnings.WarningMessage]
) -> None:
    x = _blocks(np.arange(-4, 36, dtype=np.float64).reshape(10, 4))
    y = x * 2
    built = _line() + 1
    z = np.log(y + 0)
    (z.sum(axis=0) if result == "reduction" else z).compute()
    assert _float_warnings(caught) == [
        (HERE, built, "divide by zero encountered in log"),
        (HERE, built, "invalid value encountered in log"),
    ]  # once each, though four blocks raised them
    assert not [w for w in caught if w.filename in (fused.KERNEL_FILENAME, "<string>")]


def test_the_warning_names_the_operation_that_raised_it_not_the_end_of_the_kernel(
    caught: list[warnings.WarningMessage],
) -> None:
    x = _with_a_zero()
    divided = _line() + 1
    a = 1.0 / x
    b = np.sqrt(a + 1)
    b.compute()
    assert _float_warnings(caught) == [(HERE, divided, "divide by zero encountered in divide")]


def test_each_warning_is_shown_once_per_compute(caught: list[warnings.WarningMessage]) -> None:
    built = _line() + 1
    z = np.log(_with_a_zero())
    z.compute()
    z.compute()
    assert _float_warnings(caught) == [(HERE, built, "divide by zero encountered in log")] * 2


def test_a_built_in_reduction_names_the_line_that_built_it(
    caught: list[warnings.WarningMessage],
) -> None:
    x = _blocks(np.full((10, 3), 1e308))
    built = _line() + 1
    total = x.sum(axis=0)
    np.testing.assert_array_equal(total.compute(), np.full(3, np.inf))
    [(filename, lineno, message)] = _float_warnings(caught)
    assert (filename, lineno) == (HERE, built)
    assert message.startswith("overflow encountered in sum")


def test_a_numpy_function_of_a_reductions_value_names_the_line_that_applied_it(
    caught: list[warnings.WarningMessage],
) -> None:
    smallest = _with_a_zero().min(axis=0)
    built = _line() + 1
    logs = np.log(smallest)
    assert logs.compute()[0] == -np.inf
    assert _float_warnings(caught) == [(HERE, built, "divide by zero encountered in log")]


def _log_of(block: np.ndarray) -> np.ndarray:
    return np.log(block)


def test_a_user_function_warns_at_its_own_line_as_numpy_does(
    caught: list[warnings.WarningMessage],
) -> None:
    _with_a_zero().map_blocks(_log_of).compute()
    line = _log_of.__code__.co_firstlineno + 1
    # "always": NumPy's own warning each time the function meets the zero
    assert set(_float_warnings(caught)) == {(HERE, line, "divide by zero encountered in log")}


def test_the_error_filter_raises_the_warning_naming_the_users_line() -> None:
    built = _line() + 1
    z = np.log(_with_a_zero())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="divide by zero encountered in log") as info:
            z.compute()
    assert f"raised by the operation built at {HERE}:{built}" in info.value.__notes__


def test_a_module_filter_matches_the_users_module(caught: list[warnings.WarningMessage]) -> None:
    z = np.log(_with_a_zero())
    warnings.filterwarnings("ignore", module="elsewhere$")
    z.compute()
    assert len(_float_warnings(caught)) == 1
    warnings.filterwarnings("ignore", module=re.escape(__name__) + "$")
    np.log(_with_a_zero()).compute()
    assert len(_float_warnings(caught)) == 1  # the second compute's was ignored


def test_errstate_around_compute_applies_in_the_workers(
    caught: list[warnings.WarningMessage],
) -> None:
    z = np.log(_with_a_zero() - 1)  # divide by zero and invalid value
    with np.errstate(divide="ignore"):
        z.compute()
    assert [m for _, _, m in _float_warnings(caught)] == ["invalid value encountered in log"]
    with np.errstate(all="ignore"):
        z.compute()
    assert len(_float_warnings(caught)) == 1


def test_errstate_when_building_does_not_matter(caught: list[warnings.WarningMessage]) -> None:
    with np.errstate(all="ignore"):
        built = _line() + 1
        z = np.log(_with_a_zero())
    z.compute()
    assert _float_warnings(caught) == [(HERE, built, "divide by zero encountered in log")]


def test_errstate_raise_gives_numpys_error_naming_the_users_line_without_the_kernel() -> None:
    built = _line() + 1
    z = np.log(_with_a_zero()) * 2
    with np.errstate(divide="raise"), pytest.raises(FloatingPointError) as info:
        z.compute()
    assert str(info.value) == "divide by zero encountered in log"
    notes = info.value.__notes__
    assert f"raised by the operation built at {HERE}:{built}" in notes
    shown = traceback.format_exception(info.value)
    assert not [line for line in shown if fused.KERNEL_FILENAME in line or fused.__file__ in line]


@pytest.mark.executors("threads", "serial")  # a handler of the caller's stays in its process
def test_an_error_from_the_users_errstate_handler_names_the_users_line() -> None:
    def refuse(kind: str, flag: int) -> None:
        raise TypeError(f"no {kind} here")

    built = _line() + 1
    z = np.log(_with_a_zero())
    with np.errstate(divide="call", call=refuse), pytest.raises(TypeError, match="no divide"):
        z.compute()
    with np.errstate(divide="call", call=refuse), pytest.raises(TypeError) as info:
        z.compute()
    assert f"raised by the operation built at {HERE}:{built}" in info.value.__notes__


def test_a_ufunc_with_two_outputs_warns_only_for_the_data(
    caught: list[warnings.WarningMessage],
) -> None:
    # The outputs' dtypes are found on zeros, where np.divmod(0, 0) divides by zero.
    a = np.array([[7, -3], [5, 9]])
    x = tw.from_array(a, rows=1)
    quotient, remainder = tw.compute(*np.divmod(x, np.array([2, 4])))
    np.testing.assert_array_equal(quotient, a // [2, 4])
    np.testing.assert_array_equal(remainder, a % [2, 4])
    assert [str(w.message) for w in caught] == []
