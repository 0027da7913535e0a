"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierflow.engine.io import cache as cache_module
from tierflow.engine.runtime.executors import use_executor
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


EXECUTORS = ("threads", "serial", "processes")
CLUSTERS = ("dask", "ray")  # by default, only for tests whose marker names them
# TIERFLOW_TEST_EXECUTORS=processes (a comma-separated list) runs the engine's tests on
# those executors only; naming a cluster there runs every engine test on it
# (TIERFLOW_TEST_EXECUTORS=dask: the whole engine suite on the Dask LocalCluster).
_ASKED = os.environ.get("TIERFLOW_TEST_EXECUTORS")
_CHOSEN = [
    n for n in (_ASKED or ",".join(EXECUTORS + CLUSTERS)).split(",") if n in EXECUTORS + CLUSTERS
]
_UNMARKED = _CHOSEN if _ASKED else [n for n in _CHOSEN if n in EXECUTORS]
# The session fixture each cluster executor needs running.
_RUNTIMES = {"dask": "dask_client", "ray": "ray_runtime"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every engine test runs on each local executor: threads, serial and worker
    processes; ``@pytest.mark.executors("threads")`` names the ones a test is about,
    and only a test whose marker names ``"dask"`` or ``"ray"`` runs on a cluster."""
    if "executor_name" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("executors")
    names = [n for n in _CHOSEN if n in marker.args] if marker is not None else _UNMARKED
    metafunc.parametrize("executor_name", names, indirect=True)


@pytest.fixture(autouse=True)
def executor_name(request: pytest.FixtureRequest) -> Iterator[str]:
    """The default executor of the test's computes (see pytest_generate_tests); a
    cluster's session runtime is started first."""
    runtime = _RUNTIMES.get(request.param)
    if runtime is not None:
        request.getfixturevalue(runtime)
    with use_executor(request.param):
        yield request.param
