"""xarray over tierflow, dask and Cubed: a labelled climate dataset bigger than a small
container, the same three workflows through each chunk manager.

The data: a ``(time, lat, lon)`` Zarr dataset (format 3, zarr's default compression)
of two float32 variables, ``tas`` and ``pr``, on a ``--lat`` x ``--lon`` grid (default
180 x 360) with daily steps, ``--gb`` (default 4) GB in all, in chunks of a year of
days and the whole grid; written a year at a time into ``--dir`` and removed at the
end.

The work, each as xarray users write it, through ``xr.open_zarr(path,
chunked_array_type=..., chunks={"time": 365})``:

1. ``mean``: ``ds.tas.mean("time").compute()``;
2. ``anomalies``: ``(ds - ds.mean("time")).to_zarr(out)``;
3. ``monthly``: ``ds.groupby("time.month").mean().compute()``.

Contenders: tierflow (``chunked_array_type="tierflow"``, its defaults), dask (xarray's
default chunk manager, its threaded scheduler on every core) and Cubed through
cubed-xarray where it is installed (``chunked_array_type="cubed"``, threads, 2 GB of
allowed memory). Each run is a fresh process, the dataset's pages warm; the figure is
each contender's time over tierflow's (above 1: tierflow is faster), per round and the
median. Then the same runs in a memory cgroup of ``--cgroup-mb`` (default 1024) MB:
whether each completes, its time and the cgroup's peak and OOM kills (skipped with the
reason where no cgroup can be made).

``python tests/benchmarks/bench_xarray.py [--gb 4] [--rounds 3] [--only
mean,anomalies,monthly] [--engines tierflow,dask,cubed] [--cgroup-mb 1024] [--dir
DIR] [--json f]``; run it under ``flock /tmp/tierflow-bench.lock`` on a quiet machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: cgroups.py
sys.path.insert(0, str(HERE))  # _harness.py
sys.path.insert(0, str(HERE.parents[1]))  # this checkout's tierflow

import _harness  # noqa: E402

WORK = ("mean", "anomalies", "monthly")
DAYS_PER_CHUNK = 365
TIMEOUT_S = 1800.0


def make(path: Path, gb: float, lat: int, lon: int) -> int:
    """The dataset, a year at a time; its days."""
    import pandas as pd
    import xarray as xr

    days = int(gb * 1e9 / (2 * 4 * lat * lon))
    when = pd.date_range("1980-01-01", periods=days, freq="D")
    grid = {"lat": np.linspace(-89.5, 89.5, lat), "lon": np.linspace(0.5, 359.5, lon)}
    rng = np.random.default_rng(0)
    for start in range(0, days, DAYS_PER_CHUNK):
        part = when[start : start + DAYS_PER_CHUNK]
        shape = (len(part), lat, lon)
        season = np.cos(2 * np.pi * part.day_of_year.to_numpy() / 365.25)[:, None, None]
        piece = xr.Dataset(
            {
                "tas": (
                    ("time", "lat", "lon"),
                    (280 + 10 * season + rng.normal(0, 3, shape)).astype("f4"),
                ),
                "pr": (("time", "lat", "lon"), rng.gamma(2.0, 1.5, shape).astype("f4")),
            },
            coords={"time": part, **grid},
        )
        if start == 0:
            encoding = {v: {"chunks": (DAYS_PER_CHUNK, lat, lon)} for v in piece.data_vars}
            piece.to_zarr(path, encoding=encoding, consolidated=False)
        else:
            piece.to_zarr(path, append_dim="time", consolidated=False)
    return days


def child(engine: str, work: str, path: str, out: str) -> None:
    """One run in this process: prints its seconds and peak RSS (KB)."""
    import warnings

    import xarray as xr

    warnings.simplefilter("ignore")
    started = time.perf_counter()
    chunks = {"time": DAYS_PER_CHUNK}
    options: dict[str, Any] = {"chunks": chunks, "consolidated": False}
    if engine == "tierflow":
        options["chunked_array_type"] = "tierflow"
    elif engine == "dask":
        import dask

        dask.config.set(scheduler="threads")
    elif engine == "cubed":
        import cubed

        work_dir = tempfile.mkdtemp(prefix="cubed-", dir=os.path.dirname(out))
        spec = cubed.Spec(work_dir=work_dir, allowed_mem="2GB", executor_name="threads")
        options.update(chunked_array_type="cubed", from_array_kwargs={"spec": spec})
    ds = xr.open_zarr(path, **options)
    if work == "mean":
        result = ds.tas.mean("time").compute()
        check = float(result.mean())
    elif work == "anomalies":
        (ds - ds.mean("time")).to_zarr(out, consolidated=False)
        check = float(xr.open_zarr(out, consolidated=False).tas.isel(time=0).mean())
    else:
        result = ds.groupby("time.month").mean().compute()
        check = float(result.tas.mean())
    seconds = time.perf_counter() - started
    # VmHWM read here: ru_maxrss of a child started from Python inherits the parent's
    print(f"{seconds:.3f} {_harness.peak_rss() >> 10} {check:.6f}")


def run(engine: str, work: str, path: Path, scratch: Path) -> tuple[float, int, float]:
    out = scratch / f"{engine}-{work}.zarr"
    cmd = [sys.executable, __file__, "--child", engine, work, str(path), str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        for stale in scratch.glob("cubed-*"):
            shutil.rmtree(stale, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} {work} failed: {done.stderr.strip()[-2000:]}")
    seconds, rss, check = done.stdout.split()[:3]
    return float(seconds), int(rss), float(check)


def in_cgroup(engine: str, work: str, path: Path, scratch: Path, limit_mb: int) -> str:
    out = scratch / f"cg-{engine}-{work}.zarr"
    cmd = [sys.executable, __file__, "--child", engine, work, str(path), str(out)]
    try:
        return _harness.in_cgroup(cmd, limit_mb, TIMEOUT_S)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        for stale in scratch.glob("cubed-*"):
            shutil.rmtree(stale, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", nargs=4, metavar=("ENGINE", "WORK", "PATH", "OUT"))
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--lat", type=int, default=180)
    parser.add_argument("--lon", type=int, default=360)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(WORK))
    parser.add_argument("--engines", default="tierflow,dask,cubed")
    parser.add_argument("--cgroup-mb", type=int, default=1024)
    parser.add_argument("--no-cgroup", action="store_true")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    if options.child:
        child(*options.child)
        return
    engines = [e for e in options.engines.split(",") if e]
    if "cubed" in engines and importlib.util.find_spec("cubed_xarray") is None:
        print("cubed: not run (cubed-xarray is not installed: the bench extra)")
        engines.remove("cubed")
    works = [w for w in options.only.split(",") if w]
    scratch = Path(tempfile.mkdtemp(prefix="tierflow-bench-xarray-", dir=options.dir))
    report: dict[str, Any] = {"engines": engines, "rounds": {}, "cgroup": {}}
    try:
        path = scratch / "climate.zarr"
        started = time.perf_counter()
        days = make(path, options.gb, options.lat, options.lon)
        size = sum(_harness.warm(f) for f in path.rglob("*") if f.is_file())
        print(
            f"dataset: {days} days x {options.lat} x {options.lon}, tas and pr float32 "
            f"({2 * days * options.lat * options.lon * 4 / 1e9:.2f} GB; {size / 1e9:.2f} GB "
            f"on disk, cached), written in {time.perf_counter() - started:.0f} s"
        )
        for work in works:
            times: dict[str, list[float]] = {e: [] for e in engines}
            checks: dict[str, float] = {}
            peaks: dict[str, int] = dict.fromkeys(engines, 0)
            for _ in range(options.rounds):
                for engine in engines:
                    seconds, rss, check = run(engine, work, path, scratch)
                    times[engine].append(seconds)
                    checks[engine] = check
                    peaks[engine] = max(peaks[engine], rss)
            report["rounds"][work] = times
            base = times.get("tierflow")
            line = [f"{work}:"]
            for engine in engines:
                med = statistics.median(times[engine])
                text = f"{engine} {med:.2f} s, peak RSS {peaks[engine] >> 10} MB"
                if base is not None and engine != "tierflow":
                    ratios = [o / t for o, t in zip(times[engine], base, strict=True)]
                    text += f" ({statistics.median(ratios):.2f}x tierflow's time: {_harness.span(ratios)})"
                line.append(text)
            agree = max(checks.values()) - min(checks.values()) <= 1e-3 * max(
                1.0, abs(max(checks.values()))
            )
            line.append(f"results agree: {agree}")
            print("  ".join(line))
        if not options.no_cgroup:
            from cgroups import skip_reason

            reason = skip_reason()
            for work in works:
                for engine in engines:
                    if reason is not None:
                        what = f"not run ({reason})"
                    else:
                        what = in_cgroup(engine, work, path, scratch, options.cgroup_mb)
                    report["cgroup"][f"{engine}-{work}"] = what
                    print(f"{work} in a {options.cgroup_mb} MB cgroup, {engine}: {what}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if options.json:
        Path(options.json).write_text(__import__("json").dumps(report, indent=1))


if __name__ == "__main__":
    main()
