"""tierflow under xarray: the chunk manager found through its entry point, chunks along
the first axis, and labelled workflows that match xarray over NumPy."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

xr = pytest.importorskip("xarray")

import tierflow as tw  # noqa: E402
from tierflow.xarray import TierflowManager  # noqa: E402


def climate(days: int = 400, seed: int = 0) -> xr.Dataset:
    """Two float32 variables on (time, lat, lon), daily steps from 2000-01-01."""
    rng = np.random.default_rng(seed)
    time = pd.date_range("2000-01-01", periods=days, freq="D")
    shape = (days, 6, 8)
    return xr.Dataset(
        {
            "tas": (("time", "lat", "lon"), rng.normal(280, 5, shape).astype("f4")),
            "pr": (("time", "lat", "lon"), rng.gamma(2, 1, shape).astype("f4")),
        },
        coords={"time": time, "lat": np.linspace(-50, 50, 6), "lon": np.linspace(0, 350, 8)},
    )


def filled(values: np.ndarray, limit: int | None = None, backward: bool = False) -> np.ndarray:
    """Forward (or backward) fills along the first axis by pandas: xarray's own needs
    bottleneck or numbagg."""
    flat = pd.DataFrame(values.reshape(len(values), -1))
    flat = flat.bfill(limit=limit) if backward else flat.ffill(limit=limit)
    return flat.to_numpy().reshape(values.shape)


@pytest.fixture
def stored(tmp_path: Path) -> tuple[xr.Dataset, Path]:
    ds = climate()
    path = tmp_path / "climate.zarr"
    encoding = {v: {"chunks": (50, 6, 8)} for v in ds.data_vars}
    ds.to_zarr(path, encoding=encoding, consolidated=False)
    return ds, path


def open_tierflow(path: Path, **chunks: int) -> xr.Dataset:
    return xr.open_zarr(
        path, chunked_array_type="tierflow", chunks=chunks or {"time": 100}, consolidated=False
    )


def test_the_entry_point_is_found_by_xarray() -> None:
    from xarray.namedarray.parallelcompat import list_chunkmanagers

    found = list_chunkmanagers()
    assert isinstance(found["tierflow"], TierflowManager)


def test_chunks_run_along_the_first_axis_only() -> None:
    manager = TierflowManager()
    shape = (1000, 6, 8)
    assert manager.normalize_chunks((100, -1, -1), shape) == ((100,) * 10, (6,), (8,))
    assert manager.normalize_chunks({0: 300}, shape) == ((300, 300, 300, 100), (6,), (8,))
    assert manager.normalize_chunks(((600, 400), 6, 8), shape) == ((600, 400), (6,), (8,))
    # dimensions the user left out come with the stored chunks: merged without a word
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = manager.normalize_chunks((100, 3, 4), shape, previous_chunks=(50, 3, 4))
    assert got == ((100,) * 10, (6,), (8,))
    with pytest.warns(UserWarning, match="blocks along their first axis only"):
        got = manager.normalize_chunks((100, 2, -1), shape, previous_chunks=(50, 3, 8))
    assert got == ((100,) * 10, (6,), (8,))
    auto = manager.normalize_chunks("auto", shape, dtype=np.float32, previous_chunks=(50, 6, 8))
    assert sum(auto[0]) == 1000 and all(c % 50 == 0 for c in auto[0][:-1])
    with pytest.raises(ValueError, match="add up to 900, not the 1000 rows"):
        manager.normalize_chunks(((500, 400), -1, -1), shape)


def test_chunking_a_dimension_that_is_not_first_is_refused_with_the_transpose(
    tmp_path: Path,
) -> None:
    ds = climate(days=60)
    ds["tl"] = ds.tas.transpose("lat", "time", "lon")  # time second
    with pytest.raises(ValueError) as refused:
        ds.chunk({"time": 10}, chunked_array_type="tierflow")
    text = str(refused.value)
    assert "variable 'tl' ('lat', 'time', 'lon')" in text
    assert "ds['tl'].transpose('time', ...)" in text
    with pytest.raises(ValueError, match=r"da\.transpose\('time', \.\.\.\)"):
        ds.tl.chunk({"time": 10}, chunked_array_type="tierflow")
    # the transpose written as the error says runs, and matches
    fixed = ds.transpose("time", ...).chunk({"time": 10}, chunked_array_type="tierflow")
    assert fixed.tl.data.chunks[0] == (10,) * 6
    np.testing.assert_allclose(fixed.tl.mean("time").values, ds.tl.mean("time").values, 1e-6)
    # stored chunks along lat and time: asking time (second) only is refused as well
    path = tmp_path / "lat-first.zarr"
    ds[["tl"]].to_zarr(path, encoding={"tl": {"chunks": (3, 20, 8)}}, consolidated=False)
    with pytest.raises(ValueError, match="variable 'tl'"):
        open_tierflow(path, time=30)
    opened = xr.open_zarr(path, chunked_array_type="tierflow", chunks={}, consolidated=False)
    assert opened.tl.data.chunks[0] == (3, 3)  # in blocks of its first axis, as stored
    np.testing.assert_allclose(opened.tl.mean("time").values, ds.tl.mean("time").values, 1e-6)


def test_a_zarr_dataset_opens_lazily_in_row_blocks(stored: tuple[xr.Dataset, Path]) -> None:
    _, path = stored
    ds = open_tierflow(path, time=100)
    assert isinstance(ds.tas.data, tw.Array)
    assert ds.tas.data.chunks == ((100, 100, 100, 100), (6,), (8,))
    assert ds.chunks == {"time": (100, 100, 100, 100), "lat": (6,), "lon": (8,)}


def _workflows(lazy: xr.Dataset, out: Path) -> dict[str, tuple[xr.DataArray | xr.Dataset, Any]]:
    """Each workflow of docs/xarray.md on ``lazy``: its result, and how to make the
    yardstick from the same dataset in memory."""

    def log1p(a: np.ndarray) -> np.ndarray:
        return np.log1p(np.clip(a, 0, 5))

    (lazy - lazy.mean("time")).to_zarr(out, consolidated=False)
    return {
        "mean": (lazy.tas.mean("time"), lambda d: d.tas.mean("time")),
        "std": (lazy.tas.std("time"), lambda d: d.tas.std("time")),
        "quantile": (
            lazy.tas.quantile([0.1, 0.9], dim="time"),
            lambda d: d.tas.quantile([0.1, 0.9], dim="time"),
        ),
        "anomalies": (
            xr.open_zarr(out, consolidated=False),
            lambda d: (d.astype("f8") - d.astype("f8").mean("time")).astype("f4"),
        ),
        "monthly": (lazy.groupby("time.month").mean(), lambda d: d.groupby("time.month").mean()),
        "resample": (lazy.resample(time="1MS").mean(), lambda d: d.resample(time="1MS").mean()),
        "rolling": (lazy.tas.rolling(time=7).mean(), lambda d: d.tas.rolling(time=7).mean()),
        "ffill": (
            lazy.tas.where(lazy.pr > 1).tierflow.ffill("time"),
            lambda d: d.tas.where(d.pr > 1).copy(data=filled(d.tas.where(d.pr > 1).values)),
        ),
        "apply_ufunc": (
            xr.apply_ufunc(log1p, lazy.pr, dask="parallelized", output_dtypes=[np.float32]),
            lambda d: xr.apply_ufunc(log1p, d.pr),
        ),
        "where": (
            lazy.tas.where(lazy.pr > 2).mean("time"),
            lambda d: d.tas.where(d.pr > 2).mean("time"),
        ),
    }


@pytest.mark.parametrize("executor", ["threads", "processes", "dask"])
def test_every_workflow_matches_xarray_over_numpy_on_each_executor(
    stored: tuple[xr.Dataset, Path], tmp_path: Path, executor: str, request: pytest.FixtureRequest
) -> None:
    ds, path = stored
    watch = contextlib.nullcontext()
    if executor == "dask":  # on the session's LocalCluster, whose task stream shows it
        from distributed import get_task_stream

        watch = get_task_stream(request.getfixturevalue("dask_client"))
    with tw.use_executor(executor), watch as tasks:
        cases = _workflows(open_tierflow(path, time=100), tmp_path / "anomalies.zarr")
        for name, (got, expected) in cases.items():
            assert got.chunks, f"{name}: the result is lazy"
            xr.testing.assert_allclose(
                got.compute(), expected(ds), rtol=1e-5, atol=3e-5 if name == "anomalies" else 0
            )
    if executor == "dask":
        assert len(tasks.data) >= len(cases), "the blocks ran on the cluster's workers"


def test_anomalies_are_written_back_with_to_zarr(
    stored: tuple[xr.Dataset, Path], tmp_path: Path
) -> None:
    ds, path = stored
    lazy = open_tierflow(path)
    out = tmp_path / "anomalies.zarr"
    (lazy - lazy.mean("time")).to_zarr(out, consolidated=False)
    back = xr.open_zarr(out, consolidated=False).load()
    # tierflow sums float32 in float64 (docs/engine.md): the float64 answer is the yardstick
    exact = ds.astype("f8") - ds.astype("f8").mean("time")
    xr.testing.assert_allclose(back.astype("f8"), exact, atol=3e-5, rtol=0)
    assert all(back[v].dtype == np.float32 for v in back.data_vars)


def test_a_netcdf_file_opens_lazily_with_open_dataset(tmp_path: Path) -> None:
    pytest.importorskip("h5netcdf")
    ds = climate(days=120)
    path = tmp_path / "climate.nc"
    ds.to_netcdf(path, engine="h5netcdf")
    with xr.open_dataset(
        path, engine="h5netcdf", chunked_array_type="tierflow", chunks={"time": 32}
    ) as lazy:
        assert isinstance(lazy.tas.data, tw.Array)
        assert lazy.tas.data.chunks[0] == (32, 32, 32, 24)
        with tw.use_executor("processes"):  # the workers open the file themselves
            got = (lazy.tas - lazy.tas.mean("time")).compute()
        exact = ds.tas.astype("f8") - ds.tas.astype("f8").mean("time")
        xr.testing.assert_allclose(got.astype("f8"), exact, atol=3e-5, rtol=0)


def test_to_zarr_into_a_region_and_appending_along_time(
    stored: tuple[xr.Dataset, Path], tmp_path: Path
) -> None:
    ds, path = stored
    lazy = open_tierflow(path, time=70)  # blocks that cut the stored chunks of 50
    out = tmp_path / "out.zarr"
    first = lazy.isel(time=slice(0, 200))
    encoding = {v: {"chunks": (50, 6, 8)} for v in ds.data_vars}
    with pytest.raises(ValueError, match="overlap multiple Dask chunks"):  # xarray's check
        first.to_zarr(out, consolidated=False, encoding=encoding)
    # tierflow cuts its writes on the stored chunks itself: xarray's check can be off
    first.to_zarr(out, consolidated=False, encoding=encoding, safe_chunks=False, mode="w")
    lazy.isel(time=slice(200, 400)).to_zarr(
        out, append_dim="time", consolidated=False, safe_chunks=False
    )
    xr.testing.assert_identical(xr.open_zarr(out, consolidated=False).load(), ds)
    doubled = (lazy.isel(time=slice(100, 300)) * 2).drop_vars(["lat", "lon"])
    doubled.to_zarr(out, region={"time": slice(100, 300)}, consolidated=False, safe_chunks=False)
    back = xr.open_zarr(out, consolidated=False).load()
    xr.testing.assert_allclose(back.isel(time=slice(100, 300)), ds.isel(time=slice(100, 300)) * 2)
    xr.testing.assert_identical(back.isel(time=slice(0, 100)), ds.isel(time=slice(0, 100)))
    xr.testing.assert_identical(back.isel(time=slice(300, 400)), ds.isel(time=slice(300, 400)))
    # written into the store it reads: refused (blocks read rows others replace), untouched
    rolled = lazy[["tas"]].rolling(time=3, min_periods=1).mean().drop_vars(["lat", "lon"])
    with pytest.raises(ValueError, match=r"the source reads .* which holds the target"):
        rolled.to_zarr(path, region={"time": slice(0, 400)}, consolidated=False, safe_chunks=False)
    xr.testing.assert_identical(xr.open_zarr(path, consolidated=False).load(), ds)


def test_chunk_with_chunked_array_type_and_apply_ufunc_parallelized() -> None:
    ds = climate(days=120)
    lazy = ds.chunk({"time": 32}, chunked_array_type="tierflow")
    assert isinstance(lazy.pr.data, tw.Array)
    assert lazy.pr.data.chunks[0] == (32, 32, 32, 24)

    def clipped_log(a: np.ndarray) -> np.ndarray:
        return np.log1p(np.clip(a, 0, 5))

    got = xr.apply_ufunc(clipped_log, lazy.pr, dask="parallelized", output_dtypes=[np.float32])
    assert isinstance(got.data, tw.Array)
    xr.testing.assert_allclose(got.compute(), xr.apply_ufunc(clipped_log, ds.pr))

    def lat_mean(a: np.ndarray) -> np.ndarray:  # a core dimension on a trailing axis
        return a.mean(axis=-1)

    got = xr.apply_ufunc(
        lat_mean,
        lazy.tas,
        input_core_dims=[["lon"]],
        dask="parallelized",
        output_dtypes=[np.float32],
    )
    xr.testing.assert_allclose(got.compute(), ds.tas.mean("lon"), rtol=1e-6)
    with pytest.raises(ValueError, match="consists of multiple chunks, but is also a core"):
        xr.apply_ufunc(  # xarray's own check
            lambda a: a.mean(axis=-1),
            lazy.tas.isel(lat=0, lon=0),
            input_core_dims=[["time"]],
            dask="parallelized",
            output_dtypes=[np.float32],
        )
    with pytest.raises(ValueError, match="first dimension must be a loop dimension"):
        xr.apply_ufunc(
            lambda a: a.mean(axis=-1),
            lazy.tas.isel(lat=0, lon=0).chunk({"time": -1}, chunked_array_type="tierflow"),
            input_core_dims=[["time"]],
            dask="parallelized",
            output_dtypes=[np.float32],
        )


def test_the_managers_operations_on_row_blocks() -> None:
    manager = TierflowManager()
    a = np.random.default_rng(3).random((90, 4))
    x = manager.from_array(a, chunks=(20, -1))
    assert manager.is_chunked_array(x) and not manager.is_chunked_array(a)
    assert manager.chunks(x) == ((20, 20, 20, 20, 10), (4,))
    (computed,) = manager.compute(x * 2)
    np.testing.assert_array_equal(computed, a * 2)
    (kept,) = manager.persist(x + 1)
    np.testing.assert_array_equal(kept.compute(), a + 1)
    # dask's reduction: chunk, combine on stacked partials, aggregate
    total = manager.reduction(x, np.sum, np.sum, np.sum, axis=0, dtype=np.float64)
    np.testing.assert_allclose(total.compute(), a.sum(axis=0))
    first = manager.reduction(
        x,
        lambda b, axis, keepdims: b[:1],
        lambda b, axis, keepdims: b[:1],
        lambda b, axis, keepdims: b[0],
        axis=0,
    )
    np.testing.assert_array_equal(first.compute(), a[0])
    rows = manager.reduction(x, np.max, axis=1, dtype=np.float64)
    np.testing.assert_array_equal(rows.compute(), a.max(axis=1))
    # dask's cumreduction, as xarray's push would run it
    scanned = manager.scan(np.cumsum, np.add, 0, x, axis=0, dtype=np.float64)
    np.testing.assert_allclose(scanned.compute(), np.cumsum(a, axis=0))
    mapped = manager.map_blocks(lambda b, k: b * k, x, 3, dtype=np.float64)
    np.testing.assert_array_equal(mapped.compute(), a * 3)
    sliced = manager.map_blocks(
        lambda b: b[:, :2], x, dtype=np.float64, chunks=((20, 20, 20, 20, 10), (2,))
    )
    np.testing.assert_array_equal(sliced.compute(), a[:, :2])
    with pytest.raises(ValueError, match="dropping or adding axis 0"):
        manager.map_blocks(lambda b: b.sum(axis=0), x, drop_axis=0)
    added = manager.blockwise(np.add, "ij", x, "ij", x, "ij", dtype=np.float64)
    np.testing.assert_array_equal(added.compute(), a + a)
    with pytest.raises(ValueError, match="does not keep the rows"):
        manager.blockwise(np.transpose, "ji", x, "ij")
    y = manager.from_array(a, chunks=(30, -1))
    found, (ux, uy) = manager.unify_chunks(x, "ij", y, "ij")
    assert ux.chunks == uy.chunks == ((20, 20, 20, 20, 10), (4,))
    assert found == {"i": (20, 20, 20, 20, 10), "j": (4,)}
    assert manager.get_auto_chunk_size() >= 1 << 20
    with pytest.raises(TypeError, match="tierflow computes take"):
        manager.compute(x, scheduler="threads")


# -- xarray's own tests of a parallel backend (xarray/tests/test_parallelcompat.py),
# -- adapted: tierflow's manager through its real entry point, not a registered dummy


def test_the_manager_is_chosen_by_name_and_by_the_option() -> None:
    from xarray.namedarray.parallelcompat import guess_chunkmanager

    assert isinstance(guess_chunkmanager("tierflow"), TierflowManager)
    with xr.set_options(chunk_manager="tierflow"):
        assert isinstance(guess_chunkmanager(None), TierflowManager)
    with pytest.raises(ValueError, match="unrecognized chunk manager 'foo'"):
        guess_chunkmanager("foo")


def test_tierflow_arrays_are_detected_and_in_memory_ones_ignored() -> None:
    from xarray.namedarray.parallelcompat import get_chunked_array_type

    lazy = tw.from_array(np.arange(3.0), rows=1)
    assert isinstance(get_chunked_array_type(lazy), TierflowManager)
    assert isinstance(get_chunked_array_type(lazy, 1.0, np.array([5, 6])), TierflowManager)
    with pytest.raises(TypeError, match="Expected a chunked array"):
        get_chunked_array_type(1.0, np.array([5, 6]))


def test_mixing_tierflow_and_dask_arrays_is_refused_by_xarray() -> None:
    da = pytest.importorskip("dask.array")
    from xarray.namedarray.parallelcompat import get_chunked_array_type

    lazy = tw.from_array(np.arange(3.0), rows=1)
    with pytest.raises(TypeError, match="received multiple types"):
        get_chunked_array_type(da.from_array(np.arange(3.0), chunks=(1,)), lazy)


def test_dask_is_chosen_unless_tierflow_is_named() -> None:
    """As xarray's test_choose_dask_over_other_chunkmanagers: with both installed, an
    unnamed chunk manager is dask's (hence ``chunked_array_type="tierflow"``)."""
    pytest.importorskip("dask.array")
    from xarray.namedarray.daskmanager import DaskManager
    from xarray.namedarray.parallelcompat import guess_chunkmanager

    assert isinstance(guess_chunkmanager(None), DaskManager)
    assert isinstance(guess_chunkmanager("tierflow"), TierflowManager)


