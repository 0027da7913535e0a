"""Products across the rows and tall-skinny factorisations on a big ``.npy``.

The data: a float32 ``[N, 8]`` ``.npy`` of uniform values (default ``--gb 4``: 125,000,000
rows), written into a temporary folder under ``--dir`` and removed at the end; its pages
are warm (read once first) for parts 1-3.

1. **x.T @ x** against NumPy on the memory map blocked by hand (1,048,576-row blocks cast
   to float64, ``acc += b.T @ b``): the ratio NumPy / tierflow, per round.
2. **np.cov(x, rowvar=False)** against ``da.cov(d, rowvar=False)`` with ``d =
   da.from_array(memmap, chunks=(1048576, 8))`` on dask's threaded scheduler (target:
   at least 3x); the largest difference of the two matrices.
3. **TSQR** against ``da.linalg.tsqr``: the R factor (``tw.linalg.qr(x, mode="r")``
   against ``da.linalg.tsqr(d)[1].compute()``), and ``tw.linalg.svd(x,
   full_matrices=False)`` (R, then S and Vh in memory; U lazy) against the same dask R,
   which is the lower bound of dask's own SVD (its TSQR, then the small SVD); R and the
   singular values compared.
4. **In a 1 GB memory cgroup**: x.T @ x, np.cov and the SVD (with the pass over U), each in
   a child process inside a real cgroup of ``--cgroup-mb`` (default 1024) MB, the file's
   pages dropped first: whether it completed, its time, the cgroup's peak and OOM kills.
   Skipped, with the reason, where no cgroup can be made (needs root).

Bigger than 0.5 GB: run it under the machine's benchmark lock::

    flock /tmp/tierflow-bench.lock python tests/benchmarks/bench_products.py [--gb 4]
        [--rounds 1] [--only gram,cov,tsqr,cgroup] [--cgroup-mb 1024] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # tests/: cgroups.py
sys.path.insert(0, str(HERE))  # _harness.py
sys.path.insert(0, str(ROOT))  # this checkout's tierflow, not an installed one

import _harness as harness  # noqa: E402

WIDTH = 8
BLOCK = 1 << 20
PARTS = ("gram", "cov", "tsqr", "cgroup")


def _numpy_gram(path: Path) -> np.ndarray:
    mm = np.load(path, mmap_mode="r")
    acc = np.zeros((mm.shape[1], mm.shape[1]))
    for start in range(0, len(mm), BLOCK):
        block = mm[start : start + BLOCK].astype(np.float64)
        acc += block.T @ block
    return acc


def part_gram(path: Path, rounds: int) -> None:
    import tierflow as tw

    ratios, ours, theirs = [], [], []
    x = tw.from_npy(path)
    for _ in range(rounds):
        got, t = harness.timed(lambda: (x.T @ x).compute(progress=False))
        want, n = harness.timed(lambda: _numpy_gram(path))
        np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-6)
        ours.append(t)
        theirs.append(n)
        ratios.append(n / t)
    gb = path.stat().st_size / 1e9
    print(
        f"1. x.T @ x: tierflow {statistics.median(ours):.2f} s "
        f"({gb / statistics.median(ours):.2f} GB/s), NumPy blocked by hand "
        f"{statistics.median(theirs):.2f} s; NumPy / tierflow {harness.span(ratios)}"
    )


def part_cov(path: Path, rounds: int) -> None:
    import dask.array as da

    import tierflow as tw

    ratios, ours, theirs = [], [], []
    diff = 0.0
    x = tw.from_npy(path)
    d = da.from_array(np.load(path, mmap_mode="r"), chunks=(BLOCK, WIDTH))
    for _ in range(rounds):
        got, t = harness.timed(lambda: np.cov(x, rowvar=False).compute(progress=False))
        want, n = harness.timed(lambda: da.cov(d, rowvar=False).compute())
        diff = max(diff, float(np.abs(got - want).max()))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
        ours.append(t)
        theirs.append(n)
        ratios.append(n / t)
    print(
        f"2. np.cov(x, rowvar=False): tierflow {statistics.median(ours):.2f} s, da.cov "
        f"{statistics.median(theirs):.2f} s; dask / tierflow {harness.span(ratios)} (target >= 3x); "
        f"largest difference {diff:.3g}"
    )


def part_tsqr(path: Path, rounds: int) -> None:
    import dask.array as da

    import tierflow as tw

    r_ratios, s_ratios, r_ours, s_ours, theirs = [], [], [], [], []
    x = tw.from_npy(path)
    d = da.from_array(np.load(path, mmap_mode="r"), chunks=(BLOCK, WIDTH))
    for _ in range(rounds):
        r, t = harness.timed(lambda: tw.linalg.qr(x, mode="r", progress=False))
        (_, s, _), t_svd = harness.timed(
            lambda: tw.linalg.svd(x, full_matrices=False, progress=False)
        )
        dr, n = harness.timed(lambda: da.linalg.tsqr(d)[1].compute())
        signs = np.where(np.diagonal(dr) < 0, -1.0, 1.0)
        np.testing.assert_allclose(r, dr * signs[:, None], rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(s, np.linalg.svd(dr, compute_uv=False), rtol=1e-4)
        r_ours.append(t)
        s_ours.append(t_svd)
        theirs.append(n)
        r_ratios.append(n / t)
        s_ratios.append(n / t_svd)
    print(
        f"3. R of QR: tierflow {statistics.median(r_ours):.2f} s, da.linalg.tsqr R "
        f"{statistics.median(theirs):.2f} s; dask / tierflow {harness.span(r_ratios)}\n"
        f"   SVD (S, Vh; U lazy): tierflow {statistics.median(s_ours):.2f} s; "
        f"da.linalg.tsqr R / tierflow {harness.span(s_ratios)}"
    )


CHILD = """
import sys, time
sys.path.insert(0, sys.argv[3])
import numpy as np
import tierflow as tw
which, path = sys.argv[1], sys.argv[2]
x = tw.from_npy(path)
start = time.perf_counter()
if which == "x.T @ x":
    (x.T @ x).compute(progress=False)
