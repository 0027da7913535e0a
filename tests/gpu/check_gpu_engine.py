"""Check the engine's operators on a real CUDA GPU, and measure them.

Run it on a machine with a GPU and torch built for CUDA (under 5 minutes on one GPU)::

    python tests/gpu/check_gpu_engine.py

Checks, one PASS/FAIL line each (exit 1 if any failed):

* fused expressions and reductions computed with ``device="cuda"`` against NumPy;
* the feature-extraction example (``examples/feature_extraction.py``) on the GPU;
* a GPU model that allocates more than the GPU has is halved until it fits;
* ``persist(device="cuda")`` keeps blocks on the GPU, and a GPU compute over them,
  once another tensor takes most of the device, spills them to the host first.

Figures, one FIGURE line each, with their targets (a missed target is reported, not
failed): the host-to-device copy bandwidth from pinned memory; a fused expression plus
a sum over data in RAM on the GPU and on the CPU, as GB/s, as a ratio, and against the
copy bandwidth (target >= 0.8x); copies overlapped with compute (double buffering)
against serial copies; feature extraction over 20,000 small ``.npy`` files with tierflow
against a hand-written DataLoader loop, both on the GPU
(``tests/benchmarks/bench_features.py --device cuda``: the loop's time over tierflow's,
target >= 1.0x; the outputs must agree, or the check fails).

Prints SKIP and exits 0 where torch is missing or sees no CUDA device. Not collected by
pytest (no ``test_`` prefix): ``tests/engine/gpu/test_gpu_ops.py`` runs the same code paths
everywhere on simulated GPUs. Spill files go to a temporary folder.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import check, figure, results

GB = 1 << 30
MB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def _timed(fn: Callable[[], Any], repeat: int = 3) -> float:
    """The best of ``repeat`` wall times of ``fn()``, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _copy_bandwidth(torch: Any) -> float:
    """Host-to-device bytes/s from a pinned 256 MB buffer, on a side stream."""
    src = torch.empty(256 * MB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(256 * MB, dtype=torch.uint8, device="cuda:0")
    stream = torch.cuda.Stream()

    def copy() -> None:
        with torch.cuda.stream(stream):
            for _ in range(8):
                dst.copy_(src, non_blocking=True)
        stream.synchronize()

    copy()
    return 8 * 256 * MB / _timed(copy)


def _correctness_checks(torch: Any) -> list[Callable[[], None]]:
    import tierflow as tw

    rng = np.random.default_rng(0)
    a = rng.standard_normal((300_000, 8)).astype(np.float32)
    x = tw.from_array(a, rows=65_536)

    @check("fused expressions on the GPU match NumPy (dtypes, values)")
    def _expressions() -> None:
        cases = {
            "arithmetic": (lambda v: (v * 2 + 1) / 3 - v, lambda v: (v * 2 + 1) / 3 - v),
            "transcendental": (
                lambda v: np.exp(-(v**2)) + np.log1p(abs(v)),
                lambda v: np.exp(-(v**2)) + np.log1p(abs(v)),
            ),
            "where": (lambda v: tw.where(v > 0.5, v, -v), lambda v: np.where(v > 0.5, v, -v)),
            "int cast": (
                lambda v: (v * 10).astype(np.int16) // 3,
                lambda v: (v * 10).astype(np.int16) // 3,
            ),
        }
        for name, (lazy, eager) in cases.items():
            got = lazy(x).compute(device="cuda")
            want = eager(a)
            assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6, err_msg=name)

    @check("reductions on the GPU match NumPy (float32 within rtol=1e-6 of float64)")
    def _reductions() -> None:
        ref = a.astype(np.float64)
        for kind in ("sum", "mean", "min", "max", "prod"):
            for axis in (0, None):
                v = x * 0.001 + 1
                got = getattr(v, kind)(axis=axis).compute(device="cuda")
                want = getattr(np, kind)(ref * 0.001 + 1, axis=axis)
                np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{kind} {axis}")
        ints = (a * 1000).astype(np.int32)
        got = (tw.from_array(ints, rows=65_536) * 3).sum(axis=0).compute(device="cuda")
        np.testing.assert_array_equal(got, (ints * 3).sum(axis=0))

    @check("a chain through a GPU model copies each block in once and partials out")
    def _chain() -> None:
        from tierflow.engine.gpu import transfer

        y = ((x - 0.5) * 2).map_blocks(lambda t: torch.relu(t) * 3, device="cuda").sum(axis=0)
        transfer.reset_stats()  # after the probe block's copies
        got = y.compute()
        want = (np.maximum((a.astype(np.float64) - 0.5) * 2, 0) * 3).sum(axis=0)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        s = transfer.stats("cuda:0")
        blocks = -(-len(a) // 65_536)
        assert (s.h2d, s.h2d_bytes, s.d2h) == (blocks, a.nbytes, blocks), s

    return [_expressions, _reductions, _chain]


def _example_check() -> Callable[[], None]:
    @check("examples/feature_extraction.py runs its model on the GPU and matches it")
    def _example() -> None:
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "feature_extraction.py"), "--files", "2000"],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
        )
        print(done.stdout[-2000:])
        assert done.returncode == 0, done.stderr[-2000:]
        assert "on cuda:" in done.stdout, "the model did not run on a GPU"
        assert "match the model run directly: True" in done.stdout

    return _example


