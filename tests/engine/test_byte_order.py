"""Byte orders and memory layouts: every source, in either byte order, and arrays in
memory that are read-only, strided or Fortran-ordered, give NumPy's answer with NumPy's
dtype for the operations that look at values' bits (sorts, unique values, quantiles)
and for the rest (reductions, elementwise, products, selection, sinks)."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

import tierflow as tw

ROWS = 23  # rows of the test arrays: blocks of 7 rows leave a short last block
_count = itertools.count()


def _values(dtype: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Values whose bytes differ from their byte-swapped selves: integers past 255 and
    negative ones, floats with NaN, infinities and both zeros; with repeats."""
    if dtype.kind == "f":
        pool = [-2.5, -0.0, 0.0, 1.5, 3.0, 256.25, 7e4, np.nan, np.inf, -np.inf, 3.0, 1.5]
    elif dtype.kind == "u":
        pool = [0, 1, 2, 3, 256, 257, 4097, 65535, 300, 3]
    else:
        pool = [-70000, -300, -1, 0, 1, 2, 3, 256, 257, 65536, 70000, 3]
    rng = np.random.default_rng(seed)
    return rng.choice(np.array(pool), size=shape).astype(dtype)


# -- sources -----------------------------------------------------------------------------


def _path(tmp: Path, suffix: str) -> Path:
    return tmp / f"s{next(_count)}{suffix}"


def _from_array(tmp: Path, a: np.ndarray, rows: int) -> tw.Array:
    return tw.from_array(a, rows=rows)


def _from_npy(tmp: Path, a: np.ndarray, rows: int) -> tw.Array:
    path = _path(tmp, ".npy")
    np.save(path, a)
    return tw.from_npy(path, rows=rows)


def _from_raw(tmp: Path, a: np.ndarray, rows: int) -> tw.Array:
    path = _path(tmp, ".bin")
    a.tofile(path)
    return tw.from_raw(path, a.dtype, shape=(-1, *a.shape[1:]), rows=rows)


