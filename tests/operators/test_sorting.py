"""The sorting kernels against NumPy: stable orders, keys of several columns, splits of
sorted runs at a rank."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tierflow.operators import sorting

from common import examples

DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint32",
    "float16",
    "float32",
    "float64",
]
FEW = st.sampled_from([np.nan, -np.nan, 0.0, -0.0, 1.0, -1.0, np.inf, -np.inf])


@st.composite
def columns(draw: st.DrawFn, n: int | None = None) -> np.ndarray:
    dt = np.dtype(draw(st.sampled_from(DTYPES)))
    n = draw(st.integers(0, 40)) if n is None else n
    if dt.kind == "f":
        elements = FEW
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        elements = st.sampled_from([int(info.min), int(info.max), 0, 1, 2])
    else:
        elements = st.booleans()
    return draw(hnp.arrays(dt, n, elements=elements))


@settings(max_examples=examples(200), deadline=None)
@given(keys=columns())
def test_stable_order_is_numpys_stable_argsort(keys: np.ndarray) -> None:
    np.testing.assert_array_equal(sorting.stable_order(keys), np.argsort(keys, kind="stable"))
    expected = np.sort(keys, kind="stable")
    assert sorting.sort_stable(keys).tobytes() == expected.tobytes()


@settings(max_examples=examples(200), deadline=None)
@given(data=st.data(), n=st.integers(0, 30))
def test_row_key_orders_as_lexsort(data: st.DataObject, n: int) -> None:
    cols = [data.draw(columns(n)) for _ in range(data.draw(st.integers(1, 3)))]
    down = data.draw(st.booleans())
    keys = [sorting.descending_key(c) if down else c for c in cols]
    got = sorting.stable_order(sorting.row_key(cols, down))
    np.testing.assert_array_equal(got, np.lexsort(keys[::-1]))


@settings(max_examples=examples(200), deadline=None)
@given(data=st.data())
def test_split_at_takes_the_first_ranks_of_the_stable_merge(data: st.DataObject) -> None:
    dt = data.draw(st.sampled_from(["float32", "int8", "S3"]))
    runs = []
    for _ in range(data.draw(st.integers(1, 5))):
        if dt == "S3":
            values = data.draw(st.lists(st.sampled_from([b"", b"a", b"a\x00b", b"b"]), max_size=9))
            run = np.array(values, dtype="S3")
        else:
            elements = FEW if dt == "float32" else st.integers(-2, 2)
            run = data.draw(hnp.arrays(dt, data.draw(st.integers(0, 9)), elements=elements))
        runs.append(np.sort(run, kind="stable"))
    merged = np.concatenate(runs)
    which = np.concatenate([np.full(len(r), i) for i, r in enumerate(runs)])
    first = which[np.argsort(merged, kind="stable")]
    for rank in range(len(merged) + 1):
        expected = [int(np.sum(first[:rank] == i)) for i in range(len(runs))]
        assert sorting.split_at(runs, rank) == expected


def test_descending_keys_keep_nan_last() -> None:
    a = np.array([1.0, np.nan, -2.0, 3.0])
    assert a[sorting.stable_order(sorting.descending_key(a))].tolist()[:3] == [3.0, 1.0, -2.0]
    i = np.array([np.iinfo(np.int8).min, 0, 127], np.int8)
    assert i[sorting.stable_order(sorting.descending_key(i))].tolist() == [127, 0, -128]


@settings(max_examples=examples(200), deadline=None)
@given(data=st.data())
def test_split_sampled_is_split_at(data: st.DataObject) -> None:
    dt = data.draw(st.sampled_from(["float32", "int8", "float64"]))
    elements = FEW if dt != "int8" else st.integers(-3, 3)
    runs = [
        np.sort(data.draw(hnp.arrays(dt, data.draw(st.integers(0, 40)), elements=elements)))
        for _ in range(data.draw(st.integers(1, 5)))
    ]
    step = data.draw(st.integers(1, 6), label="step")
    samples = [r[::step] for r in runs]
    for rank in range(sum(len(r) for r in runs) + 1):
        assert sorting.split_sampled(runs, samples, step, rank) == sorting.split_at(runs, rank)


def test_split_sampled_reads_only_windows_near_the_rank() -> None:
    class Counted(np.ndarray):
        read = 0

        def __getitem__(self, key):  # type: ignore[no-untyped-def]
            out = super().__getitem__(key)
            if isinstance(key, slice):
                Counted.read += len(range(*key.indices(len(self))))
            return out

    runs = [np.sort(np.random.default_rng(i).random(100_000)).view(Counted) for i in range(4)]
    samples = [np.asarray(r)[::100] for r in runs]
    expected = sorting.split_at([np.asarray(r) for r in runs], 123_456)
    assert sorting.split_sampled(runs, samples, 100, 123_456) == expected
    assert 0 < Counted.read <= 4 * 4 * 100
