"""Fixtures shared by the engine's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierflow.engine import cache as cache_module
from tierflow.system import budget


@pytest.fixture(autouse=True)
def _fresh_cache_handles() -> Iterator[None]:
    """Every test opens its caches afresh: no store handle outlives a test."""
    cache_module.close_all()
    yield
    cache_module.close_all()


@pytest.fixture(autouse=True)
def _budget_given_back() -> Iterator[None]:
    """Every compute gives back what it admitted, whether it finished or failed."""
    yield
    assert (budget.ledger.running, budget.ledger.held) == (0, 0)


@pytest.fixture
def src(tmp_path: Path, data: np.ndarray) -> Path:
    """The module's ``data`` saved as ``src.npy`` in the test's folder."""
    path = tmp_path / "src.npy"
    np.save(path, data)
    return path