elif which == "np.cov":
    np.cov(x, rowvar=False).compute(progress=False)
else:
    u, s, vh = tw.linalg.svd(x, full_matrices=False, progress=False)
    u.sum(axis=0).compute(progress=False)
seconds = time.perf_counter() - start
peak = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(seconds, peak, flush=True)
"""


def part_cgroup(path: Path, limit_mb: int) -> None:
    from cgroups import skip_reason

    reason = skip_reason()
    if reason:
        print(f"4. in a {limit_mb} MB cgroup: not run ({reason})")
        return
    for which in ("x.T @ x", "np.cov", "svd + U pass"):
        harness.drop_cache(path)
        cmd = [sys.executable, "-c", CHILD, which, str(path), str(ROOT)]
        print(f"4. {which} in a {limit_mb} MB cgroup: {harness.in_cgroup(cmd, limit_mb, 1800)}")


def test_products_on_a_small_file(benchmark: Any, tmp_path: Path) -> None:
    """``make bench``: parts 1-3 on a 3 MB file (results checked inside each part)."""
    benchmark.group = "engine: products across the rows"
    path = harness.make_npy(tmp_path / "x.npy", 100_000, WIDTH)

    def run() -> None:
        part_gram(path, 1)
        part_cov(path, 1)
        part_tsqr(path, 1)

    benchmark.pedantic(run, rounds=1, iterations=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0, help="size of the float32 [N, 8] file")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default=",".join(PARTS))
    parser.add_argument("--cgroup-mb", type=int, default=1024)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    parts = [p for p in args.only.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    rows = int(args.gb * 1e9) // (WIDTH * 4)
    folder = Path(tempfile.mkdtemp(prefix="bench-products-", dir=args.dir))
    try:
        path = harness.make_npy(folder / "x.npy", rows, WIDTH)
        print(f"data: float32 [{rows:,}, {WIDTH}], {path.stat().st_size / 1e9:.2f} GB")
        for name in parts:
            if name != "cgroup":
                harness.ensure_warm(path)
            if name == "gram":
                part_gram(path, args.rounds)
            elif name == "cov":
                part_cov(path, args.rounds)
            elif name == "tsqr":
                part_tsqr(path, args.rounds)
            else:
                part_cgroup(path, args.cgroup_mb)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
