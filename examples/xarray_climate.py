"""A climate dataset under xarray, computed by tierflow: labelled, lazy, in row blocks.

    python examples/xarray_climate.py                        # 2 years, a 64 x 128 grid
    python examples/xarray_climate.py --years 20 --lat 180 --lon 360   # about 4 GB

Needs the ``xarray`` and ``zarr`` extras (``pip install -e '.[xarray,zarr]'`` in the
tierflow checkout). It writes a ``(time, lat, lon)`` float32 Zarr dataset with two
variables (``tas``, ``pr``) and daily time steps into a temporary folder (removed at
the end, whatever happens), a year at a time so it is never whole in memory, then
opens it with ``chunked_array_type="tierflow"``, so every variable is a lazy tierflow
array, and runs:

1. the mean and standard deviation over time (one compute, one pass);
2. the anomalies ``ds - ds.mean("time")``, written back to Zarr block by block;
3. the monthly climatology ``groupby("time.month").mean()`` and the monthly means
   ``resample(time="1MS").mean()``;
4. the mean temperature where it rains more than 2, a mask then a reduction.

Each result is checked against xarray over NumPy on the first grid rows (a copy small
enough for memory), and the script prints each step's time.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr


def write_dataset(path: Path, years: int, lat: int, lon: int) -> int:
    """Daily ``tas`` and ``pr`` on a ``lat x lon`` grid, a year at a time; the days."""
    days = pd.date_range("2000-01-01", periods=365 * years, freq="D")
    grid = {"lat": np.linspace(-89.5, 89.5, lat), "lon": np.linspace(0, 359, lon)}
    rng = np.random.default_rng(0)
    for year in range(years):
        when = days[year * 365 : (year + 1) * 365]
        season = np.cos(2 * np.pi * when.day_of_year / 365.25).to_numpy()[:, None, None]
        shape = (len(when), lat, lon)
        piece = xr.Dataset(
            {
                "tas": (
                    ("time", "lat", "lon"),
                    (280 + 10 * season + rng.normal(0, 3, shape)).astype("f4"),
                ),
                "pr": (("time", "lat", "lon"), rng.gamma(2.0, 1.5, shape).astype("f4")),
            },
            coords={"time": when, **grid},
        )
        encoding = {v: {"chunks": (73, lat, lon)} for v in piece.data_vars}
        if year == 0:
            piece.to_zarr(path, encoding=encoding, consolidated=False)
        else:
            piece.to_zarr(path, append_dim="time", consolidated=False)
    return len(days)


def step(name: str, started: float) -> None:
    print(f"{name}: {time.perf_counter() - started:.2f} s")


def matches(ok: object, checks: list[bool]) -> None:
    checks.append(bool(ok))
    print(f"  match xarray over NumPy: {bool(ok)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--years", type=int, default=2)
    parser.add_argument("--lat", type=int, default=64)
    parser.add_argument("--lon", type=int, default=128)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tierflow-xarray-"))
    checks: list[bool] = []
    try:
        path = folder / "climate.zarr"
        days = write_dataset(path, args.years, args.lat, args.lon)
        size = 2 * days * args.lat * args.lon * 4
        print(
            f"wrote {days} days of tas and pr on a {args.lat} x {args.lon} grid ({size / 1e9:.2f} GB)"
        )
        ds = xr.open_zarr(
            path, chunked_array_type="tierflow", chunks={"time": 365}, consolidated=False
        )
        print(
            f"tas is a {type(ds.tas.data).__module__.split('.')[0]} array in blocks of {ds.tas.data.chunks[0][0]} days"
        )
        # a small copy for xarray over NumPy: the first 4 grid rows
        small = xr.open_zarr(path, consolidated=False).isel(lat=slice(0, 4)).load()

        started = time.perf_counter()
        mean, std = xr.broadcast(ds.tas.mean("time"), ds.tas.std("time"))
        mean, std = xr.Dataset({"mean": mean, "std": std}).compute().data_vars.values()
        step("mean and std over time", started)
        ok = np.allclose(
            mean.isel(lat=slice(0, 4)), small.tas.mean("time"), rtol=1e-5
        ) and np.allclose(std.isel(lat=slice(0, 4)), small.tas.std("time"), rtol=1e-4)
        matches(ok, checks)

        started = time.perf_counter()
        out = folder / "anomalies.zarr"
        (ds - ds.mean("time")).to_zarr(out, consolidated=False)
        step("anomalies written to Zarr", started)
        back = xr.open_zarr(out, consolidated=False).isel(lat=slice(0, 4)).load()
        want = small.astype("f8") - small.astype("f8").mean("time")
        matches(np.allclose(back.tas, want.tas, atol=1e-4), checks)

        started = time.perf_counter()
        monthly = ds.groupby("time.month").mean().compute()
        resampled = ds.tas.resample(time="1MS").mean().compute()
        step("monthly climatology and monthly means", started)
        ok = np.allclose(
            monthly.tas.isel(lat=slice(0, 4)), small.groupby("time.month").mean().tas, rtol=1e-5
        ) and np.allclose(
            resampled.isel(lat=slice(0, 4)), small.tas.resample(time="1MS").mean(), rtol=1e-5
        )
        matches(ok, checks)

        started = time.perf_counter()
        wet = ds.tas.where(ds.pr > 2).mean("time").compute()
        step("mean temperature where pr > 2", started)
        want = small.tas.where(small.pr > 2).mean("time")
        matches(np.allclose(wet.isel(lat=slice(0, 4)), want, rtol=1e-5), checks)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"removed {folder.name}: {not folder.exists()}")
    if not all(checks):
        raise SystemExit("a result differs from xarray over NumPy")


if __name__ == "__main__":
    main()
