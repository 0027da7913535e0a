"""Compiled kernels against a hand-written numba loop over the same memory map.

A float32 ``[N, 8]`` ``.npy`` is generated in a temporary folder (default 4 GB: 125,000,000
rows; ``--gb``), its page cache warm, and removed at the end. One child process times, in
each round and alternating, a hand-written ``numba.njit(parallel=True)`` loop over
``np.load(path, mmap_mode="r")`` (the baseline: what the machine does, written the way
a numba user would write it, in lanes so that it vectorises) and tierflow's compute of
the same result on the default threads executor:

* ``sum``: ``x.sum(axis=0)``;
* ``expr``: ``np.sqrt(x * 2 + 1).sum(axis=0)`` (float32 arithmetic, float64 sums);
* ``mean+std``: ``tw.compute(x.mean(axis=0), x.std(axis=0))`` (one pass);
* ``var``: ``x.var(axis=0)``;
* ``masked``: ``x[x[:, 0] > 0.5].sum(axis=0)``;
* ``hist``: ``np.histogram(np.sqrt(x[:, 0] * 2 + 1), bins=64, range=(1, 1.75))``;
* ``xtx``: ``x.T @ x``.

Each figure is the loop's time over tierflow's in the same round (above 1: tierflow is
faster), median (min-max) over the rounds; the results are compared with the loop's
(float32 results within 1e-5 relative, counts exactly). A warm-up round, not counted,
compiles both sides first (``jit="eager"``; the kernel folder is the child's own).

``first``: in fresh processes over a 320 MB file (over ``jit_min_bytes``, 256 MB, from
which a compute asks for a kernel), the first compute of an expression no kernel exists
for, with the default ``jit`` against ``jit=False`` (the tiered path never waits for the
compiler), five pairs alternating, each first compute with a kernel folder of its own
(the figure is the ratio of the medians), and a third process that waits for the last
one's kernel (``jit="eager"``), whose
profile must say ``read from disk``: a kernel is compiled once per machine. The third
starts once the kernel the first asked for is on disk: the compiling process finishes
it after the first has ended.

``python tests/benchmarks/bench_kernels.py [--gb 4] [--rounds 5] [--dir /tmp] [--json f]``
prints the figures (run anything over 0.5 GB under ``flock /tmp/tierflow-bench.lock``).
``make bench`` runs the pytest-benchmark test below on a small file
(``TIERFLOW_BENCH_KERNELS_SIZE_MB``, default 64), which checks the results.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's tierflow

from _harness import emit, ensure_warm, make_npy, report_run, run_sampled

MB = 1 << 20
WIDTH = 8
TIMEOUT_S = 3600.0
SIZE_MB = float(os.environ.get("TIERFLOW_BENCH_KERNELS_SIZE_MB", "64"))
FIGURES = ("sum", "expr", "mean+std", "var", "masked", "hist", "xtx")
TARGETS = {"sum": 0.8, "expr": 0.8, "mean+std": 0.7, "var": 0.7, "masked": 0.6, "hist": 0.6,
           "xtx": 0.5}  # fmt: skip
LANES = 128  # lanes of the hand-written sums (a multiple of WIDTH) ...
MOMENT_LANES = 64  # ... and of the moments (two sums: 128 lanes each spill registers)
CHUNKS = 512  # pieces of rows the hand-written loops split the file into
BINS, LOW, HIGH = 64, 1.0, 1.75
FIRST_MB = 320  # over jit_min_bytes
FIRST_REPEATS = 5  # pairs of fresh processes (one compute each: noisy)


def _folds() -> tuple[Any, Any, Any]:
    """Column sums in lanes, of ``x`` or ``sqrt(x * 2 + 1)``, and the sums and squares of
    the deviations from a shift, over one piece of the flat file: the loops a numba user
    writes for sum, mean, var. Each piece is sliced and looped from 0: an index numba
    cannot prove non-negative gets a wraparound test, and the loop no longer vectorises
    (3x slower)."""
    from numba import njit

    @njit(nogil=True, error_model="numpy", boundscheck=False)
    def fold_sum(part: Any, s1: Any) -> None:
        whole = part.size - part.size % LANES
        for b in range(0, whole, LANES):
            for j in range(LANES):
                s1[j] += part[b + j]
        for j in range(part.size - whole):
            s1[j] += part[whole + j]

    @njit(nogil=True, error_model="numpy", boundscheck=False)
    def fold_expr(part: Any, s1: Any) -> None:
        whole = part.size - part.size % LANES
        for b in range(0, whole, LANES):
            for j in range(LANES):
                s1[j] += np.sqrt(part[b + j] * np.float32(2) + np.float32(1))
        for j in range(part.size - whole):
            s1[j] += np.sqrt(part[whole + j] * np.float32(2) + np.float32(1))

    @njit(nogil=True, error_model="numpy", boundscheck=False)
    def fold_moments(part: Any, shift: Any, s1: Any, s2: Any) -> None:
        whole = part.size - part.size % MOMENT_LANES
        for b in range(0, whole, MOMENT_LANES):
            for j in range(MOMENT_LANES):
                d = np.float64(part[b + j]) - shift[j]
                s1[j] += d
                s2[j] += d * d
        for j in range(part.size - whole):
            d = np.float64(part[whole + j]) - shift[j]
            s1[j] += d
            s2[j] += d * d

    return fold_sum, fold_expr, fold_moments


def _lane_sums() -> Any:
    """The three folds of :func:`_folds` over the file's pieces, on every core."""
    from numba import njit, prange

    fold_sum, fold_expr, fold_moments = _folds()

    @njit(parallel=True, nogil=True)
    def lane_sums(flat: Any, shift: Any, kind: int) -> Any:  # kind: 0 sum, 1 expr, 2 moments
        n = flat.size
        step = (n // LANES + CHUNKS - 1) // CHUNKS * LANES
        out = np.zeros((CHUNKS, 2, LANES))
        for c in prange(CHUNKS):
            part = flat[min(n, c * step) : min(n, (c + 1) * step)]
            if kind == 0:
                fold_sum(part, out[c, 0])
            elif kind == 1:
                fold_expr(part, out[c, 0])
            else:
                fold_moments(part, shift, out[c, 0], out[c, 1])
        return out.sum(axis=0).reshape(2, LANES // WIDTH, WIDTH).sum(axis=1)

    return lane_sums


def _row_loops() -> dict[str, Any]:
    """The loops over rows: a masked sum, a histogram of a column, ``x.T @ x``, each
    over a slice of rows looped from 0 (see :func:`_lane_sums`)."""
    from numba import njit, prange

    @njit(parallel=True, nogil=True, error_model="numpy", boundscheck=False)
    def masked(x: Any) -> Any:
        rows = x.shape[0]
        step = (rows + CHUNKS - 1) // CHUNKS
        out = np.zeros((CHUNKS, WIDTH))
        for c in prange(CHUNKS):
            part = x[min(rows, c * step) : min(rows, (c + 1) * step)]
            acc = out[c]
            for i in range(part.shape[0]):
                if part[i, 0] > np.float32(0.5):
                    for j in range(WIDTH):
                        acc[j] += part[i, j]
        return out.sum(axis=0)

    @njit(parallel=True, nogil=True, error_model="numpy", boundscheck=False)
    def hist(x: Any) -> Any:
        rows = x.shape[0]
        step = (rows + CHUNKS - 1) // CHUNKS
        out = np.zeros((CHUNKS, BINS), np.int64)
        scale = BINS / (HIGH - LOW)
        for c in prange(CHUNKS):
            part = x[min(rows, c * step) : min(rows, (c + 1) * step)]
            counts = out[c]
            for i in range(part.shape[0]):
                v = np.sqrt(part[i, 0] * np.float32(2) + np.float32(1))
                if v >= LOW and v <= HIGH:
                    counts[min(int((v - LOW) * scale), BINS - 1)] += 1
        return out.sum(axis=0)

    @njit(parallel=True, nogil=True, error_model="numpy", boundscheck=False)
    def xtx(x: Any) -> Any:
        rows = x.shape[0]
        step = (rows + CHUNKS - 1) // CHUNKS
        out = np.zeros((CHUNKS, WIDTH, WIDTH))
        for c in prange(CHUNKS):
            part = x[min(rows, c * step) : min(rows, (c + 1) * step)]
            acc = out[c]
            for i in range(part.shape[0]):
                for a in range(WIDTH):
                    va = np.float64(part[i, a])
                    for b in range(WIDTH):
                        acc[a, b] += va * part[i, b]
        return out.sum(axis=0)

    return {"masked": masked, "hist": hist, "xtx": xtx}


def _loops() -> dict[str, Any]:
    """The hand-written numba loops (compiled on first call)."""
    import numba

    numba.set_num_threads(os.cpu_count() or 1)
    return {"lane_sums": _lane_sums(), **_row_loops()}


def _hand(figure: str, m: np.ndarray, loops: dict[str, Any]) -> Any:
    flat = m.reshape(-1)
    n = m.shape[0]
    if figure in ("sum", "expr"):
        return loops["lane_sums"](flat, np.zeros(LANES), int(figure == "expr"))[0]
    if figure in ("mean+std", "var"):
        shift = np.tile(m[0].astype(np.float64), MOMENT_LANES // WIDTH)
        s1, s2 = loops["lane_sums"](flat, shift, 2)
        mean = m[0] + s1 / n
        var = (s2 - s1 * s1 / n) / n
        return (mean, np.sqrt(var)) if figure == "mean+std" else var
    if figure == "masked":
        return loops["masked"](m)
    if figure == "hist":
        return loops["hist"](m)
    return loops["xtx"](m)


def _tierflow(figure: str, x: Any, jit: Any = None) -> Any:
    import tierflow as tw

    options = {"progress": False, "jit": jit}
    if figure == "sum":
        return x.sum(axis=0).compute(**options)
    if figure == "expr":
        return np.sqrt(x * 2 + 1).sum(axis=0).compute(**options)
    if figure == "mean+std":
        return tw.compute(x.mean(axis=0), x.std(axis=0), **options)
    if figure == "var":
        return x.var(axis=0).compute(**options)
    if figure == "masked":
        return x[x[:, 0] > 0.5].sum(axis=0).compute(**options)
    if figure == "hist":
        counts, _ = np.histogram(np.sqrt(x[:, 0] * 2 + 1), bins=BINS, range=(LOW, HIGH))
        return counts.compute(**options)
    return (x.T @ x).compute(**options)


def _agree(figure: str, got: Any, want: Any) -> bool:
    if figure == "hist":
        return bool(np.array_equal(np.asarray(got), np.asarray(want)))
    pairs = zip(got, want, strict=True) if figure == "mean+std" else [(got, want)]
    return all(np.allclose(np.asarray(g, np.float64), w, rtol=1e-5, atol=1e-9) for g, w in pairs)


def child(path: str, rounds: int) -> None:
    """The measurement (a child process): every figure, ``rounds`` times."""
    import tierflow as tw

    m = np.load(path, mmap_mode="r")
    x = tw.from_npy(path)
    loops = _loops()
    correct: dict[str, bool] = {}
    for figure in FIGURES:  # warm-up: both sides compile, and the results are compared
        correct[figure] = _agree(figure, _tierflow(figure, x, "eager"), _hand(figure, m, loops))
    times: dict[str, dict[str, list[float]]] = {f: {"hand": [], "tierflow": []} for f in FIGURES}
    for _ in range(rounds):
        for figure in FIGURES:
            ensure_warm(path)
            start = time.perf_counter()
            _hand(figure, m, loops)
            times[figure]["hand"].append(time.perf_counter() - start)
            start = time.perf_counter()
            _tierflow(figure, x)
            times[figure]["tierflow"].append(time.perf_counter() - start)
    emit({"bytes": os.path.getsize(path), "times": times, "correct": correct})


_FIRST = """
import sys, time, numpy as np, tierflow as tw
x = tw.from_npy(sys.argv[1])
jit = {"default": None, "off": False, "eager": "eager"}[sys.argv[2]]
start = time.perf_counter()
with tw.profile() as p:
    np.sqrt(abs(x * 0.5 - 0.25)).max(axis=0).compute(progress=False, jit=jit)
print(time.perf_counter() - start)
print(p.computes[-1].kernels[0])
"""


def first_compute(path: str, folder: str, repeats: int = FIRST_REPEATS) -> dict[str, Any]:
    """Fresh processes over ``path``: the first compute of a new expression with the
    default jit and without, ``repeats`` times (alternating, each first compute with a
    kernel folder of its own), then, once the last one's kernel is on disk, a third
    that waits for it."""
    found: dict[str, Any] = {"numpy": [], "first": []}
    kernels = ""
    for repeat in range(repeats):
        kernels = os.path.join(folder, f"first-kernels-{repeat}")
        env = {**os.environ, "TIERFLOW_KERNEL_DIR": kernels}
        for name, jit in (("numpy", "off"), ("first", "default")):
            done = subprocess.run(
                [sys.executable, "-c", _FIRST, path, jit],
                capture_output=True, text=True, env=env, timeout=600, check=True,
            )  # fmt: skip
            found[name].append(float(done.stdout.strip().splitlines()[-2]))
        # its kernel is compiled after it ended: wait for that (and for the compiling
        # process to be done before the next measurement)
        start = time.perf_counter()
        while not list(Path(kernels).glob("*/__pycache__/*.nbi")):
            if time.perf_counter() - start > 120:
                break
            time.sleep(0.05)
        found["compiled after exit"] = time.perf_counter() - start
        time.sleep(0.5)
    env = {**os.environ, "TIERFLOW_KERNEL_DIR": kernels}
    done = subprocess.run(
        [sys.executable, "-c", _FIRST, path, "eager"],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    )  # fmt: skip
    found["second"] = done.stdout.strip().splitlines()[-1]
    return found


def bench(size_mb: float, rounds: int, folder: str | None = None) -> dict[str, Any]:
    where = tempfile.mkdtemp(prefix="tierflow-bench-kernels-", dir=folder)
    try:
        rows = int(size_mb * MB) // (4 * WIDTH)
        src = str(make_npy(os.path.join(where, "x.npy"), rows, WIDTH))
        small = str(make_npy(os.path.join(where, "small.npy"), FIRST_MB * MB // (4 * WIDTH), WIDTH))
        ensure_warm(src)
        env = {**os.environ, "TIERFLOW_KERNEL_DIR": os.path.join(where, "kernels")}
        cmd = [sys.executable, os.path.abspath(__file__), "--child", src, str(rounds)]
        result = run_sampled(cmd, timeout=TIMEOUT_S, env=env)
        report = result.figures()
        report["rows"] = rows
        report["returncode"] = result.returncode
        if result.returncode != 0:
            report["error"] = result.stderr[-2000:]
            return report
        ensure_warm(small)
        report["first"] = first_compute(small, where)
        return report
    finally:
        shutil.rmtree(where, ignore_errors=True)


def ratios(report: dict[str, Any]) -> dict[str, list[float]]:
    """Per figure, the hand-written loop's time over tierflow's in each round."""
    return {
        f: [h / t for h, t in zip(v["hand"], v["tierflow"], strict=True)]
        for f, v in report["times"].items()
    }


def describe(report: dict[str, Any]) -> list[str]:
    if report.get("returncode") != 0:
        return [f"failed: exit {report.get('returncode')} {report.get('error', '')[-500:]}"]
    gb = report["bytes"] / 1e9
    rounds = len(report["times"]["sum"]["hand"])
    lines = [f"{report['rows']:,} rows x {WIDTH} float32 ({gb:.2f} GB), page cache warm, "
             f"{rounds} rounds"]  # fmt: skip
    for figure, values in ratios(report).items():
        hand = gb / statistics.median(report["times"][figure]["hand"])
        ours = gb / statistics.median(report["times"][figure]["tierflow"])
        lines.append(
            f"  {figure:>9}: {statistics.median(values):.2f}x the loop "
            f"({min(values):.2f}-{max(values):.2f}; loop {hand:.1f} GB/s, tierflow "
            f"{ours:.1f} GB/s; target {TARGETS[figure]}x); results agree: "
            f"{report['correct'][figure]}"
        )
    first = report.get("first")
    if first:
        each = [f / n for f, n in zip(first["first"], first["numpy"], strict=True)]
        lines.append(
            f"  first compute of a new expression over {FIRST_MB} MB: "
            f"{statistics.median(first['first']) / statistics.median(first['numpy']):.2f}x "
            f"the NumPy path's time, medians of {len(each)} (each pair: "
            f"{', '.join(f'{r:.2f}' for r in each)}; target <= 1.2); on disk "
            f"{first['compiled after exit']:.1f} s after it ended; a new process: "
            f"{first['second']}"
        )
    return lines


def test_kernels_against_hand_written_loops(benchmark: Any) -> None:
    pytest = __import__("pytest")
    pytest.importorskip("numba")
    benchmark.group = "engine: compiled kernels against a hand-written numba loop"
    report = benchmark.pedantic(bench, args=(SIZE_MB, 2), rounds=1, iterations=1)
    print("\n".join(describe(report)))
    assert report["returncode"] == 0, report.get("error")
    assert all(report["correct"].values()), report["correct"]
    assert "read from disk" in report["first"]["second"]
    benchmark.extra_info.update({k: statistics.median(v) for k, v in ratios(report).items()})


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0, help="file size (4: 125M rows)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the temporary files go")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    report_run(lambda: bench(args.gb * 1e9 / MB, args.rounds, args.dir), describe, args.json)


if __name__ == "__main__":
    main()
