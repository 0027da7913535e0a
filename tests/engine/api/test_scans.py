"""Scans along the rows: ``np.cumsum`` and friends with ``axis=0``, ``tw.ffill`` and
``tw.bfill``; two passes, any row range, any executor, a flat budget."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tierflow as tw
from tierflow.engine.io.memory import ArraySink
from tierflow.engine.planning.plan import Target, build_plan, describe

from .conformance_cases import _filled
from common import examples

SCANS = [np.cumsum, np.cumprod, np.nancumsum, np.nancumprod]


def _values(rng: np.random.Generator, rows: int, dtype: str, nan: float) -> np.ndarray:
    a = rng.normal(0, 1.5, (rows, 3))
    if np.dtype(dtype).kind == "f":
        a[rng.random(a.shape) < nan] = np.nan
    return a.astype(dtype)


@pytest.mark.executors("threads", "processes")
@settings(max_examples=examples(40), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(0, 400),
    block=st.integers(1, 90),
    dtype=st.sampled_from(["float64", "float32", ">f8", "int8", "int64", "uint16", "bool"]),
    scan=st.sampled_from(SCANS),
)
def test_a_scan_along_the_rows_is_numpys(
    seed: int, rows: int, block: int, dtype: str, scan: object
) -> None:
    a = _values(np.random.default_rng(seed), rows, dtype, 0.2)
    if np.dtype(dtype).kind != "f" and dtype != "bool":
        a = a % 3  # products that stay small
    lazy = scan(tw.from_array(a, rows=block), axis=0)  # type: ignore[operator]
    with np.errstate(all="ignore"):
        want = scan(a, axis=0)  # type: ignore[operator]
    got = lazy.compute()
    assert (got.shape, got.dtype) == (want.shape, want.dtype.newbyteorder("="))
    if want.dtype.kind in "iub":
        np.testing.assert_array_equal(got, want)  # wrapping included
    elif scan in (np.cumsum, np.nancumsum):  # added in another order: the sums' scale
        np.testing.assert_array_equal(got[:block], want[:block])  # the first block: NumPy's
        eps = np.finfo(want.dtype).eps
        scale = np.nancumsum(np.abs(a.astype(want.dtype)), axis=0)
        with np.errstate(invalid="ignore"):
            near = np.abs(got - want) <= 4 * eps * scale
        assert np.all(near | (got == want) | (np.isnan(got) & np.isnan(want))), (got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5 if want.dtype == np.float32 else 1e-12)


@pytest.mark.executors("threads")
def test_the_first_block_is_numpys_bit_for_bit_and_the_rest_within_rounding() -> None:
    a = np.random.default_rng(1).random((10_000, 4), dtype=np.float32)
    got = np.cumsum(tw.from_array(a, rows=2500), axis=0).compute()
    want = np.cumsum(a, axis=0)
    assert got[:2500].tobytes() == want[:2500].tobytes()
    np.testing.assert_allclose(got, want, rtol=2e-6)


@pytest.mark.executors("threads", "processes")
@settings(max_examples=examples(40), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(0, 300),
    block=st.integers(1, 60),
    nan=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    limit=st.sampled_from([None, 0, 1, 4, 100]),
    backward=st.booleans(),
)
def test_fills_take_the_nearest_value_across_blocks_within_the_limit(  # noqa: PLR0913
    seed: int, rows: int, block: int, nan: float, limit: int | None, backward: bool
) -> None:
    a = _values(np.random.default_rng(seed), rows, "float32", nan)
    fill = tw.bfill if backward else tw.ffill
    got = fill(tw.from_array(a, rows=block), limit=limit).compute()
    np.testing.assert_array_equal(got, _filled(a, limit, backward))
    assert got.dtype == a.dtype


@pytest.mark.executors("threads")
def test_fills_of_integers_are_the_array_and_of_a_value_in_memory_are_numpys() -> None:
    ints = np.arange(10)
    np.testing.assert_array_equal(tw.ffill(tw.from_array(ints, rows=3)).compute(), ints)
    total = tw.from_array(np.array([[1.0, np.nan], [np.nan, 2.0]]), rows=1).sum(axis=1)
    np.testing.assert_array_equal(tw.ffill(total).compute(), [np.nan, np.nan])
    with pytest.raises(ValueError, match="ffill fills along the rows"):
        tw.ffill(np.ones((3, 2)), axis=1)
    with pytest.raises(ValueError, match="limit must be 0 or more"):
        tw.bfill(np.ones(3), limit=-1)


@pytest.mark.executors("threads")
def test_rows_from_inside_a_block_are_read_from_its_first_row() -> None:
    """A request that starts inside a pass-1 block (a slice, another cut) is read from
    that block's first row, scanned from its carry: the same rows."""
    a = np.random.default_rng(2).integers(0, 100, (1000, 2))
    a_f = a.astype(float)
    a_f[::7] = np.nan
    x, xf = tw.from_array(a, rows=128), tw.from_array(a_f, rows=128)
    scanned = np.cumsum(x, axis=0)
    np.testing.assert_array_equal(scanned[300:517].compute(), np.cumsum(a, axis=0)[300:517])
    np.testing.assert_array_equal(scanned[::-1].compute(), np.cumsum(a, axis=0)[::-1])
    np.testing.assert_array_equal(
        tw.bfill(xf)[100:130].compute(), _filled(a_f, None, True)[100:130]
    )
    sums = np.cumsum(x, axis=0).sum(axis=0).compute()
    np.testing.assert_array_equal(sums, np.cumsum(a, axis=0).sum(axis=0))