def _figures(torch: Any) -> list[Callable[[], None]]:
    import tierflow as tw
    from tierflow.engine.gpu import transfer
    from tierflow.engine.io.memory import ArrayReader

    @check("figures: copy bandwidth, fused expression plus sum, overlap")
    def _measure() -> None:
        bandwidth = _copy_bandwidth(torch)
        figure(f"host-to-device copy from pinned memory: {bandwidth / 1e9:.1f} GB/s")

        a = np.random.default_rng(1).standard_normal((1 << 25, 16), dtype=np.float32)  # 2 GB
        x = tw.from_array(a, rows=1 << 20)  # 64 MB blocks
        y = np.sqrt(x * x + 1).sum(axis=0)
        gpu = y.compute(device="cuda", progress=False)  # warm: CUDA, the lane, the buffers
        np.testing.assert_allclose(gpu, y.compute(device="cpu", progress=False), rtol=1e-5)
        gpu_s = _timed(lambda: y.compute(device="cuda", progress=False), 2)
        cpu_s = _timed(lambda: y.compute(device="cpu", progress=False), 2)
        rate = a.nbytes / gpu_s
        figure(
            f"sqrt(x*x+1).sum(0) over {a.nbytes / GB:.0f} GB in RAM: GPU {rate / 1e9:.1f} GB/s, "
            f"CPU {a.nbytes / cpu_s / 1e9:.1f} GB/s, GPU/CPU {cpu_s / gpu_s:.2f}x, "
            f"GPU/copy bandwidth {rate / bandwidth:.2f}x "
            f"(target >= 0.8x: {'met' if rate >= 0.8 * bandwidth else 'missed'})"
        )

        # Overlap: the same copies and the same compute, the copy of block i + 1 issued
        # before block i computes, against one after the other.
        lane = transfer.lane("cuda:0")
        reader = ArrayReader(a[: 16 << 20])
        rows, blocks = 1 << 20, 16

        def heavy(t: Any) -> None:
            for _ in range(30):
                t = torch.sin(t) * 1.0001
            float(t[0, 0])

        def run(readahead: bool) -> None:
            for i in range(blocks):
                a0, b0 = i * rows, (i + 1) * rows
                copy = lane.take(i, reader, a0, b0)
                if readahead and i + 1 < blocks:
                    lane.stage(i + 1, reader, b0, b0 + rows)
                with lane.computing():
                    heavy(lane.ready(copy))

        run(True)
        serial = _timed(lambda: run(False), 2)
        overlapped = _timed(lambda: run(True), 2)
        figure(
            f"{blocks} blocks of 64 MB copied and computed: serial {serial:.2f} s, double "
            f"buffered {overlapped:.2f} s ({serial / overlapped:.2f}x)"
        )

    return [_measure]


