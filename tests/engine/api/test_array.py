"""Arrays: constructors, metadata, repr, keys, and the errors that name shapes and files."""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow.errors import BlockError, SourceError


def save(path: Path, a: np.ndarray) -> str:
    np.save(path, a)
    return str(path)


@pytest.fixture
def data() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(1000, 4)).astype(np.float32)


def test_from_npy_reads_only_the_header_and_has_numpy_metadata(
    tmp_path: Path, data: np.ndarray
) -> None:
    x = tw.from_npy(save(tmp_path / "a.npy", data), rows=300)
    assert (x.shape, x.dtype, x.ndim, x.size, x.nbytes) == ((1000, 4), np.float32, 2, 4000, 16000)
    assert x.blocks == ((0, 300), (300, 600), (600, 900), (900, 1000))
    assert x.nblocks == 4 and len(x) == 1000
    np.testing.assert_array_equal(x.compute(), data)


def test_from_raw_takes_the_row_count_from_the_file(tmp_path: Path, data: np.ndarray) -> None:
    path = tmp_path / "a.bin"
    (b"HEAD" + data.tobytes()).__len__()
    path.write_bytes(b"HEAD" + data.tobytes())
    x = tw.from_raw(path, "float32", (-1, 4), offset=4, rows=128)
    assert x.shape == (1000, 4)
    np.testing.assert_array_equal(x.compute(), data)


def test_from_array_wraps_without_copying_and_scalars_become_values() -> None:
    a = np.arange(12.0).reshape(6, 2)
    x = tw.from_array(a, rows=4)
    assert x.blocks == ((0, 4), (4, 6))
    assert tw.from_array(x) is x
    s = tw.from_array(np.float32(2.5))
    assert s.shape == () and s.compute() == np.float32(2.5)
    with pytest.raises(TypeError, match="Python objects"):
        tw.from_array(np.array([object()]))


def test_default_blocks_follow_the_budget_and_spread_over_workers(data: np.ndarray) -> None:
    tw.memory.budget("64MB")
    x = tw.from_array(np.zeros((1 << 20, 8), np.float32))  # 32 MB
    sizes = {b - a for a, b in x.blocks}
    assert x.nblocks >= 4  # every worker gets blocks
    assert max(sizes) * 32 <= 32 << 20  # at most 32 MB a block


def test_from_files_one_row_per_file_in_the_workers(tmp_path: Path, data: np.ndarray) -> None:
    paths = [save(tmp_path / f"{i}.npy", data[i]) for i in range(12)]
    x = tw.from_files(paths, np.load, rows=5)
    assert x.shape == (12, 4) and x.blocks == ((0, 5), (5, 10), (10, 12))
    np.testing.assert_array_equal(x.compute(), data[:12])
    np.testing.assert_allclose(x.mean(axis=0).compute(), data[:12].mean(axis=0), rtol=1e-6)


@pytest.mark.executors("threads")
def test_slow_loads_of_small_files_run_on_every_worker(tmp_path: Path, data: np.ndarray) -> None:
    import threading

    paths = [save(tmp_path / f"{i}.npy", data[i]) for i in range(24)]
    lock = threading.Lock()
    now, most = [0], [0]

    def load(path: str) -> np.ndarray:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.005)  # a slow disk or a decoder that releases the GIL
        with lock:
            now[0] -= 1
        return np.load(path)

    # One row per block: each task projects a few bytes, so it is timed on the lane first
    # and sent to the workers once it proves slow.
    x = tw.from_files(paths, load, rows=1)
    np.testing.assert_array_equal(x.compute(workers=2), data[:24])
    assert most[0] == 2


def test_from_files_with_a_fixed_or_varying_number_of_rows(
    tmp_path: Path, data: np.ndarray
) -> None:
    fixed = [save(tmp_path / f"f{i}.npy", data[3 * i : 3 * i + 3]) for i in range(5)]
    x = tw.from_files(fixed, np.load, rows_per_file=3, rows=4)
    assert x.shape == (15, 4)
    np.testing.assert_array_equal(x[2:11].compute(), data[2:11])
    pieces = [data[10 * i : 10 * i + i] for i in range(6)]
    varying = [save(tmp_path / f"v{i}.npy", p) for i, p in enumerate(pieces)]
    y = tw.from_files(varying, np.load, rows_per_file=None, rows=2)
    assert y.shape == (None, 4) and y.nblocks == 3
    np.testing.assert_array_equal(y.compute(), np.concatenate(pieces))
    np.testing.assert_allclose(
        y.sum(axis=0).compute(), np.concatenate(pieces).sum(axis=0), rtol=1e-5
    )


