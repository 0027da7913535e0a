"""Feature extraction over many small files with a torch model, on all cores or a GPU.

    python examples/feature_extraction.py                 # 200 files
    python examples/feature_extraction.py --files 20000   # a bigger run

It writes ``--files`` small ``.npy`` files to a temporary folder (removed at the end),
each one sample of shape (3, 32, 32), say a tiny image. Then:

1. ``tw.from_files(paths, np.load)``: a lazy array with one row per file; the files are
   loaded in the workers, a block of files at a time, never all at once (with
   ``np.load``, each file's data is read straight into its row of the block);
2. ``map_blocks(embed, device="auto")``: a small ``torch.nn.Sequential`` (random weights,
   seeded) turns each block of samples into a block of 64-number embeddings. With
   ``device="auto"`` the blocks arrive as torch tensors on the GPU with the most free
   memory, or on the CPU where there is none, in batches of about 1 MB (85 samples)
   there; a block too big for the GPU is retried in halves;
3. ``to_npy`` writes the embeddings, one row per file, in the order of ``paths``.

The first rows are compared with running the model directly on the same files.
torch is optional: without it the example says how to install it and exits with 0.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

import tierflow as tw
from tierflow.errors import install_command

SAMPLE_SHAPE = (3, 32, 32)
EMBEDDING = 64


def write_samples(folder: str, n: int) -> list[str]:
    """``n`` float32 ``.npy`` files of SAMPLE_SHAPE; returns their paths, in order."""
    rng = np.random.default_rng(3)
    paths = []
    for i in range(n):
        path = os.path.join(folder, f"sample-{i:06d}.npy")
        np.save(path, rng.standard_normal(SAMPLE_SHAPE, dtype=np.float32))
        paths.append(path)
    return paths


def make_model(torch: Any) -> Any:
    """A small convolutional encoder with seeded random weights, in eval mode."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, EMBEDDING),
    ).eval()


class Embedder:
    """``embed(block)`` for ``map_blocks``: the model applied to a block of samples.

    The engine calls it from several threads, with tensors on the device it chose, so
    it keeps one copy of the model per device, made on first use under a lock (moving
    one shared model with ``.to()`` from several threads at once would race).
    """

    def __init__(self, torch: Any, model: Any) -> None:
        self.torch = torch
        self.model = model
        self.copies: dict[str, Any] = {}
        self.lock = threading.Lock()

    def on(self, device: Any) -> Any:
        key = str(device)
        with self.lock:
            if key not in self.copies:
                self.copies[key] = copy.deepcopy(self.model).to(device)
            return self.copies[key]

    def __call__(self, block: Any) -> Any:
        with self.torch.no_grad():
            return self.on(block.device)(block)


def run(n_files: int, folder: str | None) -> None:
    try:
        import torch
    except ImportError:
        print(
            f"this example needs torch, an optional extra: {install_command('torch')} "
            "(or see https://pytorch.org for a CUDA build); skipping"
        )
        return
    if not torch.cuda.is_available():
        # The engine already runs one block per core; one torch thread per block
        # avoids cores x cores threads fighting over the CPU.
        torch.set_num_threads(1)

    workdir = tempfile.mkdtemp(prefix="tierflow-features-", dir=folder)
    try:
        start = time.perf_counter()
        paths = write_samples(workdir, n_files)
        print(
            f"wrote {n_files:,} files of shape {SAMPLE_SHAPE} float32 to {workdir} "
            f"in {time.perf_counter() - start:.2f} s"
        )

        embed = Embedder(torch, make_model(torch))
        # dtype and row_shape are known, so the engine does not probe any file or call
        # the model before the compute.
        x = tw.from_files(paths, np.load, dtype="float32", row_shape=SAMPLE_SHAPE)
        features = x.map_blocks(embed, dtype="float32", row_shape=(EMBEDDING,), device="auto")
        print(repr(features))

        target = os.path.join(workdir, "embeddings.npy")
        start = time.perf_counter()
        features.to_npy(target, progress=False)
        seconds = time.perf_counter() - start
        devices = ", ".join(sorted(embed.copies)) or "none"
        print(
            f"embedded {n_files:,} files in {seconds:.2f} s ({n_files / seconds:,.0f} files/s) "
            f"on {devices}"
        )

        out = np.load(target)
        print(f"{target}: {out.shape} {out.dtype}")
        print(f"first embedding, first 6 numbers: {np.round(out[0, :6], 4)}")

        # The same files through the same model directly, on the device the engine used.
        device = next(iter(embed.copies), "cpu")
        check = min(16, n_files)
        batch = torch.from_numpy(np.stack([np.load(p) for p in paths[:check]])).to(device)
        with torch.no_grad():
            direct = embed.on(device)(batch).cpu().numpy()
        # A GPU may pick other kernels (TF32 convolutions) for another batch size.
        tol = 1e-5 if device == "cpu" else 2e-3
        diff = float(np.abs(out[:check] - direct).max())
        same = np.allclose(out[:check], direct, rtol=tol, atol=tol)
        print(f"the first {check} rows match the model run directly: {same} (max diff {diff:.1e})")
        if not same:
            sys.exit("the embeddings do not match the model run directly")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200, help="number of sample files (200)")
    parser.add_argument("--dir", default=None, help="parent of the temporary folder (TMPDIR)")
    args = parser.parse_args()
    if args.files < 1:
        parser.error(f"--files must be at least 1, got {args.files}")
    run(args.files, args.dir)


if __name__ == "__main__":
    main()
