"""The engine's cache on a compute-bound pipeline: a re-run, the cost of caching, a resume.

A float32 ``[N, 8]`` ``.npy`` is generated in a temporary folder (default 1024 MB;
sizes here are binary, 1 MB = 2**20 bytes) and removed at the end; its page cache is
warm before every run. The pipeline is ``x.map_blocks(work).to_npy(out)``, where
``work`` applies ``np.sqrt(b * b + 1)`` ``K`` times to its block. ``K`` is calibrated
first so that ``work`` costs about 10x *a read*: the same ``to_npy`` without the
``map_blocks`` (read the file, write the output). Every run is a child process
(``bench_cache.py --child KIND ...``) that times its measured part (building the
array and the ``to_npy``, not the interpreter's start), with its own store folder.

1. Cache re-run: ``to_npy(cache=store)`` into an empty store (*first*), then again
   (*second*): second >= 10x faster than first.
2. Caching overhead: first <= 1.15x the same pipeline with ``cache=False``.
3. Resume: a run with the cache killed (SIGKILL) once half of its blocks are in the
   cache, then run again: the re-run takes <= 60 % of a full (first) run.

All outputs must be byte-identical to the uncached run's. ``python
tests/benchmarks/bench_cache.py [--size-mb 1024] [--repeat 1] [--ratio 10] [--json f]``
prints every figure and a table of the targets (PASS/MISS; exit status 1 on a MISS only
with ``--strict``). ``make bench`` runs the pytest-benchmark test below on a small file
(``TIERFLOW_BENCH_CACHE_SIZE_MB``, default 32): it asserts that every run completed and
wrote the same bytes, and records the figures in ``extra_info``; the speed targets are
not asserted there (they depend on the machine's cores and load).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Measure, emit, ensure_warm, make_npy, run_sampled, save_figures, verdict

MB = 1 << 20
WIDTH = 8
TIMEOUT_S = 1800.0
SIZE_MB = float(os.environ.get("TIERFLOW_BENCH_CACHE_SIZE_MB", "32"))
RATIO = 10.0  # work costs this many reads
TARGET_SPEEDUP = 10.0
TARGET_OVERHEAD = 1.15
TARGET_RESUME = 0.60

ROUNDS = 1  # set from the command line in a child; part of work()'s key


def work(b: np.ndarray) -> np.ndarray:
    """The compute-bound step: ``ROUNDS`` passes of ``sqrt(b * b + 1)``."""
    out = b
    for _ in range(ROUNDS):
        out = np.sqrt(out * out + 1.0)
    return out


# -- the child side: one run per process --------------------------------------------------


def child_main(kind: str, path: str, out: str, rounds: int) -> None:
    global ROUNDS
    ROUNDS = rounds
    import tierflow as tw

    m = Measure()
    m.start()
    x = tw.from_npy(path)
    # The calibration writes the same file up to three times: each run replaces it.
    if kind == "read":
        x.to_npy(out, cache=False, progress=False, overwrite=True)
    elif kind == "nocache":
        x.map_blocks(work, dtype=np.float32, row_shape=(WIDTH,)).to_npy(
            out, cache=False, progress=False, overwrite=True
        )
    else:  # "cached": first, second, killed and resumed runs
        x.map_blocks(work, dtype=np.float32, row_shape=(WIDTH,)).to_npy(
            out, cache=True, progress=False, overwrite=True
        )
    m.stop(blocks=x.nblocks)
    info = tw.cache_info().get("cache")
    if info is not None:
        m.figures.update(hits=info.hits, misses=info.misses, written=info.bytes_written)
    emit({**m.figures, "kind": kind})


# -- the parent side ----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One line of the final table: ``value`` against ``target``."""

    what: str
    value: float | None
    target: float
    at_least: bool

    @property
    def verdict(self) -> str:
        return verdict(self.value, self.target, self.at_least)


