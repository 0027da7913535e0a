"""Fixtures shared by the whole suite.

Every test runs with settings reset and with spill files and stores under its own
temporary folder, so nothing is written to ``~/.tierflow`` and tests do not see each
other's files.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tierflow import config
from tierflow.system import pressure


@pytest.fixture(autouse=True)
def _isolated_settings(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    base = tmp_path_factory.mktemp("tierflow-home")
    for variable in config.ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("TIERFLOW_SPILL_DIR", str(base / "spill"))
    monkeypatch.setenv("TIERFLOW_STORE_DIR", str(base / "store"))
    config.reset()
    pressure.reset()
    yield
    config.reset()
    pressure.reset()


@pytest.fixture
def tierflow_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh folder for tests that need their own spill or store root."""
    return tmp_path_factory.mktemp("tierflow-own")
