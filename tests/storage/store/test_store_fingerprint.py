"""Fingerprints of functions and of arguments by value."""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tierflow.storage import identity
from tierflow.storage.store.fingerprint import call_digest, function_identity, value_digest

from common import examples


def compile_function(source: str, name: str = "f") -> Any:
    namespace: dict[str, Any] = {"__name__": "demo"}
    exec(compile(source, "<demo>", "exec"), namespace)
    return namespace[name]


def test_identity_names_module_qualname_and_code() -> None:
    f = compile_function("def f(x):\n    return x + 1\n")
    assert re.fullmatch(r"demo\.f@[0-9a-f]{16}", function_identity(f))


@pytest.mark.parametrize(
    "edited",
    [
        "def f(x):\n    return x + 2\n",  # a constant
        "def f(x):\n    return x - 1\n",  # an operator
        "def f(x):\n    return abs(x) + 1\n",  # a global name
        "def f(x):\n    g = lambda y: y * 2\n    return g(x) + 1\n",  # a nested function
        "def f(y):\n    return y + 1\n",  # an argument name
    ],
)
def test_an_edited_body_changes_the_identity(edited: str) -> None:
    original = function_identity(compile_function("def f(x):\n    return x + 1\n"))
    assert function_identity(compile_function(edited)) != original


def test_nested_code_is_hashed_recursively() -> None:
    a = compile_function("def f(x):\n    return [v * 2 for v in x]\n")
    b = compile_function("def f(x):\n    return [v * 3 for v in x]\n")
    assert function_identity(a) != function_identity(b)


def test_moving_a_function_keeps_its_identity() -> None:
    a = compile_function("def f(x):\n    return x + 1\n")
    b = compile_function("\n\n\n# a comment\ndef f(x):\n    return x + 1\n")
    assert function_identity(a) == function_identity(b)


def test_wrapped_functions_are_looked_through() -> None:
    def deco(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            return fn(*args)

        return wrapper

    a = deco(compile_function("def f(x):\n    return x + 1\n"))
    b = deco(compile_function("def f(x):\n    return x + 2\n"))
    assert function_identity(a) != function_identity(b)


HELPED = "SCALE = {}\ndef helper(x):\n    return x * SCALE\ndef f(x):\n    return helper(x) + 1\n"


def test_identity_follows_helpers_and_the_globals_they_read() -> None:
    base = function_identity(compile_function(HELPED.format(2)))
    assert function_identity(compile_function(HELPED.format(2))) == base, "defined again"
    edited_helper = HELPED.format(2).replace("x * SCALE", "x * SCALE * SCALE")
    assert function_identity(compile_function(edited_helper)) != base
    assert function_identity(compile_function(HELPED.format(3))) != base


def test_identity_follows_closures_and_defaults() -> None:
    def make(k: float) -> Any:
        def f(x: float, offset: float = 0.0) -> float:
            return x * k + offset

        return f

    assert function_identity(make(1.0)) == function_identity(make(1.0))
    assert function_identity(make(1.0)) != function_identity(make(2.0))
    other_default = make(1.0)
    other_default.__defaults__ = (1.0,)
    assert function_identity(other_default) != function_identity(make(1.0))


def test_identity_is_the_engine_cache_rule() -> None:
    f = compile_function(HELPED.format(2))
    expected = identity.digest(identity.function_token(f))[:16]
    assert function_identity(f) == f"demo.f@{expected}"


def test_callables_without_code_are_refused() -> None:
    with pytest.raises(TypeError, match=r"needs a Python function to fingerprint; <built-in"):
        function_identity(len)


def digest(fn: Any, *args: Any, **kwargs: Any) -> bytes:
    return call_digest(inspect.signature(fn).bind(*args, **kwargs), fn.__name__)


def test_arguments_are_bound_by_signature() -> None:
    def f(a: Any, b: Any = 2, *rest: Any, c: Any = 3, **extra: Any) -> None: ...

    assert digest(f, 1) == digest(f, 1, 2) == digest(f, a=1, b=2) == digest(f, 1, c=3)
    assert digest(f, 1, x=1, y=2) == digest(f, 1, y=2, x=1)
    assert digest(f, 1) != digest(f, 1, 3)
    assert digest(f, 1, 2, 9) != digest(f, 1, 2)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (1, 1.0),
        (1, True),
        (1, "1"),
        ("1", b"1"),
        ((1, 2), [1, 2]),
        (0.0, -0.0),
        ({1: 2}, {2: 1}),
        ({"a": (1,)}, {"a": [1]}),
        (np.float32(1), np.float64(1)),
        (np.arange(3), np.arange(3.0)),
        (np.arange(6).reshape(2, 3), np.arange(6).reshape(3, 2)),
        (None, 0),
        ({1, 2}, [1, 2]),
        (("ab", "c"), ("a", "bc")),
    ],
)
def test_types_and_values_are_told_apart(a: Any, b: Any) -> None:
    assert value_digest(a) != value_digest(b)


def test_dicts_and_sets_do_not_depend_on_order() -> None:
    assert value_digest({"a": 1, "b": 2}) == value_digest({"b": 2, "a": 1})
    assert value_digest({3, 1, 2}) == value_digest({2, 3, 1})


def test_arrays_hash_by_value_whatever_their_layout() -> None:
    c = np.arange(12.0).reshape(3, 4)
    assert value_digest(c) == value_digest(np.asfortranarray(c))
    assert value_digest(c[:, ::2]) == value_digest(np.ascontiguousarray(c[:, ::2]))
    assert value_digest(c) != value_digest(c + 1e-12)


@settings(max_examples=examples(30), deadline=None)
@given(hnp.arrays(hnp.scalar_dtypes(), hnp.array_shapes(min_dims=0, max_dims=3, max_side=4)))
def test_an_array_and_its_copy_agree(arr: np.ndarray) -> None:
    assert value_digest(arr) == value_digest(arr.copy())


def test_structured_dtypes_include_field_names() -> None:
    a = np.zeros(2, dtype=[("x", "<i4")])
    b = np.zeros(2, dtype=[("y", "<i4")])
    assert value_digest(a) != value_digest(b)


@pytest.mark.parametrize(
    ("value", "where", "kind"),
    [
        (object(), "argument 'x'", "builtins.object"),
        ([1, {"k": object()}], r"argument 'x'\[1\]\['k'\]", "builtins.object"),
        ({object(): 1}, r"argument 'x' \(a key\)", "builtins.object"),
        (np.array([None]), "argument 'x' is a NumPy array of dtype object", ""),
    ],
)
def test_unsupported_arguments_name_the_argument_and_type(
    value: Any, where: str, kind: str
) -> None:
    def f(x: Any) -> None: ...

    with pytest.raises(TypeError, match=rf"@cached f\(\): {where}.*{re.escape(kind)}"):
        digest(f, value)


def test_self_containing_values_are_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(TypeError, match="nested more than 64 levels deep"):
        value_digest(loop)


@given(
    st.recursive(
        st.integers() | st.text() | st.floats(allow_nan=False),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=8,
    )
)
@settings(max_examples=examples(50), deadline=None)
def test_equal_plain_values_hash_equal(value: Any) -> None:
    import copy

    assert value_digest(value) == value_digest(copy.deepcopy(value))
