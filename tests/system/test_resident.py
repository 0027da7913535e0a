"""Resident memory of a process, split by kind, from /proc/<pid>/status."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tierflow.system.resident import Resident, resident

STATUS = """Name:\tpython
VmPeak:\t 1000000 kB
VmRSS:\t  300000 kB
RssAnon:\t  200000 kB
RssFile:\t   90000 kB
RssShmem:\t   10000 kB
Threads:\t3
"""


def test_reads_rss_and_its_parts_from_the_status_file(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text(STATUS)
    assert resident(42, proc=str(tmp_path)) == Resident(
        rss=300000 * 1024, anon=200000 * 1024, file=90000 * 1024, shmem=10000 * 1024
    )


def test_this_process_grows_by_what_it_touches() -> None:
    before = resident()
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MB, touched
    after = resident()
    assert after.anon - before.anon > 48 << 20
    assert after.rss >= after.anon + after.file
    del block


def test_a_process_that_is_gone_reads_as_zeros(tmp_path: Path) -> None:
    gone = 2**22 + os.getpid() % 1000  # above the kernel's pid_max default
    assert resident(gone, proc=str(tmp_path)) == Resident()