def _features_check() -> Callable[[], None]:
    @check("feature extraction on the GPU: tierflow against a DataLoader loop")
    def _features() -> None:
        bench = ROOT / "tests" / "benchmarks" / "bench_features.py"
        done = subprocess.run(
            [sys.executable, str(bench), "--files", "20000", "--rounds", "3", "--device", "cuda"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        print(done.stdout[-3000:])
        assert done.returncode == 0, done.stderr[-2000:]
        ratio = next(line for line in done.stdout.splitlines() if "the DataLoader loop" in line)
        figure(f"feature extraction, 20,000 files on the GPU: {ratio.strip()}")
        assert "outputs agree: True" in done.stdout, "the two outputs differ"

    return _features


def _halving_check(torch: Any) -> Callable[[], None]:
    import tierflow as tw
    from tierflow.engine.program import halving

    @check("a GPU model allocating more than the GPU has is halved until it fits")
    def _halving() -> None:
        free, _ = torch.cuda.mem_get_info(0)
        per_row = free // 1000  # above ~1000 rows the allocation cannot succeed
        sizes: list[int] = []

        def model(t: Any) -> Any:
            sizes.append(len(t))
            scratch = torch.empty(len(t) * per_row, dtype=torch.uint8, device=t.device)
            del scratch
            return t * 2

        a = np.arange(20_000 * 4, dtype=np.float32).reshape(20_000, 4)
        halving.forget()
        try:
            y = tw.from_array(a, rows=20_000).map_blocks(model, device="cuda")
            sizes.clear()
            got = y.compute(executor="serial", progress=False)
        finally:
            halving.forget()
        np.testing.assert_array_equal(got, a * 2)
        oversized = sum(1 for n in sizes if n * per_row > free)
        figure(
            f"halving 20,000 rows where ~1,000 fit: {len(sizes)} calls, {oversized} oversized "
            f"(target <= 6: {'met' if oversized <= 6 else 'missed'})"
        )

    return _halving


def _persist_check(torch: Any) -> Callable[[], None]:
    import tierflow as tw

    @check("persist(device='cuda') keeps blocks on the GPU and spills under GPU pressure")
    def _persist() -> None:
        a = np.random.default_rng(2).standard_normal((1 << 22, 16), dtype=np.float32)  # 256 MB
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(0)
        kept = (tw.from_array(a, rows=1 << 20) * 2).persist(device="cuda:0", progress=False)
        reader: Any = getattr(kept._node, "reader")  # noqa: B009 - the node is a Source
        torch.cuda.synchronize()
        on_gpu = torch.cuda.memory_allocated(0) - before
        assert reader.where() == ["gpu"] * 4, reader.where()
        assert on_gpu >= a.nbytes, f"{on_gpu} bytes on the GPU for {a.nbytes}"
        free, _ = torch.cuda.mem_get_info(0)
        hog = torch.empty(int(free * 0.97), dtype=torch.uint8, device="cuda:0")
        try:
            got = (kept + 1).sum(axis=0).compute(device="cuda:0", progress=False)
            np.testing.assert_allclose(got, (a.astype(np.float64) * 2 + 1).sum(axis=0), rtol=1e-5)
            tiers = reader.where()
            figure(
                f"persist: {on_gpu / 2**20:.0f} MB on the GPU; with another tensor taking 97 % "
                f"of the free memory, the blocks are on {', '.join(tiers)}"
            )
            assert "gpu" not in tiers, f"the blocks stayed on the GPU under pressure: {tiers}"
        finally:
            del hog
            gc.collect()
            torch.cuda.empty_cache()

    return _persist


def main() -> int:
    os.environ.setdefault("TIERFLOW_SPILL_DIR", tempfile.mkdtemp(prefix="tierflow-gpu-check-"))
    try:
        import torch
    except ImportError:
        print("SKIP torch is not installed: pip install -e '.[torch]' with a CUDA build")
        return 0
    if not torch.cuda.is_available():
        print("SKIP torch sees no CUDA device: nothing to check on this machine")
        return 0
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    start = time.perf_counter()
    checks = [
        *_correctness_checks(torch),
        _example_check(),
        *_figures(torch),
        _features_check(),
        _halving_check(torch),
        _persist_check(torch),
    ]
    for run in checks:
        run()
    failed = [name for name, ok in results if not ok]
    print(
        f"{len(results) - len(failed)} passed, {len(failed)} failed "
        f"in {time.perf_counter() - start:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
