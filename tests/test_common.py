"""The test suite's own helpers and hypothesis profiles (tests/common.py, conftest.py)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import settings

from common import examples, wait_for


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