def _from_hdf5(tmp: Path, a: np.ndarray, rows: int) -> tw.Array:
    path = _path(tmp, ".h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=a, chunks=(rows, *a.shape[1:]))
    return tw.from_hdf5(path, "x", rows=rows)


def _from_zarr2(tmp: Path, a: np.ndarray, rows: int) -> tw.Array:
    path = _path(tmp, ".zarr")
    z = zarr.create_array(
        store=str(path), shape=a.shape, chunks=(rows, *a.shape[1:]), dtype=a.dtype, zarr_format=2
    )
    z[:] = a
    return tw.from_zarr(path, rows=rows)


def _from_parquet(tmp: Path, a: np.ndarray, rows: int) -> tw.Array:
    """Parquet stores native numbers; ``dtype=`` asks for them in ``a``'s byte order."""
    path = _path(tmp, ".parquet")
    table = a.reshape(len(a), -1)
    native = table.astype(table.dtype.newbyteorder("="))
    pq.write_table(
        pa.table({f"c{j}": native[:, j] for j in range(table.shape[1])}), path, row_group_size=rows
    )
    x = tw.from_parquet(path, dtype=a.dtype, rows=rows)
    return x[:, 0] if a.ndim == 1 else x


SOURCES: dict[str, Callable[[Path, np.ndarray, int], tw.Array]] = {
    "from_array": _from_array,
    "from_npy": _from_npy,
    "from_raw": _from_raw,
    "from_hdf5": _from_hdf5,
    "from_zarr2": _from_zarr2,
    "from_parquet": _from_parquet,
}


# -- the functions and how results are compared -------------------------------------------

Case = tuple[str, str, Callable[[Any], Any], Callable[[np.ndarray], Any] | None]


def _top3(x: np.ndarray) -> np.ndarray:
    """``tw.topk(x, 3)`` as NumPy gives it: largest first, NaN after every number."""
    if x.dtype.kind == "f":
        return (-np.sort(-x, axis=0)[:3]).astype(x.dtype)
    return np.sort(x, axis=0)[::-1][:3]


def _value_counts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values, counts = np.unique(x, return_counts=True)
    order = np.argsort(-counts, kind="stable")
    return values[order], counts[order]


def _sort_rows(x: np.ndarray) -> np.ndarray:
    return x[np.argsort(x[:, -1], kind="stable")]


def _cases(kind: str) -> list[Case]:
    """``(name, dims, function, NumPy's function or None for the same)``: ``dims`` says
    whether it takes the 1-D or the 2-D array."""
    cases: list[Case] = [
        # sorting
        ("sort", "1d", np.sort, None),
        ("sort axis=0", "2d", lambda x: np.sort(x, axis=0), None),
        ("sort axis=1", "2d", lambda x: np.sort(x, axis=1), None),
        ("argsort", "1d", lambda x: np.argsort(x, kind="stable"), None),
        ("argsort axis=0", "2d", lambda x: np.argsort(x, axis=0, kind="stable"), None),
        ("argsort axis=1", "2d", lambda x: np.argsort(x, axis=1, kind="stable"), None),
        ("sort_rows", "2d", lambda x: tw.sort_rows(x, by=-1), _sort_rows),
        ("topk", "2d", lambda x: tw.topk(x, 3), _top3),
        ("sort after a mask", "1d", lambda x: np.sort(x[x > 0]), None),
        ("sum of the sort", "2d", lambda x: np.sort(x, axis=0)[::2].sum(axis=0), None),
        (
            "max of sort_rows",
            "2d",
            lambda x: tw.sort_rows(x, by=-1)[:5].max(axis=0),
            lambda x: _sort_rows(x)[:5].max(axis=0),
        ),
        ("head", "2d", lambda x: x.head(4) if isinstance(x, tw.Array) else x[:4], None),
        # frequencies
        ("unique", "1d", np.unique, None),
        ("unique of 2-D", "2d", np.unique, None),
        (
            "unique with index, inverse, counts",
            "1d",
            lambda x: np.unique(x, return_index=True, return_inverse=True, return_counts=True),
            None,
        ),
        ("unique rows", "2d", lambda x: np.unique(x, axis=0), None),
        ("unique rows counts", "2d", lambda x: np.unique(x, axis=0, return_counts=True), None),
        ("value_counts", "1d", tw.value_counts, _value_counts),
        ("unique after a mask", "1d", lambda x: np.unique(x[x > 0]), None),
        ("histogram", "1d", lambda x: np.histogram(x, bins=4, range=(-10, 300)), None),
        # quantiles
        ("median", "1d", np.median, None),
        ("median axis=0", "2d", lambda x: np.median(x, axis=0), None),
        ("percentile", "1d", lambda x: np.percentile(x, [10, 50, 90]), None),
        ("quantile axis=0", "2d", lambda x: np.quantile(x, 0.3, axis=0), None),
        ("nanmedian", "1d", np.nanmedian, None),
        ("nanpercentile axis=0", "2d", lambda x: np.nanpercentile(x, 40, axis=0), None),
        ("nanquantile", "1d", lambda x: np.nanquantile(x, [0.25, 0.75]), None),
        ("median after a mask", "1d", lambda x: np.median(x[x > 0]), None),
        *[
            (f"percentile {m}", "1d", lambda x, m=m: np.percentile(x, [5, 50], method=m), None)
            for m in ("lower", "higher", "nearest", "midpoint", "inverted_cdf")
        ],
        # reductions
        *[(f"{f.__name__}", "1d", f, None) for f in _REDUCTIONS],
        *[(f"{f.__name__} axis=0", "2d", lambda x, f=f: f(x, axis=0), None) for f in _REDUCTIONS],
        ("sum axis=1", "2d", lambda x: np.sum(x, axis=1), None),
        ("max axis=1", "2d", lambda x: np.max(x, axis=1), None),
        ("nansum", "1d", np.nansum, None),
        ("nanmax axis=0", "2d", lambda x: np.nanmax(x, axis=0), None),
        ("nanargmin", "1d", np.nanargmin, None),
        ("any", "1d", np.any, None),
        ("count_nonzero axis=0", "2d", lambda x: np.count_nonzero(x, axis=0), None),
        # along a trailing axis
        ("cumsum axis=1", "2d", lambda x: np.cumsum(x, axis=1), None),
        ("cumprod axis=1", "2d", lambda x: np.cumprod(x, axis=1), None),
        ("diff axis=1", "2d", lambda x: np.diff(x, axis=1), None),
        # elementwise and comparisons
        ("x + 1", "2d", lambda x: x + 1, None),
        ("x * x", "2d", lambda x: x * x, None),
        ("-x", "2d", lambda x: -x, None),
        ("abs", "2d", np.abs, None),
        ("sqrt", "2d", np.sqrt, None),
        ("maximum", "2d", lambda x: np.maximum(x, 2), None),
        ("x // 3", "2d", lambda x: x // 3, None),
        ("x < 3", "2d", lambda x: x < 3, None),
        ("x == x", "2d", lambda x: x == x, None),
        ("x != 256", "2d", lambda x: x != 256, None),
        ("astype float32", "2d", lambda x: x.astype(np.float32), None),
        ("astype the other order", "2d", lambda x: x.astype(x.dtype.newbyteorder()), None),
        ("round", "2d", np.round, None),
        ("clip", "2d", lambda x: np.clip(x, 0, 300), None),
        ("where", "2d", lambda x: np.where(x > 2, x, 0), None),
        # selection and masks
        ("the array", "2d", lambda x: x, None),
        ("mask", "1d", lambda x: x[x > 2], None),
        ("row mask", "2d", lambda x: x[x[:, 0] > 2], None),
        ("row slice", "2d", lambda x: x[1::2], None),
        ("reversed", "2d", lambda x: x[::-1], None),
        ("column", "2d", lambda x: x[:, -1], None),
        ("rows by position", "2d", lambda x: x[np.array([3, 0, 2, 2])], None),
        ("concatenate", "2d", lambda x: np.concatenate([x, x]), None),
        # products
        ("x @ w", "2d", lambda x: x @ np.arange(2.0, 2.0 + x.shape[1]), None),
        ("v @ x", "2d", lambda x: np.ones(x.shape[0]) @ x, None),
        ("x.T @ x", "2d", lambda x: x.T @ x, None),
        ("cov", "2d", lambda x: np.cov(x, rowvar=False), None),
        ("einsum", "2d", lambda x: np.einsum("ij->j", x), None),
        ("norm axis=0", "2d", lambda x: np.linalg.norm(x, axis=0), None),
    ]
    if kind in "iu":
        cases += [
            ("bincount", "1d", lambda x: np.bincount(x[x >= 0]), None),
            ("x & 0xFF", "2d", lambda x: x & 0xFF, None),
            ("x >> 2", "2d", lambda x: x >> 2, None),
            ("~x", "2d", lambda x: ~x, None),
        ]
    return cases


_REDUCTIONS = [np.sum, np.mean, np.std, np.min, np.max, np.argmax, np.argmin, np.prod]


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", value)`` or ``("error", the exception's type)``, warnings silenced."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            return "ok", fn()
        except Exception as exc:
            return "error", type(exc)


def _computed(result: Any) -> Any:
    if isinstance(result, tuple):
        return tuple(_computed(r) for r in result)
    return result.compute() if isinstance(result, tw.Array) else result


def _mismatch(got: Any, want: Any) -> str | None:
    """What differs between a result and NumPy's (None when nothing does): the dtype
    exactly, the shape, and the values (floats within a tolerance by dtype)."""
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return f"{type(got).__name__} of {len(got) if isinstance(got, tuple) else 1}"
        found = [_mismatch(g, w) for g, w in zip(got, want, strict=True)]
        return next((f"[{i}] {m}" for i, m in enumerate(found) if m), None)
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype:
        return f"dtype {got.dtype.str}, NumPy's {want.dtype.str}"
    if got.shape != want.shape:
        return f"shape {got.shape}, NumPy's {want.shape}"
    if want.dtype.kind in "fc":
        tolerance = 1e-3 if want.dtype.itemsize <= 2 else 1e-5 if want.dtype.itemsize == 4 else 1e-9
        ok = np.allclose(got, want, rtol=tolerance, atol=0, equal_nan=True)
    else:
        ok = np.array_equal(got, want)
    return None if ok else f"values {got.tolist()}, NumPy's {want.tolist()}"


def _differences(
    make: Callable[[np.ndarray], tw.Array], one: np.ndarray, two: np.ndarray
) -> list[str]:
    """Each function of :func:`_cases` on lazy arrays made by ``make`` against NumPy on
    ``one`` (1-D) and ``two`` (2-D), as lines naming what differs."""
    found = []
    lazy = {"1d": make(one), "2d": make(two)}
    arrays = {"1d": one, "2d": two}
    for name, dims, fn, numpy_fn in _cases(one.dtype.kind):
        want = _outcome(lambda: (numpy_fn or fn)(arrays[dims]))  # noqa: B023
        got = _outcome(lambda: _computed(fn(lazy[dims])))  # noqa: B023
        if want[0] != got[0]:
            found.append(f"{name}: {got[0]} {got[1]!r}, NumPy: {want[0]} {want[1]!r}")
        elif want[0] == "error":
            if want[1] is not got[1]:
                found.append(f"{name}: raised {got[1].__name__}, NumPy {want[1].__name__}")
        else:
            problem = _mismatch(got[1], want[1])
            if problem:
                found.append(f"{name}: {problem}")
    return found


def _to_npy_differences(tmp: Path, x: tw.Array, a: np.ndarray) -> list[str]:
    """``to_npy`` of the array, of its sort and of an elementwise result, read back."""
    found = []
    for name, lazy, want in (
        ("to_npy", x, a),
        ("to_npy of the sort", np.sort(x, axis=0), np.sort(a, axis=0)),
        ("to_npy of x * 2", x * 2, a * 2),
    ):
        path = _path(tmp, ".npy")
        lazy.to_npy(path)
        problem = _mismatch(np.load(path), want)
        if problem:
            found.append(f"{name}: {problem}")
    return found


PAIRS = [
    *itertools.product(SOURCES, ["i4", "f8", "f4"]),
    ("from_array", "u2"),
    ("from_array", "i8"),
]


@pytest.mark.executors("threads")
@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize(("source", "dtype"), PAIRS)
def test_every_source_in_either_byte_order_gives_numpys_answers(
    tmp_path: Path, source: str, dtype: str, order: str
) -> None:
    dt = np.dtype(order + dtype)
    one, two = _values(dt, (ROWS,), seed=1), _values(dt, (ROWS, 3), seed=2)
    make = SOURCES[source]
    found = _differences(lambda a: make(tmp_path, a, 7), one, two)
    found += _to_npy_differences(tmp_path, make(tmp_path, two, 7), two)
    assert not found, f"{source} {dt.str}:\n" + "\n".join(found)


# -- layouts in memory and narrow files ---------------------------------------------------


def _read_only(a: np.ndarray) -> np.ndarray:
    b = a.copy()
    b.setflags(write=False)
    return b


LAYOUTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "read-only": _read_only,
    "every other column": lambda a: np.repeat(a, 2, axis=-1)[..., ::2],
    "every other row": lambda a: np.repeat(a, 2, axis=0)[::2],
    "Fortran order": np.asfortranarray,
    "negative strides": lambda a: a[::-1].copy()[::-1],
    "read-only, other byte order": lambda a: _read_only(a.astype(a.dtype.newbyteorder())),
}


@pytest.mark.executors("threads")
@pytest.mark.parametrize(
    ("layout", "rows"), [*((layout, 7) for layout in LAYOUTS), ("read-only", 1)]
)
@pytest.mark.parametrize("dtype", ["i4", "f8"])
def test_arrays_in_memory_of_any_layout_give_numpys_answers(
    layout: str, dtype: str, rows: int
) -> None:
    """Blocks are views of the array; with blocks of one row, a row of a read-only
    array is already laid out as the sort's column copy would be."""
    dt = np.dtype(dtype)
    n = ROWS if rows > 1 else 9  # one task a row: fewer rows
    one, two = _values(dt, (n,), seed=3), _values(dt, (n, 3), seed=4)
    shaped = LAYOUTS[layout]
    one, two = shaped(one), shaped(two)
    found = _differences(lambda a: tw.from_array(a, rows=rows), one, two)
    assert not found, f"{layout} {dt.str}, blocks of {rows}:\n" + "\n".join(found)


@pytest.mark.executors("threads")
@pytest.mark.parametrize("rows", [1, 4, None])
@pytest.mark.parametrize("order", ["<", ">"])
def test_npy_files_of_one_column_give_numpys_answers(
    tmp_path: Path, order: str, rows: int | None
) -> None:
    """A 1-D file and an ``(n, 1)`` file, whose blocks are read-only views of the file
    that are contiguous in every layout; blocks of one row, of 4, and one block."""
    dt = np.dtype(order + "f8")
    n = 9
    one, two = _values(dt, (n,), seed=5), _values(dt, (n, 1), seed=6)
    found = _differences(lambda a: _from_npy(tmp_path, a, rows or n), one, two)
    assert not found, f"{dt.str}, blocks of {rows}:\n" + "\n".join(found)


# -- the examples of the issue -----------------------------------------------------------


def test_unique_of_a_big_endian_array_gives_its_values_not_swapped_bytes() -> None:
    b = np.array([3, 1, 2, 256, 70000], ">i4")
    got = np.unique(tw.from_array(b, rows=3)).compute()
    assert got.dtype == np.unique(b).dtype
    np.testing.assert_array_equal(got, [1, 2, 3, 256, 70000])


def test_value_counts_of_a_big_endian_array_counts_its_values() -> None:
    b = np.array([3, 1, 3, 256, 70000, 256, 3], ">i4")
    values, counts = tw.compute(*tw.value_counts(tw.from_array(b, rows=3)))
    np.testing.assert_array_equal(values, [3, 256, 1, 70000])
    np.testing.assert_array_equal(counts, [3, 2, 1, 1])
    assert values.dtype == b.dtype


def test_median_of_a_big_endian_array_is_numpys(executor_name: str) -> None:
    b = np.array([3, 1, 2, 256, 70000], ">i4")
    x = tw.from_array(b, rows=3)
    assert np.median(x).compute(executor=executor_name) == np.median(b) == 3.0
    assert np.percentile(x, 90).compute(executor=executor_name) == np.percentile(b, 90)


def test_sort_of_a_big_endian_hdf5_dataset_is_sorted(executor_name: str, tmp_path: Path) -> None:
    data = np.random.default_rng(7).standard_normal(1000).astype(">f4")
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.create_dataset("x", data=data, chunks=(100,))
    got = np.sort(tw.from_hdf5(tmp_path / "a.h5", "x", rows=300)).compute(executor=executor_name)
    assert got.dtype == np.dtype(">f4")
    np.testing.assert_array_equal(got, np.sort(data))


def test_argsort_of_big_endian_floats_is_numpys(executor_name: str) -> None:
    data = np.random.default_rng(8).standard_normal((100, 2)).astype(">f4")
    x = tw.from_array(data, rows=30)
    got = np.argsort(x, axis=0, kind="stable").compute(executor=executor_name)
    np.testing.assert_array_equal(got, np.argsort(data, axis=0, kind="stable"))


@pytest.mark.parametrize("shape", [(9,), (9, 1)])
def test_sorting_a_one_column_npy_file_leaves_the_file_alone(
    executor_name: str, tmp_path: Path, shape: tuple[int, ...]
) -> None:
    """The blocks of a 1-D or ``(n, 1)`` file are read-only views of its memory map: the
    sort works on its own copy (it raised 'assignment destination is read-only')."""
    data = np.arange(9.0)[::-1].reshape(shape).copy()
    np.save(tmp_path / "a.npy", data)
    x = tw.from_npy(tmp_path / "a.npy")
    got = np.sort(x, axis=0).compute(executor=executor_name)
    np.testing.assert_array_equal(got, np.sort(data, axis=0))
    got = np.partition(x, 3, axis=0).compute(executor=executor_name)
    np.testing.assert_array_equal(got[3], np.partition(data, 3, axis=0)[3])
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), data)