def _environment(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(TIERFLOW_STORE_DIR=str(home / "store"), TIERFLOW_SPILL_DIR=str(home / "spill"))
    env.pop("TIERFLOW_CACHE", None)
    return env


def _command(kind: str, path: Path, out: Path, rounds: int) -> list[str]:
    here = os.path.abspath(__file__)
    return [sys.executable, here, "--child", kind, str(path), str(out), str(rounds)]


def run_kind(kind: str, path: Path, out: Path, home: Path, rounds: int) -> dict[str, Any]:
    """One run in a child process (the file's cache warmed first): its figures, plus
    ``returncode`` and ``error`` when it failed."""
    ensure_warm(path)
    run = run_sampled(_command(kind, path, out, rounds), timeout=TIMEOUT_S, env=_environment(home))
    figures = run.figures()
    figures.update(kind=kind, returncode=run.returncode)
    if run.returncode != 0 or "seconds" not in figures:
        figures["error"] = run.stderr[-3000:] or f"exit status {run.returncode}, no output"
    return figures


def cached_blocks(home: Path) -> int:
    """Entries in the store of a run's home (blocks written to the cache)."""
    data = home / "store" / "cache" / "data"
    return sum(1 for p in data.rglob("*") if p.is_file()) if data.exists() else 0


def killed_at_half(path: Path, out: Path, home: Path, rounds: int, blocks: int) -> dict[str, Any]:
    """A cached run killed with SIGKILL once half of its blocks are in the cache."""
    ensure_warm(path)
    home.mkdir(parents=True, exist_ok=True)
    child = subprocess.Popen(
        _command("cached", path, out, rounds),
        env=_environment(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + TIMEOUT_S
    done = 0
    while child.poll() is None and time.monotonic() < deadline:
        done = cached_blocks(home)
        if done >= blocks / 2:
            break
        time.sleep(0.002)
    if child.poll() is None:
        child.send_signal(signal.SIGKILL)
    _, stderr = child.communicate()
    figures: dict[str, Any] = {"kind": "killed", "returncode": child.returncode, "done": done}
    if child.returncode != -signal.SIGKILL:
        figures["error"] = stderr[-3000:] or f"exit status {child.returncode}, not killed"
    return figures


def digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while piece := f.read(64 * MB):
            h.update(piece)
    return h.hexdigest()


def calibrate(path: Path, scratch: Path, ratio: float) -> tuple[int, dict[str, Any]]:
    """``K`` such that ``work`` costs about ``ratio`` reads, and the read run's figures.

    A guess from 4 rounds, corrected twice by the measured cost (a single round is too
    short to time on a busy machine)."""
    read = run_kind("read", path, scratch / "read.npy", scratch / "read-home", 1)
    if read["returncode"] != 0:
        raise RuntimeError(f"calibration failed: {read['error']}")
    rounds = 4
    for _ in range(3):
        run = run_kind("nocache", path, scratch / "cal.npy", scratch / "cal-home", rounds)
        if run["returncode"] != 0:
            raise RuntimeError(f"calibration failed: {run['error']}")
        per_round = max(run["seconds"] - read["seconds"], 1e-6) / rounds
        wanted = max(1, round(ratio * read["seconds"] / per_round))
        if abs(wanted - rounds) <= max(1, rounds // 10):
            break
        rounds = wanted
    return rounds, read


def run_all(
    size_mb: float, folder: Path, *, repeat: int = 1, ratio: float = RATIO
) -> dict[str, Any]:
    rows = max(1, int(size_mb * MB) // (4 * WIDTH))
    path = make_npy(folder / "x.npy", rows, WIDTH)
    rounds, read = calibrate(path, folder, ratio)
    best: dict[str, dict[str, Any]] = {}

    def keep(name: str, r: dict[str, Any]) -> None:
        old = best.get(name)
        if old is None or (
            r["returncode"] == 0 and r.get("seconds", 1e300) < old.get("seconds", 1e300)
        ):
            best[name] = r

    outputs: dict[str, str] = {}
    for k in range(repeat):
        home = folder / f"home-{k}"
        shutil.rmtree(home, ignore_errors=True)
        keep("nocache", run_kind("nocache", path, folder / "nocache.npy", home, rounds))
        keep("first", run_kind("cached", path, folder / "first.npy", home, rounds))
        keep("second", run_kind("cached", path, folder / "second.npy", home, rounds))
        resume_home = folder / f"resume-{k}"
        shutil.rmtree(resume_home, ignore_errors=True)
        blocks = best["first"].get("blocks", 1)
        keep("killed", killed_at_half(path, folder / "resumed.npy", resume_home, rounds, blocks))
        keep("resumed", run_kind("cached", path, folder / "resumed.npy", resume_home, rounds))
        for name in ("nocache", "first", "second", "resumed"):
            target = folder / f"{name}.npy"
            if target.exists():
                outputs[name] = digest(target)
                target.unlink()
    same = len(set(outputs.values())) == 1 and len(outputs) == 4
    return {
        "size_mb": size_mb,
        "rounds": rounds,
        "read": read,
        "runs": best,
        "identical": same,
        "digests": outputs,
    }


def targets(report: dict[str, Any]) -> list[Target]:
    runs = report["runs"]

    def seconds(name: str) -> float | None:
        r = runs.get(name, {})
        return r.get("seconds") if r.get("returncode") == 0 else None

    first, second, nocache, resumed = (
        seconds(n) for n in ("first", "second", "nocache", "resumed")
    )
    return [
        Target(
            "second run with the cache, speed-up over the first (x)",
            first / second if first and second else None,
            TARGET_SPEEDUP,
            True,
        ),
        Target(
            "first run with the cache / run without (x)",
            first / nocache if first and nocache else None,
            TARGET_OVERHEAD,
            False,
        ),
        Target(
            "re-run after a kill at 50 % / full first run",
            resumed / first if resumed and first else None,
            TARGET_RESUME,
            False,
        ),
    ]


def print_report(report: dict[str, Any], rows: Sequence[Target]) -> None:
    read = report["read"]
    runs = report["runs"]
    print(
        f"file: {report['size_mb']:.0f} MB float32 [N, {WIDTH}]; work = {report['rounds']} rounds"
    )
    print(f"  read (to_npy without map_blocks)   {read['seconds']:8.3f} s")
    work_cost = (runs["nocache"].get("seconds", 0) - read["seconds"]) / read["seconds"]
    print(f"  work costs {work_cost:.1f} reads")
    for name in ("nocache", "first", "second", "killed", "resumed"):
        r = runs.get(name, {})
        if r.get("returncode", 1) != 0 and name != "killed":
            print(f"  {name:<34} FAILED: {r.get('error', '')[-400:]}")
            continue
        if name == "killed":
            print(f"  {'killed (blocks done at the kill)':<34} {r.get('done', '?'):>8}")
            continue
        extra = ""
        if "hits" in r:
            extra = f"  hits {r['hits']}, misses {r['misses']}"
        print(f"  {name:<34} {r['seconds']:8.3f} s  ({r.get('blocks')} blocks){extra}")
    print(f"  outputs byte-identical: {report['identical']}")
    print()
    for t in rows:
        value = "-" if t.value is None else f"{t.value:.3f}"
        sign = ">=" if t.at_least else "<="
        print(f"  {t.verdict:<5} {t.what:<52} {value:>8}  (target {sign} {t.target})")


def main(argv: Sequence[str] | None = None) -> int:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024.0, help="file size (2^20 bytes)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each, best kept")
    parser.add_argument("--ratio", type=float, default=RATIO, help="work's cost in reads")
    parser.add_argument("--dir", help="folder for the file and stores (default: a temp folder)")
    parser.add_argument("--json", help="write the figures (JSON) here")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--child", nargs=4, metavar=("KIND", "PATH", "OUT", "K"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.child:
        kind, path, out, rounds = args.child
        child_main(kind, path, out, int(rounds))
        return 0
    folder = Path(tempfile.mkdtemp(prefix="bench-cache-", dir=args.dir))
    try:
        report = run_all(args.size_mb, folder, repeat=args.repeat, ratio=args.ratio)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = targets(report)
    print_report(report, rows)
    missed = save_figures(report, rows, args.json)
    return 1 if missed and args.strict else 0


# -- pytest-benchmark ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    where = tmp_path_factory.mktemp("bench-cache")
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_cache_rerun_overhead_and_resume(benchmark: Any, folder: Path) -> None:
    benchmark.group = "engine: the cache"
    report = benchmark.pedantic(run_all, args=(SIZE_MB, folder), rounds=1, iterations=1)
    rows = targets(report)
    print_report(report, rows)
    runs = report["runs"]
    benchmark.extra_info["rounds"] = report["rounds"]
    benchmark.extra_info["seconds"] = {k: r.get("seconds") for k, r in runs.items()}
    benchmark.extra_info["targets"] = [
        {"what": t.what, "value": t.value, "target": t.target, "verdict": t.verdict} for t in rows
    ]
    failed = {k: r.get("error", "")[-800:] for k, r in runs.items() if r.get("error") is not None}
    assert not failed, failed
    assert report["identical"], report["digests"]
    assert runs["second"]["hits"] == runs["second"]["blocks"]
    assert 0 < runs["resumed"]["hits"] < runs["resumed"]["blocks"]


if __name__ == "__main__":
    sys.exit(main())