@pytest.mark.executors("threads")
def test_a_scan_after_a_mask_with_empty_blocks_counts_first() -> None:
    a = np.arange(3000.0).reshape(1000, 3)
    keep = (a[:, 0] % 9 == 0) & ((a[:, 0] < 600) | (a[:, 0] > 2400))  # blocks with none
    x = tw.from_array(a, rows=100)
    masked = x[x[:, 0] % 9 == 0][
        (x[x[:, 0] % 9 == 0][:, 0] < 600) | (x[x[:, 0] % 9 == 0][:, 0] > 2400)
    ]
    np.testing.assert_array_equal(np.cumsum(masked, axis=0).compute(), np.cumsum(a[keep], axis=0))
    empty = x[x[:, 0] < 0]
    got = np.cumsum(empty, axis=0).compute()
    assert got.shape == (0, 3) and got.dtype == np.float64
    assert tw.ffill(empty).compute().shape == (0, 3)


@pytest.mark.executors("threads")
def test_a_scan_of_its_own_output_and_into_a_file(tmp_path: Path) -> None:
    a = np.random.default_rng(3).integers(-5, 5, (5000, 2)).astype(np.int32)
    path = tmp_path / "a.npy"
    np.save(path, a)
    x = tw.from_npy(path, rows=700)
    twice = np.cumsum(np.cumsum(x, axis=0), axis=0)
    out = tmp_path / "scanned.npy"
    twice.to_npy(out)
    np.testing.assert_array_equal(np.load(out), np.cumsum(np.cumsum(a, axis=0), axis=0))
    again = np.cumsum(tw.from_npy(out, rows=333), axis=0).compute()
    np.testing.assert_array_equal(again, np.cumsum(np.load(out), axis=0))


@pytest.mark.executors("threads")
def test_describe_shows_the_two_passes() -> None:
    x = tw.from_array(np.ones((100, 2)), rows=25)
    s = tw.ffill(np.cumsum(x, axis=0), limit=3)
    plan = build_plan([Target(s._node, ArraySink(s._node))], workers=2, budget=1 << 30)
    text = describe(plan, tasks=True)
    assert "3 pass(es)" in text.splitlines()[0], text
    assert "block totals of cumsum(axis=0) (4 blocks)" in text, text
    assert "block totals of ffill(limit=3) (4 blocks)" in text, text


_CHILD = textwrap.dedent(
    """
    import json, sys, threading, time
    import numpy as np
    import tierflow as tw

    peak, done = [0], threading.Event()

    def sample():  # anonymous memory: the file's mapped pages are page cache
        while not done.is_set():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    peak[0] = max(peak[0], int(line.split()[1]) * 1024)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    src, out = sys.argv[1], sys.argv[2]
    tw.ffill(np.cumsum(tw.from_npy(src), axis=0)).to_npy(out)
    done.set()
    sampler.join()
    print(json.dumps({"peak": peak[0], "budget": tw.memory.status().budget}))
    """
)


@pytest.mark.slow
@pytest.mark.executors("threads")
def test_a_file_bigger_than_the_memory_limit_is_scanned_in_a_flat_budget(tmp_path: Path) -> None:
    try:
        from cgroups import memory_cgroup, skip_reason
    except ImportError as exc:
        pytest.skip(f"the cgroup test helper is not importable: {exc}")
    if (reason := skip_reason()) is not None:
        pytest.skip(reason)
    rows = (384 << 20) // 32  # 384 MB of float32 [rows, 8]
    src = tmp_path / "src.npy"
    data = np.lib.format.open_memmap(src, "w+", np.float32, (rows, 8))
    for start in range(0, rows, 1 << 20):
        stop = min(rows, start + (1 << 20))
        data[start:stop] = (np.arange(start, stop) % 7 - 3)[:, None]
    data.flush()
    del data
    out = tmp_path / "out.npy"
    limit = 192 << 20
    with memory_cgroup(limit) as cgroup:
        done = cgroup.run(
            [sys.executable, "-c", _CHILD, str(src), str(out)],
            timeout=600,
            env={**os.environ, "TIERFLOW_JIT": "0"},
        )
        assert done.returncode == 0, (done.returncode, cgroup.oom_kills(), done.stderr[-2000:])
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    # the file is 384 MB, the result too: the process held a fraction of either
    assert figures["peak"] < min(limit, (rows * 32) // 3), figures
    got = np.load(out, mmap_mode="r")
    for start in (0, rows // 2, rows - 1000):
        k = np.arange(start, start + 1000) % 7  # each 7 rows add up to 0
        want = (k + 1) * k / 2 - 3 * (k + 1)
        np.testing.assert_array_equal(got[start : start + 1000], np.repeat(want[:, None], 8, 1))
