"""Cache keys invalidate exactly: each component of a source's identity, a function's
identity, operator parameters and block boundaries; an identical computation hits."""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tierflow as tw

ROWS = 50
N = 200


@pytest.fixture
def data() -> np.ndarray:
    return np.random.default_rng(3).random((N, 4)).astype(np.float32)


def run(array: Any) -> tuple[int, int]:
    """(hits, misses) of computing ``array`` with the cache."""
    before = tw.cache_info(True)["cache"]
    array.compute(cache=True)
    after = tw.cache_info(True)["cache"]
    return after.hits - before.hits, after.misses - before.misses


def pipeline(x: tw.Array) -> Any:
    return np.sqrt(x * 2 + 1)


def hit(array: Any) -> bool:
    hits, misses = run(array)
    assert hits + misses == array.nblocks
    assert hits in (0, array.nblocks), f"{hits} of {array.nblocks} blocks hit"
    return hits == array.nblocks


def test_the_same_computation_built_again_hits(src: Path) -> None:
    assert not hit(pipeline(tw.from_npy(src, rows=ROWS)))
    assert hit(pipeline(tw.from_npy(src, rows=ROWS)))


def test_another_path_misses(tmp_path: Path, src: Path) -> None:
    assert not hit(pipeline(tw.from_npy(src, rows=ROWS)))
    copy = tmp_path / "copy.npy"
    shutil.copy2(src, copy)  # same bytes, same modification time, another path
    assert not hit(pipeline(tw.from_npy(copy, rows=ROWS)))


def test_a_changed_size_misses(tmp_path: Path, data: np.ndarray) -> None:
    path = tmp_path / "raw.bin"
    path.write_bytes(data.tobytes())
    assert not hit(pipeline(tw.from_raw(path, np.float32, (-1, 4), rows=ROWS)))
    st = os.stat(path)
    with open(path, "ab") as f:
        f.write(data[:10].tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # only the size tells
    grown = tw.from_raw(path, np.float32, (-1, 4), rows=ROWS)
    assert grown.shape == (N + 10, 4)
    assert not run(grown)[0], "no block of the grown file hits"


def test_a_changed_modification_time_misses(src: Path) -> None:
    assert not hit(pipeline(tw.from_npy(src, rows=ROWS)))
    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert not hit(pipeline(tw.from_npy(src, rows=ROWS)))
    assert hit(pipeline(tw.from_npy(src, rows=ROWS)))


def test_a_replaced_file_misses_even_with_the_same_bytes_and_time(
    tmp_path: Path, src: Path
) -> None:
    assert not hit(pipeline(tw.from_npy(src, rows=ROWS)))
    st = os.stat(src)
    other = tmp_path / "other.npy"
    shutil.copyfile(src, other)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, src)  # same path, size, bytes and mtime; a new inode
    assert os.stat(src).st_ino != st.st_ino
    assert not hit(pipeline(tw.from_npy(src, rows=ROWS)))


def test_another_dtype_or_shape_of_the_same_file_misses(tmp_path: Path, data: np.ndarray) -> None:
    path = tmp_path / "raw.bin"
    path.write_bytes(data.tobytes())
    assert not hit(tw.from_raw(path, np.float32, (-1, 4), rows=ROWS) + 1)
    assert hit(tw.from_raw(path, np.float32, (-1, 4), rows=ROWS) + 1)
    assert not hit(tw.from_raw(path, np.int32, (-1, 4), rows=ROWS) + 1)
    assert not hit(tw.from_raw(path, np.float32, (-1, 2), rows=ROWS) + 1)


def test_other_block_boundaries_miss(src: Path) -> None:
    assert not hit(pipeline(tw.from_npy(src, rows=ROWS)))
    assert not hit(pipeline(tw.from_npy(src, rows=ROWS // 2)))
    assert hit(pipeline(tw.from_npy(src, rows=ROWS)))


def test_operator_parameters_miss(src: Path) -> None:
    x = tw.from_npy(src, rows=ROWS)
    assert not hit(x * 2)
    assert not hit(x * 3)
    assert not hit(x * np.float64(2))  # another type: it promotes differently
    assert not hit(np.round(x, 1))
    assert not hit(np.round(x, 2))
    assert not hit(x.clip(0.1, 0.9))
    assert not hit(x.clip(0.1, 0.8))
    assert not hit(x.astype(np.float64))
    assert hit(x * 2) and hit(np.round(x, 1))


def test_map_blocks_keyword_arguments_miss(src: Path) -> None:
    def scale(b: np.ndarray, k: float = 1.0) -> np.ndarray:
        return b * k

    x = tw.from_npy(src, rows=ROWS)
    assert not hit(x.map_blocks(scale, k=2.0))
    assert not hit(x.map_blocks(scale, k=3.0))
    assert hit(x.map_blocks(scale, k=2.0))


def define(source: str, filename: str) -> Callable[..., Any]:
    """``source`` executed as if from ``filename`` (a notebook cell, a script)."""
    namespace: dict[str, Any] = {"np": np}
    exec(compile(textwrap.dedent(source), filename, "exec"), namespace)
    return namespace["f"]


ORIGINAL = """
def f(b):
    return np.sqrt(b * 2 + 1)
"""


def test_an_identical_definition_elsewhere_hits_and_an_edited_one_misses(src: Path) -> None:
    x = tw.from_npy(src, rows=ROWS)
    first = define(ORIGINAL, "<cell 1>")
    assert not hit(x.map_blocks(first))
    again = define("\n\n\n" + ORIGINAL, "<cell 7>")  # another file, other line numbers
    assert again is not first
    assert hit(x.map_blocks(again))
    edited = define(ORIGINAL.replace("* 2", "* 3"), "<cell 8>")
    assert not hit(x.map_blocks(edited))
    renamed_local = define(
        "def f(b):\n    c = b * 2\n    return np.sqrt(c + 1)\n", "<cell 9>"
    )  # computes the same, but is other code
    assert not hit(x.map_blocks(renamed_local))


def test_closure_values_defaults_and_globals_are_part_of_a_function(src: Path) -> None:
    x = tw.from_npy(src, rows=ROWS)

    def make(k: float) -> Callable[[np.ndarray], np.ndarray]:
        def f(b: np.ndarray) -> np.ndarray:
            return b * k

        return f

    assert not hit(x.map_blocks(make(2.0)))
    assert hit(x.map_blocks(make(2.0)))
    assert not hit(x.map_blocks(make(5.0)))

    with_default = define("def f(b, k=2.0):\n    return b * k\n", "<d1>")
    assert not hit(x.map_blocks(with_default))
    assert not hit(x.map_blocks(define("def f(b, k=4.0):\n    return b * k\n", "<d2>")))

    source = (
        "SCALE = {}\ndef helper(b):\n    return b * SCALE\ndef f(b):\n    return helper(b) + 1\n"
    )
    assert not hit(x.map_blocks(define(source.format(2.0), "<g1>")))
    assert hit(x.map_blocks(define(source.format(2.0), "<g2>")))
    assert not hit(x.map_blocks(define(source.format(3.0), "<g3>"))), "a global the helper uses"
