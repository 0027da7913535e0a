"""A cluster without a shared disk: each Dask worker has a spill folder of its own, and
blocks that come back to the driver travel through object storage (the local S3
server) named by ``shared_dir="s3://..."``, then are removed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

import tierflow as tw
from tierflow import config
from tierflow.engine.runtime.executors import DaskExecutor
from tierflow.errors import BlockError
from tierflow.storage import intermediates

pytest.importorskip("distributed")
pytest.importorskip("s3fs")

from common import separate_disk_cluster, wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHARED = "s3://tierflow/shared"


@pytest.fixture(scope="module")
def separate_disks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, list[Path]]]:
    """Two Dask workers (one thread each), each with a spill folder of its own and no
    folder they share; the client and the spill folders."""
    base = tmp_path_factory.mktemp("nodes")
    spills = [base / f"node{i}" / "spill" for i in range(2)]
    with separate_disk_cluster(spills) as client:
        yield client, spills


def _left(options: dict[str, Any]) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.invalidate_cache()
    return fs.find("tierflow/shared")


def _blocks_in(*folders: Path) -> list[str]:
    return [str(p) for f in folders if f.exists() for p in f.rglob("*") if ".tf-block-" in p.name]


def _fails_on_block_three(block: np.ndarray) -> np.ndarray:
    if block[0, 0] == 3.0:
        raise ValueError("block three is bad")
    return block * 2


@pytest.mark.executors("dask")
def test_held_blocks_travel_through_object_storage_and_none_is_left(
    separate_disks: tuple[Any, list[Path]],
    s3_server: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, spills = separate_disks
    config.set(shared_dir=SHARED, shared_options=s3_server)
    taken: list[str] = []
    read = intermediates.read_npy
    monkeypatch.setattr(intermediates, "read_npy", lambda p: taken.append(p) or read(p))
    values = np.random.default_rng(5).random((200_000, 4))
    np.save(tmp_path / "x.npy", values)
    x = tw.from_npy(tmp_path / "x.npy", rows=20_000)
    executor = DaskExecutor(client)
    try:
        # blocks after a mask are held by the driver: ~320 KB each, over 64 KB
        got = (x[x[:, 0] > 0.5] * 2).compute(executor=executor)
        np.testing.assert_array_equal(got, values[values[:, 0] > 0.5] * 2)
        assert len(taken) >= 10 and all(p.startswith(f"{SHARED}/.tf-block-") for p in taken)
        assert _left(s3_server) == []
        # a compute that fails half-way leaves nothing there either
        ones = tw.from_array(np.repeat(np.arange(10.0), 20_000)[:, None] * np.ones(4), rows=20_000)
        with pytest.raises(BlockError, match="block three is bad"):
            ones.map_blocks(_fails_on_block_three).compute(executor=executor)
        wait_for(lambda: _left(s3_server) == [], 60.0, "the failed compute's blocks removed")
    finally:
        executor.close()
    assert _blocks_in(*spills, Path(config.get("spill_dir"))) == []


def _runs_seen(folder: str, options: dict[str, Any]) -> Any:
    """A block function that notes, from the worker running the merge, the sort runs
    in object storage at that moment (a line per call in ``folder/seen``)."""

    def note(block: np.ndarray) -> np.ndarray:
        import s3fs

        fs = s3fs.S3FileSystem(**options)
        fs.invalidate_cache()
        runs = [p for p in fs.find("tierflow/shared") if "/.tf-sort-" in p]
        with open(Path(folder) / "seen", "a") as f:
            f.write(f"{len(runs)}\n")
        return block

    return note


@pytest.mark.executors("dask")
def test_sorts_merge_runs_from_object_storage_on_nodes_with_separate_disks(
    separate_disks: tuple[Any, list[Path]], s3_server: dict[str, Any], tmp_path: Path
) -> None:
    client, spills = separate_disks
    config.set(shared_dir=SHARED, shared_options=s3_server)
    rng = np.random.default_rng(11)
    values = rng.integers(0, 1000, (24_000, 3)).astype(np.float32)  # ties: a stable merge
    np.save(tmp_path / "v.npy", values)
    x = tw.from_npy(tmp_path / "v.npy", rows=4_000)  # 6 runs
    executor = DaskExecutor(client)
    try:
        cases = {
            "sort": (lambda: np.sort(x, axis=0), np.sort(values, axis=0, kind="stable")),
            "argsort": (
                lambda: np.argsort(x, axis=0, kind="stable"),
                np.argsort(values, axis=0, kind="stable"),
            ),
            "sort_rows": (
                lambda: tw.sort_rows(x, by=1),
                values[np.argsort(values[:, 1], kind="stable")],
            ),
        }
        # the runs were in the bucket for each of the 6 merge blocks (the function is
        # called once more, in the driver, on a stand-in block before anything runs)
        seen = np.sort(x, axis=0).map_blocks(_runs_seen(str(tmp_path), s3_server))
        np.testing.assert_array_equal(seen.compute(executor=executor), cases["sort"][1])
        counts = [int(n) for n in (tmp_path / "seen").read_text().split()]
        assert sum(c >= 6 for c in counts) >= 6, counts
        for name, (make, expected) in cases.items():
            np.testing.assert_array_equal(make().compute(executor=executor), expected, name)
            assert _left(s3_server) == [], name
        top = tw.topk(x[:, 0], 5).compute(executor=executor)
        np.testing.assert_array_equal(np.sort(top), np.sort(values[:, 0])[-5:])
        # the other whole-array operations, on the same nodes
        found = tw.compute(
            np.unique(x[:, 1]),
            np.quantile(x, [0.1, 0.5, 0.9], axis=0),
            x.T @ x,
            executor=executor,
        )
        np.testing.assert_array_equal(found[0], np.unique(values[:, 1]))
        np.testing.assert_allclose(found[1], np.quantile(values, [0.1, 0.5, 0.9], axis=0))
        np.testing.assert_allclose(found[2], values.T.astype("f8") @ values, rtol=1e-5)
        assert _left(s3_server) == []
    finally:
        executor.close()
    assert _blocks_in(*spills) == []
    assert not [p for s in spills if s.exists() for p in s.rglob("sort-*")]


@pytest.mark.executors("dask")
def test_the_other_whole_array_operations_and_sinks_on_nodes_with_separate_disks(
    separate_disks: tuple[Any, list[Path]], s3_server: dict[str, Any], tmp_path: Path
) -> None:
    # value_counts, cov, QR and SVD, persist, to_zarr into the bucket and the cache, on
    # workers that share no folder, give the threads executor's answers.
    pytest.importorskip("zarr")
    client, spills = separate_disks
    config.set(shared_dir=SHARED, shared_options=s3_server)
    rng = np.random.default_rng(13)
    values = rng.integers(0, 50, (12_000, 3)).astype(np.float64) + rng.random((12_000, 3))
    values[:, 2] = np.round(values[:, 2])  # repeats for value_counts
    np.save(tmp_path / "v.npy", values)
    x = tw.from_npy(tmp_path / "v.npy", rows=2_000)
    executor = DaskExecutor(client)
    try:
        for name, make in {
            "value_counts": lambda: tw.value_counts(x[:, 2]),
            "cov": lambda: (np.cov(x, rowvar=False),),
            "qr": lambda: tuple(tw.linalg.qr(x)),
            "svd": lambda: tuple(tw.linalg.svd(x, full_matrices=False)),
        }.items():
            there = tw.compute(*make(), executor=executor)
            here = tw.compute(*make(), executor="threads")
            for a, b in zip(there, here, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9, err_msg=name)
        kept = (x * 2).persist(executor=executor)
        np.testing.assert_array_equal(kept.compute(executor="threads"), values * 2)
        url = "s3://tierflow/out/y.zarr"
        (x + 1).to_zarr(url, storage_options=s3_server, executor=executor)
        back = tw.from_zarr(url, storage_options=s3_server).compute(executor="threads")
        np.testing.assert_array_equal(back, values + 1)
        # the cache store in the bucket too: the workers write the blocks there and
        # read them back (signed with the driver's key, which travels with the store)
        cache = "s3://tierflow/cluster-cache"
        first = (x * 3).cache(cache).sum(axis=0).compute(executor=executor)
        written = tw.cache_info(cache)["cluster-cache"]
        assert (written.writes, written.entries) == (6, 6)  # the marked node's 6 blocks
        again = (x * 3).cache(cache).sum(axis=0).compute(executor=executor)
        assert tw.cache_info(cache)["cluster-cache"].hits == 6
        blocks = (x * 3).cache(cache).compute(executor=executor)
        assert tw.cache_info(cache)["cluster-cache"].hits == 12
        np.testing.assert_array_equal(blocks, values * 3)
        np.testing.assert_allclose(first, (values * 3).sum(axis=0))
        # the re-run sums the kept blocks, the first summed x * 3 in one fused kernel:
        # the same values, added in another order
        np.testing.assert_allclose(again, first, rtol=1e-12)
        assert _left(s3_server) == []
    finally:
        executor.close()
    assert _blocks_in(*spills) == []
