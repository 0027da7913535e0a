"""Feature extraction over many small files: tierflow against a hand-written DataLoader loop.

``--files`` (default 20,000) float32 ``.npy`` files of shape (3, 32, 32) are written to a
temporary folder (removed at the end) and read once, so the page cache is warm. One
child process, with ``torch.set_num_threads(2)``, times in each round, alternating:

* ``loop``: what a torch user writes by hand: a ``torch.utils.data.DataLoader(dataset,
  batch_size=256, num_workers=2)`` over a Dataset whose ``__getitem__`` is
  ``np.load(path)``, the model under ``torch.inference_mode()``, each batch's
  embeddings written into an ``np.lib.format.open_memmap`` output;
* ``tierflow``: ``tw.from_files(paths, np.load, dtype=, row_shape=)
  .map_blocks(embed, device="auto").to_npy(out)``, as in
  ``examples/feature_extraction.py`` (whose model and ``Embedder`` both sides use).

Both run once before the rounds (the DataLoader's workers, the model's first call, the
engine's imports). The figure is the loop's time over tierflow's in the same round
(above 1: tierflow is faster), median (min-max) over the rounds. The two outputs are
compared: on the CPU they are identical (the convolutions of a sample do not depend on
the other samples in its batch), on a GPU within 2e-3 (TF32 kernels vary with the batch).

``profile`` (in the same child, after the rounds): where the time goes, one part at a
time on one thread: loading every file with ``np.load`` against tierflow's reader
(``.npy`` files read straight into the block), and the model over the samples in memory
in the engine's CPU batches (``block_operators.batch_rows``), in the DataLoader's 256,
and in whole default blocks of ``from_files``.

``--device cuda`` runs both sides on a GPU (the loop with ``pin_memory=True`` and
``non_blocking`` copies; tierflow's ``device="auto"`` picks the GPU); the GPU check
(``tests/gpu/check_gpu_engine.py``) runs it so.

``flock /tmp/tierflow-bench.lock python tests/benchmarks/bench_features.py [--files 20000]
[--rounds 5] [--device cpu] [--dir /tmp] [--json f]`` prints the figures. ``make bench``
runs the pytest-benchmark test below on 2,000 files, which checks that the outputs agree.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's tierflow
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from _harness import emit, report_run, run_sampled

TIMEOUT_S = 3600.0
TORCH_THREADS = 2
BATCH = 256  # the DataLoader's batch
LOADERS = 2  # the DataLoader's worker processes
TARGET = 1.0  # the loop's time over tierflow's


def _loop(torch: Any, model: Any, paths: list[str], out: str, device: str) -> None:
    """The hand-written loop: a DataLoader's batches through the model into a memmap."""
    from feature_extraction import EMBEDDING

    class Files(torch.utils.data.Dataset):  # type: ignore[misc,name-defined]
        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, i: int) -> Any:
            return torch.from_numpy(np.load(paths[i]))

    loader = torch.utils.data.DataLoader(
        Files(), batch_size=BATCH, num_workers=LOADERS, pin_memory=device != "cpu"
    )
    result = np.lib.format.open_memmap(
        out, mode="w+", dtype=np.float32, shape=(len(paths), EMBEDDING)
    )
    start = 0
    with torch.inference_mode():
        for batch in loader:
            embedded = model(batch.to(device, non_blocking=True)).cpu().numpy()
            result[start : start + len(embedded)] = embedded
            start += len(embedded)
    result.flush()
    del result


def _tierflow(embed: Any, paths: list[str], out: str) -> None:
    """The same with tierflow, as the example writes it."""
    from feature_extraction import EMBEDDING, SAMPLE_SHAPE

    import tierflow as tw

    x = tw.from_files(paths, np.load, dtype="float32", row_shape=SAMPLE_SHAPE)
    features = x.map_blocks(embed, dtype="float32", row_shape=(EMBEDDING,), device="auto")
    features.to_npy(out, progress=False)


def _fresh(path: str) -> str:
    if os.path.exists(path):
        os.unlink(path)
    return path


def _seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _profile(torch: Any, embed: Any, paths: list[str]) -> dict[str, float]:
    """Seconds of each part alone (module docstring), on the CPU."""
    from feature_extraction import SAMPLE_SHAPE

    from tierflow.engine.graph import block_operators, blocksize
    from tierflow.engine.io.files import FileRows, FilesReader

    rows = FileRows(1, np.dtype(np.float32), SAMPLE_SHAPE)
    per_block = blocksize.files_per_block(len(paths), 4 * int(np.prod(SAMPLE_SHAPE)))
    reader = FilesReader(paths, np.load, rows, per_block)
    found: dict[str, float] = {}
    found["np.load every file"] = _seconds(lambda: [np.load(p) for p in paths])
    blocks: list[np.ndarray] = []
    found["tierflow's reader"] = _seconds(
        lambda: blocks.extend(reader.read_block(j) for j in range(reader.nblocks))
    )
    samples = torch.from_numpy(np.concatenate(blocks))
    model = embed.on("cpu")
    step = block_operators.batch_rows([samples])
    for name, size in ((f"model, batches of {step}", step), (f"model, batches of {BATCH}", BATCH),
                       (f"model, blocks of {per_block}", per_block)):  # fmt: skip
        with torch.inference_mode():
            found[name] = _seconds(
                lambda size=size: [
                    model(samples[a : a + size]) for a in range(0, len(samples), size)
                ]
            )
    return found


