"""An array bigger than the RAM budget: tierflow puts it in a spill file on the SSD.

    python examples/spill_array.py

The budget is set to 64 MB, so a 256 MB array does not fit (sizes are binary: 1 MB is
2**20 bytes, as in every tierflow setting and message) and ``memory.array`` returns
an ``np.memmap`` over a reserved file under ``~/.tierflow/spill`` (or
``TIERFLOW_SPILL_DIR``). The same NumPy code fills and reads it. The file is deleted by
``memory.free`` (or when the array is garbage-collected, or at exit).
"""

from __future__ import annotations

import os
import time

import numpy as np

from tierflow import memory
from tierflow.storage.spill import spill_file_of


def main() -> None:
    memory.budget("64MB")

    small = memory.array((1000, 8), "float32")  # 31 KB: fits the budget, in RAM
    big = memory.array((1 << 24, 4), "float32")  # 256 MB: over the budget, on the SSD
    print(f"small in RAM: {not memory.on_disk(small)}; big on the SSD: {memory.on_disk(big)}")

    start = time.perf_counter()
    rows = 1 << 20
    for i in range(0, big.shape[0], rows):  # fill in row blocks, as the engine does
        block = big[i : i + rows]
        block[:] = np.arange(i, i + len(block), dtype=np.float32)[:, None]
    big.flush()
    seconds = time.perf_counter() - start
    print(f"filled {big.nbytes / 2**20:.0f} MB in {seconds:.2f} s")
    print(f"column sums: {big.sum(axis=0, dtype=np.float64)}")
    print(f"a view is on the SSD too: {memory.on_disk(big[10:20])}")

    print()
    print(memory.report())
    print()

    record = spill_file_of(big)
    assert record is not None
    print(f"big lives in {record.path} ({os.path.getsize(record.path)} bytes)")
    memory.free(big)
    print(f"after memory.free(big) the file exists: {os.path.exists(record.path)}")


if __name__ == "__main__":
    main()
