"""Fixtures of the store tests: stores in temporary folders, closed after each test, and
a pressure registry of their own."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierflow.storage.store import Store
from tierflow.system import pressure as pressure_mod

# The package exports the decorator under the module's name: reach the module itself.
cached_mod = importlib.import_module("tierflow.storage.store.cached")


@pytest.fixture(autouse=True)
def _own_pressure_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Stores subscribe on open; each test gets an empty subscriber table at ``ok``, and
    @cached's table of shared stores starts empty."""
    monkeypatch.setattr(pressure_mod, "_subscribers", {})
    monkeypatch.setattr(cached_mod, "_shared", {})
    pressure_mod.reset()
    yield
    pressure_mod.reset()
    for st in cached_mod._shared.values():
        st.close()


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    """``make_store(name="s", **kwargs)`` opens a store under ``tmp_path``; all are
    closed at the end of the test."""
    opened: list[Store] = []

    def make(name: str = "s", **kwargs: Any) -> Store:
        st = Store(tmp_path / name, **kwargs)
        opened.append(st)
        return st

    yield make
    for st in opened:
        st.close()
