"""Helpers shared by test modules: waiting on a condition, sizing property tests.

Importable from any test module as ``from common import wait_for, examples, Concurrency`` (``tests/``
is on ``sys.path``, as for ``cgroups``); the benchmarks put ``tests/`` there too for the
local clusters and servers (:func:`local_s3`, :func:`separate_disk_cluster`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import settings

from tierflow.engine.runtime.executors.cluster import ClusterExecutor
from tierflow.system import limits

# Hypothesis's own default, which the `ci` and `default` profiles keep.
_BASE_EXAMPLES = 100
GB = 1 << 30


def wait_for(condition: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:
    """Return as soon as ``condition()`` is true; AssertionError after ``timeout`` seconds.

    For events another thread or the kernel brings about (a watcher's reading, pages
    arriving in the page cache). ``what`` goes into the failure message.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout:.1f} s")
        time.sleep(0.005)


def examples(n: int, profile: settings | None = None) -> int:
    """``n`` hypothesis examples, scaled by ``profile`` (by default the loaded one).

    A test's own ``@settings(max_examples=...)`` overrides the profile's, so tests ask
    for ``examples(n)``: ``n`` under the `ci` and `default` profiles, ``n`` times as
    many as the `fuzz` profile has over hypothesis's default of 100 (see conftest.py).
    """
    chosen = profile or settings.default
    return max(1, n * chosen.max_examples // _BASE_EXAMPLES)


def counting_into(folder: str) -> Callable[[np.ndarray], np.ndarray]:
    """A block function, ``b * 2 + 1``, that records each block it computes in
    ``folder`` from whatever process runs it; :func:`count_in` reads the count."""

    def work(block: np.ndarray) -> np.ndarray:
        with open(os.path.join(folder, "calls"), "a") as f:
            f.write(".")
        return block * 2 + 1

    return work


def count_in(folder: str | os.PathLike[str]) -> int:
    """The blocks a :func:`counting_into` function computed in ``folder``."""
    path = os.path.join(folder, "calls")
    return os.stat(path).st_size if os.path.exists(path) else 0


def fixed_memory(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Fixed memory figures behind ``limits.read_memory`` (8 GB usable, 6 GB free, on
    the host); a test changes them in the dict it returns."""
    values: dict[str, object] = {
        "usable": 8 * GB,
        "free": 6 * GB,
        "source": "host",
        "cgroup_dir": None,
        "host_total": 8 * GB,
    }

    def read_memory(root: str | None = None) -> limits.MemoryFigures:
        return limits.MemoryFigures(**values)  # type: ignore[arg-type]

    monkeypatch.setattr(limits, "read_memory", read_memory)
    return values


class Concurrency:
    """A block function that records how many of its calls run at once (over every
    compute that uses it), sleeping ``pause`` seconds in each."""

    def __init__(self, pause: float = 0.02) -> None:
        self.pause = pause
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.calls = 0

    def __call__(self, b: np.ndarray) -> np.ndarray:
        with self.lock:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)
        time.sleep(self.pause)
        with self.lock:
            self.now -= 1
        return b * 2


class IdleCluster(ClusterExecutor):
    """A cluster executor whose attempts never end and never reach a worker: their
    handles are placeholders (for the driver's own rules: stragglers, caps)."""

    name = "idle"

    def _launch(self, pack: Any, stems: Any, cap: int | None, prefer: str | None) -> Any:
        return object()

    def _cancel(self, handles: Any) -> None:
        return None

    def _death(self, error: BaseException) -> Any:
        return None

    def _send_program(self, data: bytes) -> Any:
        return data

    def _probe(self, paths: Any) -> dict[str, list[str]]:
        return {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def local_s3(bucket: str, *, own_process: bool = False) -> Iterator[dict[str, Any]]:
    """An S3-compatible server on localhost (moto's server mode) with ``bucket`` made;
    yields the ``storage_options`` s3fs needs to reach it. ``own_process``: the server
    runs in a process of its own (a benchmark's driver then does not share its GIL with
    the server); otherwise on a thread of this process."""
    import boto3
    import s3fs

    port = _free_port()
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    proc: subprocess.Popen[bytes] | None = None
    server: Any = None
    if own_process:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    else:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
    try:
        client = boto3.client(
            "s3",
            endpoint_url=options["endpoint_url"],
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        for attempt in range(200):  # until the server answers
            try:
                client.create_bucket(Bucket=bucket)
                break
            except Exception:
                if attempt == 199:
                    raise
                time.sleep(0.05)
        s3fs.S3FileSystem.clear_instance_cache()
        yield options
    finally:
        if server is not None:
            server.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(10)


@contextlib.contextmanager
def separate_disk_cluster(spills: Sequence[Path]) -> Iterator[Any]:
    """A Dask cluster of one worker process (one thread) per folder of ``spills``, each
    with that folder as its spill folder and no folder the workers share, as nodes with
    disks of their own; yields its client (not the default client)."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    workers = {
        f"node{i}": {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "dashboard": False,
                "dashboard_address": ":0",
                "env": {"TIERFLOW_SPILL_DIR": str(spill)},
            },
        }
        for i, spill in enumerate(spills)
    }
    cluster = SpecCluster(
        workers=workers,
        scheduler={"cls": Scheduler, "options": {"dashboard": False, "dashboard_address": ":0"}},
        silence_logs=logging.CRITICAL,
    )
    client = Client(cluster, set_as_default=False)
    try:
        yield client
    finally:
        client.close()
        cluster.close()