def test_without_the_entry_point_a_tierflow_array_is_not_recognised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As xarray's test_raise_if_no_matching_chunkmanagers and
    test_no_chunk_manager_available: what xarray says where tierflow's entry point was
    not installed."""
    from xarray.namedarray import parallelcompat

    lazy = tw.from_array(np.arange(3.0), rows=1)
    monkeypatch.setattr(parallelcompat, "list_chunkmanagers", dict)
    with pytest.raises(TypeError, match=r"Could not find a Chunk Manager .* missing dependency"):
        parallelcompat.get_chunked_array_type(lazy)
    with pytest.raises(ImportError, match="no chunk managers available"):
        parallelcompat.guess_chunkmanager("tierflow")


def test_a_broken_entry_point_is_a_warning_not_an_error() -> None:
    from importlib.metadata import EntryPoint

    from xarray.namedarray.parallelcompat import load_chunkmanagers

    broken = EntryPoint("bogus", "tierflow.no_such_module", "xarray.chunkmanagers")
    working = EntryPoint("tierflow", "tierflow.xarray:TierflowManager", "xarray.chunkmanagers")
    with pytest.warns(UserWarning, match="Failed to load chunk manager"):
        found = load_chunkmanagers([broken, working])
    assert list(found) == ["tierflow"]


def test_rolling_windows_and_the_monthly_groupings_match_xarray_over_numpy(
    stored: tuple[xr.Dataset, Path],
) -> None:
    ds, path = stored
    lazy = open_tierflow(path, time=64)
    cases = [
        lambda d: d.tas.rolling(time=7).mean(),
        lambda d: d.tas.rolling(time=5, center=True, min_periods=2).sum(),
        lambda d: d.groupby("time.month").mean(),
        lambda d: d.resample(time="1MS").mean(),
    ]
    for make in cases:
        got = make(lazy)
        assert got.chunks, "the result is lazy: chunked"
        xr.testing.assert_allclose(got.compute(), make(ds), rtol=1e-5)


def test_quantiles_over_time_match_xarray_over_numpy(stored: tuple[xr.Dataset, Path]) -> None:
    ds, path = stored
    lazy = open_tierflow(path, time=64)
    got = lazy.tas.quantile([0.1, 0.9], dim="time")
    assert isinstance(got.data, tw.Array)
    xr.testing.assert_allclose(got.compute(), ds.tas.quantile([0.1, 0.9], dim="time"))
    median = lazy.median("time").compute()
    xr.testing.assert_allclose(median, ds.median("time"))


def test_fills_along_time_through_the_accessor() -> None:
    ds = climate(days=150)
    holes = np.random.default_rng(2).random(ds.tas.shape) > 0.4
    ds["tas"] = ds.tas.where(holes)
    lazy = ds.chunk({"time": 32}, chunked_array_type="tierflow")

    for backward, limit in ((False, None), (False, 3), (True, None), (True, 1)):
        fill = lazy.tierflow.bfill if backward else lazy.tierflow.ffill
        got = fill("time", limit=limit)
        assert isinstance(got.tas.data, tw.Array)
        np.testing.assert_array_equal(got.tas.values, filled(ds.tas.values, limit, backward))
        np.testing.assert_array_equal(got.pr.values, ds.pr.values)  # nothing to fill
    with pytest.raises(ValueError, match=r"transpose\('lat', \.\.\.\) first"):
        lazy.tierflow.ffill("lat")
