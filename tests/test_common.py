"""The test suite's own helpers and hypothesis profiles (tests/common.py, conftest.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
from hypothesis import settings

from tierflow.system import limits

from common import count_in, counting_into, examples, fixed_memory, wait_for


def test_ci_profile_is_derandomised_without_a_database() -> None:
    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.database is None


def test_examples_scale_with_the_fuzz_profile() -> None:
    assert examples(30, settings.get_profile("fuzz")) == 600
    assert examples(30, settings.get_profile("ci")) == 30
    assert examples(30, settings.get_profile("default")) == 30


def test_wait_for_returns_once_the_condition_holds_and_fails_after_the_timeout() -> None:
    ready = threading.Event()
    threading.Timer(0.05, ready.set).start()
    wait_for(ready.is_set, timeout=5)
    assert ready.is_set()
    with pytest.raises(AssertionError, match=r"pages resident not met within 0\.1 s"):
        wait_for(lambda: False, timeout=0.1, what="pages resident")


def test_a_counting_function_counts_its_blocks_in_the_folder_even_as_a_copy(
    tmp_path: Path,
) -> None:
    work = counting_into(str(tmp_path))
    assert count_in(tmp_path) == 0
    np.testing.assert_array_equal(work(np.ones(3)), np.full(3, 3.0))
    copy = cloudpickle.loads(cloudpickle.dumps(work))  # as a worker process gets it
    copy(np.ones(2))
    assert count_in(tmp_path) == 2


def test_fixed_memory_figures_are_what_read_memory_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    figures = fixed_memory(monkeypatch)
    assert limits.read_memory().usable == 8 << 30
    figures["free"] = 1 << 30
    assert limits.read_memory().free == 1 << 30
