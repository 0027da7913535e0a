"""@cached: results kept in a store, keyed by the function's code and its arguments."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow import config, memory
from tierflow.errors import StoreError
from tierflow.storage.store import CacheInfo, Store, StoreWarning, cached

cached_mod = importlib.import_module("tierflow.storage.store.cached")
ROOT = Path(__file__).resolve().parents[3]


@cached
def module_level_square(x: int) -> int:
    return x * x


class CallLog:
    """The arguments a function was called with. It pickles without them, so the
    function's identity (which covers the globals it names) does not follow the log."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def append(self, item: Any) -> None:
        self.items.append(item)

    def __eq__(self, other: object) -> bool:
        return self.items == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.items)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.items = []


def make_counted(source: str, **decorator: Any) -> tuple[Any, CallLog]:
    """Compile ``def f`` from source into module 'demo', decorated; and its call log."""
    calls = CallLog()
    namespace: dict[str, Any] = {"__name__": "demo", "calls": calls, "np": np}
    exec(compile(textwrap.dedent(source), "<demo>", "exec"), namespace)
    fn = namespace["f"]
    return (cached(**decorator)(fn) if decorator else cached(fn)), calls


SQUARE = """
def f(x, scale=1):
    calls.append(x)
    return {"v": x * x * scale}
"""


def test_results_are_kept_and_returned(tmp_path: Path) -> None:
    f, calls = make_counted(SQUARE)
    assert f(3) == {"v": 9} and f(3) == {"v": 9}
    assert calls == [3]
    assert f.cache_info() == CacheInfo(hits=1, misses=1, entries=1)
    assert f.store.path == Path(config.get("store_dir")) / "cached"


def test_results_survive_a_restart(tmp_path: Path) -> None:
    f, _ = make_counted(SQUARE)
    f(4)
    f.store.close()  # what the end of a process does
    cached_mod._shared.clear()
    g, calls_again = make_counted(SQUARE)  # the same function, defined again
    assert g(4) == {"v": 16}
    assert calls_again == [] and g.cache_info().hits == 1


def test_arguments_bind_by_signature(tmp_path: Path) -> None:
    f, calls = make_counted(SQUARE)
    f(2, 3)
    f(2, scale=3)
    f(x=2, scale=3)
    assert calls == [2]
    f(2)  # the default, 1: another call
    f(2, 1)
    assert calls == [2, 2]


def test_arrays_are_keyed_by_content() -> None:
    f, calls = make_counted("def f(a):\n    calls.append(1)\n    return a * 2\n")
    out = f(np.arange(5.0))
    assert f(np.arange(5.0)) is not out  # a hit: the stored copy
    np.testing.assert_array_equal(f(np.arange(5.0)), np.arange(5.0) * 2)
    assert calls == [1]
    f(np.arange(5.0) + 1)
    assert calls == [1, 1]
    hit = f(np.arange(5.0))
    assert not hit.flags.writeable


def test_an_edited_body_misses_and_clears_apart() -> None:
    old, old_calls = make_counted(SQUARE)
    old(5)
    new, new_calls = make_counted(SQUARE.replace("x * x", "x * x * x"))
    assert new(5) == {"v": 125} and new_calls == [5]
    assert old.identity != new.identity
    assert new.store is old.store  # one shared store
    new.cache_clear()
    assert new.cache_info() == CacheInfo(0, 0, 0)
    assert old.cache_info().entries == 1  # the other function's entries stay
    assert old(5) == {"v": 25} and old_calls == [5]


HELPED = """
from tierflow import memory


@memory.cached(store={store!r})
def f(x):
    return helper(x) + 1


def helper(x):
    return x * {factor}
"""


def test_an_edited_helper_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "tierflow_cached_helper_demo"
    source = tmp_path / f"{name}.py"
    store = str(tmp_path / "store")
    source.write_text(HELPED.format(store=store, factor=2))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # an edit within the same second
    try:
        mod = importlib.import_module(name)
        assert (mod.f(5), mod.f(5)) == (11, 11)
        assert mod.f.cache_info() == CacheInfo(hits=1, misses=1, entries=1)
        source.write_text(HELPED.format(store=store, factor=3))
        mod = importlib.reload(mod)
        assert mod.f(5) == 16, "the edited helper must miss"
        assert mod.f.cache_info() == CacheInfo(hits=0, misses=1, entries=1)
        source.write_text(HELPED.format(store=store, factor=2))
        mod = importlib.reload(mod)
        assert mod.f(5) == 11
        assert mod.f.cache_info().hits == 1, "the helper as it was hits again"
    finally:
        sys.modules.pop(name, None)