def test_from_files_errors_name_the_file(tmp_path: Path, data: np.ndarray) -> None:
    paths = [save(tmp_path / f"{i}.npy", data[i]) for i in range(3)]
    np.save(tmp_path / "2.npy", data[:2])  # two rows where one is expected
    x = tw.from_files(paths, np.load, dtype="float32", row_shape=(4,))
    with pytest.raises(BlockError, match=r"shape \(2, 4\) for file 2 of 3 \(.*2\.npy\)"):
        x.compute()

    def broken(path: str) -> np.ndarray:
        raise OSError(f"cannot decode {path}")

    y = tw.from_files(paths, broken, dtype="float32", row_shape=(4,))
    # Every file fails: which one is reported first depends on the executor's order.
    with pytest.raises(BlockError, match=r"broken failed on file \d of 3 .*OSError: cannot decode"):
        y.compute()


def test_from_files_refuses_a_loaded_value_out_of_the_dtypes_range(tmp_path: Path) -> None:
    """A ``dtype=`` narrower than what ``load`` returns is a cast: a value it cannot hold
    is refused, naming the file, not wrapped (300 would be 44 as int8)."""
    paths = [tmp_path / f"{i}.txt" for i in range(3)]
    for p, v in zip(paths, [1, 2, 300], strict=True):
        p.write_text(str(v))
    x = tw.from_files(paths, lambda p: np.int64(Path(p).read_text()), dtype=np.int8, row_shape=())
    with pytest.raises(BlockError, match=r"load returned 300 for file 2 of 3 .*int8's range"):
        x.compute()
    y = tw.from_files(paths[:2], lambda p: np.int64(Path(p).read_text()), dtype=np.int8)
    np.testing.assert_array_equal(y.compute(), np.array([1, 2], np.int8))


def test_shape_mismatch_names_both_shapes(data: np.ndarray) -> None:
    x = tw.from_array(data)
    # NumPy's own message: "operands could not be broadcast together with shapes ..."
    with pytest.raises(ValueError, match=r"broadcast together with shapes \(1000,4\) \(999,4\)"):
        x + tw.from_array(data[:999])
    with pytest.raises(ValueError, match=r"shapes \(1000,4\) \(3,\)"):
        x * np.ones(3)
    # Unknown rows are compared once counted: at the compute, with NumPy's error.
    kept = int((data[:, 0] > 0).sum())
    with pytest.raises(ValueError, match=rf"shapes \({kept},4\) \(1000,4\)"):
        (x[x[:, 0] > 0] + x).compute()


def test_numpy_type_errors_are_raised_when_the_pipeline_is_built() -> None:
    x = tw.from_array(np.arange(10, dtype=np.uint8))
    with pytest.raises(OverflowError):
        x + 300
    with pytest.raises(TypeError):
        np.sqrt(tw.from_array(np.array(["a", "b"])))


def test_a_source_file_changed_after_build_is_refused_by_name(
    tmp_path: Path, data: np.ndarray
) -> None:
    path = save(tmp_path / "a.npy", data)
    x = tw.from_npy(path)
    np.save(path, data[:10])
    with pytest.raises(
        SourceError, match=r"a\.npy changed after the array was built.*size 16128 -> 288 bytes"
    ):
        x.sum().compute()
    os.remove(path)
    with pytest.raises(SourceError, match="was deleted or moved"):
        x.compute()


def test_keys_are_stable_and_follow_content(tmp_path: Path, data: np.ndarray) -> None:
    path = save(tmp_path / "a.npy", data)
    k1 = (np.sqrt(tw.from_npy(path) * 2 + 1).sum(axis=0)).key
    k2 = (np.sqrt(tw.from_npy(path) * 2 + 1).sum(axis=0)).key
    assert k1 == k2 and len(k1) == 32 and int(k1, 16) >= 0
    assert (np.sqrt(tw.from_npy(path) * 3 + 1).sum(axis=0)).key != k1
    assert (tw.from_npy(path) - 1).key != (1 - tw.from_npy(path)).key
    assert tw.from_array(data).key == tw.from_array(data.copy(), rows=7).key  # blocks: not content
    assert tw.from_array(data).key != tw.from_array(data + 1).key

    def f(b: np.ndarray) -> np.ndarray:
        return b * 2

    def g(b: np.ndarray) -> np.ndarray:
        return b * 3

    x = tw.from_array(data)
    assert x.map_blocks(f).key != x.map_blocks(g).key
    before = os.stat(path)
    np.save(path, data)  # same bytes, a later modification time (set, not waited for)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    assert (np.sqrt(tw.from_npy(path) * 2 + 1).sum(axis=0)).key != k1


def test_repr_shows_shape_dtype_size_blocks_sources_and_pending(
    tmp_path: Path, data: np.ndarray
) -> None:
    x = tw.from_npy(save(tmp_path / "feat.npy", data), rows=256)
    y = np.sqrt(x * 2 + 1)[x[:, 0] > 0]
    text = repr(y)
    assert "shape    (?, 4)" in text and "dtype    float32" in text
    assert "size     unknown until computed" in text and "sources  from_npy('feat.npy')" in text
    assert "pending  " in text and "sqrt" in text and "mask" in text
    assert "blocks   4 of 256 rows (last 232)" in repr(x)
    html = x._repr_html_()
    assert "<table>" in html and "15.62 KB" in html