def child(folder: str, rounds: int, device: str) -> None:
    """The measurement (a child process): both sides ``rounds`` times, alternating."""
    import torch
    from feature_extraction import Embedder, make_model

    torch.set_num_threads(TORCH_THREADS)
    paths = sorted(str(p) for p in Path(folder).glob("sample-*.npy"))
    embed = Embedder(torch, make_model(torch))
    model = embed.on(device)
    loop_out, ours_out = os.path.join(folder, "loop.npy"), os.path.join(folder, "tierflow.npy")
    _loop(torch, model, paths, _fresh(loop_out), device)  # warm-up, and the outputs compared
    _tierflow(embed, paths, _fresh(ours_out))
    want, got = np.load(loop_out), np.load(ours_out)
    tol = 0.0 if device == "cpu" else 2e-3
    agree = bool(np.allclose(got, want, rtol=tol, atol=tol))
    times: dict[str, list[float]] = {"loop": [], "tierflow": []}
    for _ in range(rounds):
        times["loop"].append(_seconds(lambda: _loop(torch, model, paths, _fresh(loop_out), device)))
        times["tierflow"].append(_seconds(lambda: _tierflow(embed, paths, _fresh(ours_out))))
    emit(
        {
            "files": len(paths),
            "device": device,
            "times": times,
            "agree": agree,
            "identical": bool(np.array_equal(got, want)),
            "max_diff": float(np.abs(got - want).max()),
            "profile": _profile(torch, embed, paths),
        }
    )


def bench(
    files: int, rounds: int, device: str = "cpu", folder: str | None = None
) -> dict[str, Any]:
    from feature_extraction import write_samples

    where = tempfile.mkdtemp(prefix="tierflow-bench-features-", dir=folder)
    try:
        for path in write_samples(where, files):
            Path(path).read_bytes()  # into the page cache
        cmd = [sys.executable, os.path.abspath(__file__), "--child", where, str(rounds), device]
        result = run_sampled(cmd, timeout=TIMEOUT_S)
        report = result.figures()
        report["returncode"] = result.returncode
        if result.returncode != 0:
            report["error"] = result.stderr[-2000:]
        return report
    finally:
        shutil.rmtree(where, ignore_errors=True)


def ratios(report: dict[str, Any]) -> list[float]:
    """The loop's time over tierflow's, per round."""
    t = report["times"]
    return [a / b for a, b in zip(t["loop"], t["tierflow"], strict=True)]


def describe(report: dict[str, Any]) -> list[str]:
    if report.get("returncode") != 0:
        return [f"failed: exit {report.get('returncode')} {report.get('error', '')[-500:]}"]
    values = ratios(report)
    median = statistics.median(values)
    t = report["times"]
    lines = [
        f"{report['files']:,} files of (3, 32, 32) float32 on {report['device']}, torch "
        f"threads {TORCH_THREADS}, {len(values)} rounds",
        f"  tierflow: {median:.2f}x the DataLoader loop ({min(values):.2f}-{max(values):.2f}; "
        f"target >= {TARGET}: {'PASS' if median >= TARGET else 'MISS'})",
        "  per round, loop / tierflow seconds: "
        + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(t["loop"], t["tierflow"], strict=True)),
        f"  outputs agree: {report['agree']} (identical: {report['identical']}, max diff "
        f"{report['max_diff']:.1e})",
        "  profile, each part alone on the CPU, seconds:",
    ]
    lines += [f"    {name}: {seconds:.2f}" for name, seconds in report["profile"].items()]
    return lines


def test_features_against_a_dataloader_loop(benchmark: Any) -> None:
    pytest = __import__("pytest")
    pytest.importorskip("torch")
    benchmark.group = "engine: feature extraction against a DataLoader loop"
    report = benchmark.pedantic(bench, args=(2000, 2), rounds=1, iterations=1)
    print("\n".join(describe(report)))
    assert report["returncode"] == 0, report.get("error")
    assert report["agree"] and report["identical"], report["max_diff"]
    benchmark.extra_info["ratio"] = statistics.median(ratios(report))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dir", default=None, help="where the temporary files go")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    report_run(lambda: bench(args.files, args.rounds, args.device, args.dir), describe, args.json)


if __name__ == "__main__":
    main()