def test_unsupported_arguments_are_refused_before_the_call() -> None:
    f, calls = make_counted(SQUARE)
    with pytest.raises(TypeError, match=r"@cached f\(\): argument 'x' is a builtins\.object"):
        f(object())
    with pytest.raises(TypeError, match=r"argument 'scale'\[0\] is a builtins\.object"):
        f(1, scale=[object()])
    assert calls == []


def test_a_wrong_call_raises_like_the_function() -> None:
    f, _ = make_counted(SQUARE)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'x'"):
        f()


def test_exceptions_are_not_cached() -> None:
    f, calls = make_counted("def f(x):\n    calls.append(x)\n    raise ValueError(x)\n")
    for _ in range(2):
        with pytest.raises(ValueError):
            f(1)
    assert calls == [1, 1] and f.cache_info().entries == 0


def test_none_is_a_result_like_any_other() -> None:
    f, calls = make_counted("def f(x):\n    calls.append(x)\n")
    assert f(1) is None and f(1) is None
    assert calls == [1]


def test_a_result_that_cannot_be_stored_is_returned_with_a_warning() -> None:
    f, calls = make_counted("def f(x):\n    calls.append(x)\n    return lambda: x\n")
    with pytest.warns(StoreWarning, match=r"@cached f\(\): the result was not stored"):
        assert f(1)() == 1
    with pytest.warns(StoreWarning):
        f(1)
    assert calls == [1, 1]


def test_a_result_larger_than_the_store_is_returned_with_a_warning(tmp_path: Path) -> None:
    f, _ = make_counted("def f(n):\n    return np.zeros(n)\n", store=tmp_path / "c", disk_gb=1e-5)
    with pytest.warns(StoreWarning, match="more than the whole SSD tier"):
        assert f(10_000).shape == (10_000,)


def test_stores_can_be_named_given_or_passed(tmp_path: Path) -> None:
    f, _ = make_counted(SQUARE, store="features", ram_mb=1, disk_gb=2)
    assert not (Path(config.get("store_dir")) / "features").exists()  # opened lazily
    f(1)
    assert f.store.name == "features" and f.store.ram_limit == 1 << 20
    assert f.store.disk_limit == 2 << 30
    with Store(tmp_path / "mine") as mine:
        g, _ = make_counted(SQUARE, store=mine)
        g(2)
        assert g.store is mine and mine.count(g.identity) == 1
    with pytest.raises(StoreError, match="is closed"):
        g(3)


def test_decorator_misuse_is_explained() -> None:
    with pytest.raises(
        TypeError, match=r"@cached takes a function, got 'name'.*@cached\(store=...\)"
    ):
        cached("name")  # type: ignore[call-overload]

    def gen() -> Any:
        yield 1

    with pytest.raises(TypeError, match="cannot cache the generator function"):
        cached(gen)

    async def co() -> None: ...

    with pytest.raises(TypeError, match="cannot cache the coroutine function"):
        cached(co)


def test_methods_name_self_as_the_problem() -> None:
    class Model:
        @cached
        def predict(self, x: int) -> int:
            return x

    with pytest.raises(TypeError, match=r"argument 'self' is a .*Model, which cannot be hashed"):
        Model().predict(1)


def test_the_wrapper_looks_like_the_function() -> None:
    assert module_level_square.__name__ == "module_level_square"
    assert module_level_square.__wrapped__(3) == 9
    assert pickle.loads(pickle.dumps(module_level_square)) is module_level_square
    assert "module_level_square" in repr(module_level_square)


def test_memory_facade_exports_the_decorator() -> None:
    assert memory.cached is cached
    assert "cached" in memory.__all__ and "store" in memory.__all__


SCRIPT = """
import sys
from tierflow import memory

@memory.cached(store=sys.argv[1])
def slow(n):
    print("computing", n)
    return list(range(n))

assert slow(5) == [0, 1, 2, 3, 4]
assert slow(n=5) == [0, 1, 2, 3, 4]
print(tuple(slow.cache_info()))
"""


def test_results_survive_across_processes(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    runs = [
        subprocess.run(
            [sys.executable, str(script), str(tmp_path / "store")],
            capture_output=True,
            text=True,
            check=True,
            env=os.environ.copy(),
        ).stdout
        for _ in range(2)
    ]
    assert runs[0] == "computing 5\n(1, 1, 1)\n"
    assert runs[1] == "(2, 0, 1)\n"


def test_the_example_hits_on_its_second_run(tmp_path: Path) -> None:
    example = ROOT / "examples" / "cached_across_runs.py"
    command = [sys.executable, str(example), "--dir", str(tmp_path), "--seconds", "0.2"]
    first = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    second = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert "hits=0, misses=3" in first
    assert "hits=3, misses=0" in second