def test_visualize_draws_text_without_graphviz(tmp_path: Path, data: np.ndarray) -> None:
    x = tw.from_array(data)
    drawing = (x * 2).sum(axis=0).visualize(tmp_path / "g.txt")
    text = str(drawing)
    assert "from_array" in text and "multiply" in text and "sum(axis=0)" in text
    assert "<- n0" in text and (tmp_path / "g.txt").read_text().strip() == text.strip()


def test_scalar_conversion_computes_one_element(data: np.ndarray) -> None:
    x = tw.from_array(data)
    assert float(x.sum()) == pytest.approx(float(data.sum(dtype=np.float64)), rel=1e-6)
    assert bool((x > -100).all())
    with pytest.raises(ValueError, match="ambiguous"):
        bool(x)
    with pytest.raises(TypeError, match="cannot be iterated"):
        list(x)
    np.testing.assert_array_equal(np.asarray(x[:3]), data[:3])


@pytest.mark.parametrize("convert", [bool, int, float, complex])
def test_python_numbers_of_one_element_follow_numpy(convert: Any) -> None:
    # NumPy 2 converts only 0-d arrays to numbers, and any one element to a truth value.
    a = np.array([[4]], np.int32)
    x = tw.from_array(a)
    try:
        expected = convert(a)
    except TypeError:
        with pytest.raises(TypeError):
            convert(x)
    else:
        assert convert(x) == expected and type(convert(x)) is type(expected)
    assert convert(x.sum()) == convert(a.sum())


@pytest.mark.parametrize("threshold", [6.5, 100, 3])
def test_python_numbers_after_a_mask_count_the_rows_first(threshold: float) -> None:
    # One row kept, none, or several: NumPy's answer or NumPy's error, as for known rows.
    a = np.arange(8.0)
    x = tw.from_array(a, rows=3)
    for convert in (bool, int, float, complex):
        try:
            expected: Any = convert(a[a > threshold])
        except (TypeError, ValueError) as exc:
            with pytest.raises(type(exc), match=str(exc)[:30].replace("(", r"\(")):
                convert(x[x > threshold])
        else:
            assert convert(x[x > threshold]) == expected


def test_a_cast_of_complex_values_to_reals_warns_at_the_users_line_without_rows_too() -> None:
    for rows in (0, 5):
        x = tw.from_array(np.ones((rows, 2), np.complex64) * (1 + 2j), rows=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = sys._getframe().f_lineno + 1
            y = x.astype(np.float32) * 2
            np.add(x, 1, dtype=np.int16, casting="unsafe")
            got = y.compute()
        np.testing.assert_array_equal(got, np.full((rows, 2), 2, np.float32))
        # Once, when the cast is built, where NumPy's astype would warn (none from blocks).
        where = [(w.category, w.filename, w.lineno) for w in caught]
        complex_warning = np.exceptions.ComplexWarning
        assert where[0] == (complex_warning, __file__, line), where
        assert (complex_warning, __file__, line + 1) in where
        assert all(w[1] == __file__ for w in where), where
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x.astype(bool).compute()  # no part is discarded
            x.real.astype(np.float16).compute()
        assert not caught


@pytest.mark.parametrize(
    ("shape", "new_shape"), [((0, 3), (1, -1)), ((0, 3), (2, 0, 5)), ((4, 0), (2, -1))]
)
@pytest.mark.parametrize("masked", [False, True])
def test_a_reshape_without_values_is_numpys_whatever_its_rows(
    shape: tuple[int, ...], new_shape: tuple[int, ...], masked: bool
) -> None:
    a = np.zeros(shape, ">i4")
    x = tw.from_array(a, rows=2)
    if masked:  # rows known once counted
        x = x[tw.from_array(np.zeros(shape[0]), rows=2) < 1]
    got, want = x.reshape(new_shape).compute(), a.reshape(new_shape)
    assert got.shape == want.shape and got.dtype == want.dtype


@pytest.mark.parametrize("exponent", [2, -1, 0.5, 2.0, 3])
@pytest.mark.parametrize("dtype", ["complex128", "float32", "bool", "int16"])
def test_a_power_of_a_python_number_is_ndarrays(exponent: Any, dtype: str) -> None:
    # ndarray.__pow__ calls np.square, np.reciprocal or np.sqrt for these exponents,
    # whose answers for complex infinities and NaN are not np.power's.
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        a = np.array([complex(np.inf, 1), complex(np.nan, np.inf), 2 - 1j, -0.0, 1]).astype(dtype)
        x = tw.from_array(a, rows=2)
        try:
            want = a**exponent
        except ValueError:
            with pytest.raises(ValueError):
                (x**exponent).compute()
            return
        got = (x**exponent).compute()
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
