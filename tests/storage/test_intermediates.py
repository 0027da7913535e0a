"""Intermediates in a shared folder or in object storage (the local S3 server): written
under a temporary name and committed, read whole or by range, listed and removed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow import config
from tierflow.errors import ConfigError
from tierflow.storage import intermediates


@pytest.fixture(params=["folder", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "folder":
        return str(tmp_path / "shared")
    options = request.getfixturevalue("s3_server")
    config.set(shared_options=options)
    return f"s3://tierflow/{request.node.name.replace('[', '-').rstrip(']')}"


def test_a_block_is_committed_read_whole_and_by_range_then_removed(place: str) -> None:
    intermediates.makedirs(place)
    block = np.arange(3000, dtype=">f8").reshape(1000, 3)  # big-endian stays big-endian
    path = intermediates.write_npy(intermediates.join(place, ".tf-block-a-0"), block)
    assert path.endswith(".tf-block-a-0.npy")
    assert intermediates.listing(intermediates.join(place, ".tf-block-a-")) == [path]
    got = intermediates.read_npy(path)
    assert got.dtype == block.dtype
    np.testing.assert_array_equal(got, block)
    header = intermediates.read_range(path, 0, 6)
    assert header == b"\x93NUMPY"
    intermediates.remove(path)
    intermediates.remove(path)  # gone already is fine
    assert intermediates.listing(intermediates.join(place, ".tf-block-a-")) == []


def test_a_failed_write_leaves_nothing(place: str) -> None:
    intermediates.makedirs(place)
    stem = intermediates.join(place, ".tf-block-b-0")
    with pytest.raises(ValueError, match="Object arrays cannot be saved"):
        intermediates.write_npy(stem, np.array([object()], dtype=object))
    assert intermediates.listing(stem) == []


def test_remove_matching_removes_one_prefix_and_nothing_else(place: str) -> None:
    intermediates.makedirs(place)
    for k in range(2):
        intermediates.write_npy(intermediates.join(place, f".tf-block-c-{k}"), np.ones(4))
    other = intermediates.write_npy(intermediates.join(place, ".tf-block-d-0"), np.ones(4))
    intermediates.remove_matching(intermediates.join(place, ".tf-block-c-"))
    assert intermediates.listing(intermediates.join(place, ".tf-block-")) == [other]


def test_shared_options_come_from_the_environment_as_json(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIERFLOW_SHARED_OPTIONS", '{"endpoint_url": "http://127.0.0.1:1"}')
    config.reset()
    assert config.get("shared_options") == {"endpoint_url": "http://127.0.0.1:1"}
    with pytest.raises(ConfigError, match="is not JSON"):
        config.set(shared_options="endpoint_url=x")
    bad: Any = ["endpoint_url"]
    with pytest.raises(ConfigError, match="expected a dict of storage options"):
        config.set(shared_options=bad)
