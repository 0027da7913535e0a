"""Resident memory of ``to_npy`` of a lazily masked array, measured in a fresh process.

A masked block has a row count known only once it is computed, so it is held until the
``append`` before it has run; held blocks past half the budget are spilled and appended
from their spill-file mappings. Those pages must leave the process once appended: left
mapped until the run ends, they are file-backed RSS the budget does not count (a 128 MB
output under a 32 MB budget reached ~100 MB of it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MB = 1 << 20
BUDGET = 32 * MB
FILE_BYTES = 128 * MB
# Room above the budget for what it does not plan: the sampler thread, NumPy
# temporaries of the block operators, allocator slack.
ANON_MARGIN = 24 * MB
# Pages of the source blocks in flight (dropped when each block task ends) and of the
# spilled blocks being appended; half the budget covers both (~9 MB measured).
FILE_MARGIN = BUDGET // 2

CHILD = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import numpy as np
    import tierflow as tw
    from tierflow import config
    from tierflow.engine.runtime import held

    FIELDS = ("RssAnon", "RssFile")

    def status():
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in FIELDS:
                    out[key] = int(value.split()[0]) * 1024
        return out

    src, dst, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config.set(ram_budget=budget)
    # Spill every held block, so every masked block is appended from a spill file.
    held.HELD_SHARE = 1 << 40
    x = tw.from_npy(src)
    y = x[x[:, 0] > -5]
    spilled = []

    class Spilled:
        def finish(self, event):
            spilled.append(event.spilled_bytes)

    start = status()
    peak = dict(start)
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for key, value in status().items():
                peak[key] = max(peak[key], value)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    y.to_npy(dst, progress=False, callbacks=Spilled())
    stop.set()
    sampler.join()
    print(json.dumps({"start": start, "peak": peak, "spilled": sum(spilled)}))
    """
)


def _write_source(path: Path, nbytes: int) -> int:
    import numpy as np

    rows = nbytes // 32
    out = np.lib.format.open_memmap(path, "w+", np.float32, (rows, 8))
    rng = np.random.default_rng(3)
    step = 1 << 17
    for start in range(0, rows, step):
        out[start : start + step] = rng.standard_normal(
            (min(step, rows - start), 8), dtype=np.float32
        )
    out.flush()
    del out
    fd = os.open(path, os.O_RDONLY)
    try:
        # Start from disk, not from the page cache the write left behind.
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return rows


@pytest.mark.executors("threads")  # a child process, on its own executor
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc/self/status")
def test_masked_to_npy_keeps_rss_within_budget(tmp_path: Path) -> None:
    import numpy as np

    src, dst = tmp_path / "src.npy", tmp_path / "dst.npy"
    rows = _write_source(src, FILE_BYTES)
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    done = subprocess.run(
        [sys.executable, str(child), str(src), str(dst), str(BUDGET)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    start, peak = report["start"], report["peak"]

    # The scenario spilled (else it tests nothing about spilled blocks' pages).
    assert report["spilled"] > FILE_BYTES // 2, report
    anon = peak["RssAnon"] - start["RssAnon"]
    assert anon <= BUDGET + ANON_MARGIN, (
        f"anonymous RSS grew by {anon / MB:.1f} MB under a {BUDGET / MB:.0f} MB budget"
    )
    mapped = peak["RssFile"] - start["RssFile"]
    assert mapped <= FILE_MARGIN, (
        f"file-backed RSS grew by {mapped / MB:.1f} MB (spill files and sources left "
        f"mapped); at most {FILE_MARGIN / MB:.0f} MB expected"
    )

    out = np.load(dst, mmap_mode="r")
    head = np.load(src, mmap_mode="r")[:10_000]
    expected = head[head[:, 0] > -5]
    assert out.shape[1] == 8 and len(out) == rows  # nothing is below -5 in N(0, 1) data
    np.testing.assert_array_equal(out[: len(expected)], expected)