def test_sorting_one_row_blocks_of_an_npy_file(executor_name: str, tmp_path: Path) -> None:
    data = np.array([[3.0, 1.0], [1.0, 5.0], [2.0, 0.0]])
    np.save(tmp_path / "a.npy", data)
    x = tw.from_npy(tmp_path / "a.npy", rows=1)
    got = np.sort(x, axis=0).compute(executor=executor_name)
    np.testing.assert_array_equal(got, np.sort(data, axis=0))
    np.testing.assert_array_equal(np.sort(x).compute(executor=executor_name), np.sort(data))


# -- torch tensors, which have only the native byte order ---------------------------------


@pytest.mark.executors("threads")
def test_functions_on_tensors_get_blocks_of_either_byte_order() -> None:
    """Blocks go to torch in native order and come back in the array's: on the CPU, on
    a simulated GPU (torch CPU tensors accounted as ``cuda:0``), and chained with host
    operations."""
    pytest.importorskip("torch")
    from tierflow import config
    from tierflow.system.devices import FakeGpus, use_provider

    values = np.random.default_rng(9).permutation(180) * 7.25 - 300
    a = values.reshape(60, 3).astype(">f4")
    x = tw.from_array(a, rows=20)
    for device in ("cpu", "auto"):
        np.testing.assert_array_equal(x.map_blocks(lambda t: t * 2, device=device).compute(), a * 2)
    with config.set(gpu_margin=0), use_provider(FakeGpus([(1 << 30, 3 << 30)])):
        y = x.map_blocks(lambda t: t * 2, device="cuda", dtype=">f4", row_shape=(3,))
        got, total, ordered = tw.compute(y, (y + 1).sum(axis=0), np.sort(y, axis=0), progress=False)
    assert got.dtype == ordered.dtype == np.dtype(">f4")
    np.testing.assert_array_equal(got, a * 2)
    np.testing.assert_allclose(total, (a * 2 + 1).sum(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(ordered, np.sort(a * 2, axis=0))


@pytest.mark.executors("processes", "dask", "ray")
def test_results_from_other_processes_keep_the_arrays_byte_order(
    executor_name: str, tmp_path: Path
) -> None:
    """Blocks and partials come back from workers by pickle, which NumPy would rebuild
    native below protocol 5 (multiprocessing's default)."""
    data = _values(np.dtype(">i4"), (ROWS, 3), seed=10)
    np.save(tmp_path / "b.npy", data)
    for x in (tw.from_array(data, rows=7), tw.from_npy(tmp_path / "b.npy", rows=7)):
        results = tw.compute(
            tw.topk(x, 3),
            x[np.array([5, 0, 2, 2])],
            x[x[:, 0] > 0],
            tw.sort_rows(x, by=-1),
            np.unique(x),
            executor=executor_name,
        )
        want = (
            np.sort(data, axis=0)[::-1][:3],
            data[[5, 0, 2, 2]],
            data[data[:, 0] > 0],
            _sort_rows(data),
            np.unique(data),
        )
        for got, expected in zip(results, want, strict=True):
            assert _mismatch(got, expected) is None, _mismatch(got, expected)
