"""Fixtures shared by the whole suite.

Every test runs with settings reset and with spill files and stores under its own
temporary folder, so nothing is written to ``~/.tierflow`` and tests do not see each
other's files.

Hypothesis profiles, chosen with ``HYPOTHESIS_PROFILE`` (or ``--hypothesis-profile``):

- ``default``: hypothesis's own, fresh random examples on every run.
- ``ci``: derandomised (the examples follow from each test's name and code), no example
  database: ``.ci/run`` selects it, so a landing never depends on luck.
- ``fuzz``: fresh seeds and 20 times as many examples (``make fuzz``); a failure found
  is kept in ``.hypothesis/`` and tried first on the next run.
"""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from tierflow import config
from tierflow.engine.runtime.executors import close_cluster_executors
from tierflow.system import pressure

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("fuzz", max_examples=2000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _isolated_settings(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    base = tmp_path_factory.mktemp("tierflow-home")
    for variable in config.ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("TIERFLOW_SPILL_DIR", str(base / "spill"))
    monkeypatch.setenv("TIERFLOW_STORE_DIR", str(base / "store"))
    # Compiled kernels are shared by the session's tests: each compiles once.
    monkeypatch.setenv("TIERFLOW_KERNEL_DIR", str(tmp_path_factory.getbasetemp() / "kernels"))
    config.reset()
    pressure.reset()
    yield
    config.reset()
    pressure.reset()


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap() -> None:
    """Collect what earlier modules left, then freeze the heap (``gc.freeze``): the
    suite's process holds millions of objects (NumPy, torch, Dask, Ray, xarray and every
    earlier test's modules), and each full collection would walk them all. Tests that
    recover from an OOM run one per halving (:func:`tierflow.storage.oom.recover`), which
    cost about a second each late in the suite; now they walk only what the current
    module made. Objects frozen are still freed when their last reference goes."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def dask_client() -> Iterator[Any]:
    """A Dask distributed ``LocalCluster`` of 2 worker processes with 1 thread each, and
    its client, started once for the session."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    )
    client = Client(cluster)
    try:
        yield client
    finally:
        close_cluster_executors("dask")  # no thread of theirs reaches the closed client
        client.close()
        cluster.close()


@pytest.fixture(scope="session")
def ray_runtime() -> Iterator[Any]:
    """A local Ray runtime with 2 CPUs, started once for the session (the ``ray``
    module)."""
    import ray

    # Workers import the tests' modules (functions defined there pickle by reference).
    tests = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    # address="local": a runtime of its own, not one another test session (or a
    # `ray start`) left on the machine, which ray.init() would join.
    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    # ray.init installs its own SIGTERM handlers in this process (a Python one and
    # abseil's native one), and a child forked later inherits them: a fork pool's
    # terminate() then ran Ray's handlers in its workers, and one hung there (a lock
    # held at the fork), so the pool's join waited until the test timed out. The test
    # process needs neither; the runtime's own processes keep theirs.
    signal.signal(signal.SIGTERM, sigterm if sigterm is not None else signal.SIG_DFL)
    try:
        yield ray
    finally:
        # After ray.shutdown(), a call into Ray ends the process: the executors made on
        # this runtime stop first.
        close_cluster_executors("ray")
        ray.shutdown()


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt during the test, as Ctrl-C in a terminal does.

    A shell without job control starts a background command (``make test &``) with
    SIGINT ignored, and Python then installs no handler: a test that sends itself
    SIGINT would wait for an interrupt that never comes."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.fixture
def tierflow_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh folder for tests that need their own spill or store root."""
    return tmp_path_factory.mktemp("tierflow-own")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, Any]]:
    """An S3-compatible server on localhost (moto's server mode) with a bucket
    ``tierflow``; yields the ``storage_options`` s3fs needs to reach it."""
    from common import local_s3

    with local_s3("tierflow") as options:
        yield options
