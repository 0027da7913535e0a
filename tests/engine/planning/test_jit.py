"""Compiled kernels in a compute: the switches, tiering, the profile's report, warnings,
the kernel folder across processes, and a machine without numba."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tierflow as tw
from tierflow import config
from tierflow.errors import ConfigError

pytest.importorskip("numba")
pytestmark = pytest.mark.executors("threads")


def _kernels(profile: tw.Profile) -> list[str]:
    return profile.computes[-1].kernels


def _column_sum(rows: int = 20_000) -> tuple[np.ndarray, tw.Array]:
    x = np.random.default_rng(0).random((rows, 8), dtype=np.float32)
    return x, tw.from_array(x, rows=4096)


def test_an_eager_compute_runs_every_block_on_the_kernel_with_the_numpy_paths_result() -> None:
    x, a = _column_sum()
    expr = np.sqrt(a * 2 + 1).sum(axis=0)
    with tw.profile() as p:
        (got,) = tw.compute(expr, jit="eager")
    (report,) = _kernels(p)
    assert "compiled in" in report or "read from disk" in report
    assert "5 kernel, 0 waiting, 0 sent back" in report
    (source,) = p.computes[-1].kernel_sources.values()
    assert "np.float32(np.sqrt(" in source  # the generated loop, readable
    (want,) = tw.compute(expr, jit=False)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_allclose(got, np.sqrt(x.astype(np.float64) * 2 + 1).sum(0), rtol=1e-6)


@pytest.mark.parametrize("how", ["option", "setting", "environment"])
def test_jit_off_keeps_every_block_on_the_numpy_path(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, a = _column_sum()
    options: dict[str, object] = {}
    if how == "option":
        options["jit"] = False
    elif how == "setting":
        config.set(jit=False)
    else:
        monkeypatch.setenv("TIERFLOW_JIT", "0")
        config.reset()
    with tw.profile() as p:
        tw.compute((a * 2).sum(axis=0), **options)
    assert _kernels(p) == ["sum(axis=0): NumPy path: jit is off"]


def test_a_bad_jit_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERFLOW_JIT", "maybe")
    config.reset()
    with pytest.raises(ConfigError, match="TIERFLOW_JIT='maybe' must be 1, 0 or eager"):
        config.get("jit")
    monkeypatch.delenv("TIERFLOW_JIT")
    config.reset()
    _, a = _column_sum()
    with pytest.raises(ValueError, match="jit='later': use True, False or 'eager'"):
        tw.compute(a.sum(axis=0), jit="later")


def test_a_small_compute_never_asks_for_a_compiler() -> None:
    _, a = _column_sum()
    # expressions no other test compiles; the masked one has rows unknown until computed
    for expr in [(a * 3 - 1).max(axis=0), a[a[:, 5] * 7 > 3].min(axis=0)]:
        with tw.profile() as p:
            tw.compute(expr)
        (report,) = _kernels(p)
        assert "not asked for (a small compute)" in report
        assert "0 kernel, 0 waiting" in report


def test_a_compute_over_the_threshold_starts_on_the_numpy_path_and_never_waits() -> None:
    config.set(jit_min_bytes=1)
    _, a = _column_sum(rows=4096 * 3)
    with tw.profile() as p:
        (got,) = tw.compute((a - 0.25).min(axis=0))
    (report,) = _kernels(p)
    # every block ran on one path or the other; none waited for the compiler
    counts = report.split("blocks: ")[1]
    kernel, waiting = (int(part.split()[0]) for part in counts.split(", ")[:2])
    assert kernel + waiting == 3
    np.testing.assert_array_equal(got, tw.compute((a - 0.25).min(axis=0), jit=False)[0])


def test_a_program_the_compiler_cannot_take_says_why() -> None:
    x = np.ones((100, 4), np.float16)
    with tw.profile() as p:
        (got,) = tw.compute((tw.from_array(x) * 2).sum(axis=0), jit="eager")
    (report,) = _kernels(p)
    assert "NumPy path:" in report and "float16" in report
    np.testing.assert_array_equal(got, (x * 2).sum(axis=0))


def test_describe_names_the_kernel_or_the_reason() -> None:
    from tierflow.engine.planning.jit import settings as jit_settings
    from tierflow.engine.planning.plan import Target, build_plan, describe

    _, a = _column_sum()
    settings = jit_settings(True)
    text = describe(
        build_plan([Target((a * 2).sum(axis=0)._node)], workers=2, budget=1 << 30, jit=settings),
        tasks=True,
    )
    assert "compiled kernel " in text
    half = tw.from_array(np.ones((100, 4), np.float16))
    text = describe(
        build_plan([Target((half * 2).sum(axis=0)._node)], workers=2, budget=1 << 30, jit=settings),
        tasks=True,
    )
    assert "NumPy path: input 0 has dtype float16" in text


def test_a_floating_point_error_warns_as_numpy_does() -> None:
    x = np.linspace(0, 1, 8 * 5000, dtype=np.float32).reshape(5000, 8)
    a = tw.from_array(x, rows=1000)
    with pytest.warns(RuntimeWarning, match="invalid value encountered in sqrt"):
        (got,) = tw.compute(np.sqrt(a - 0.5).sum(axis=0), jit="eager")
    assert np.isnan(got).all()
    with pytest.warns(RuntimeWarning, match="invalid value encountered in sqrt"):
        (counted,) = tw.compute((np.sqrt(a - 0.5) > 0.1).sum(axis=0), jit="eager")
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(counted, (np.sqrt(x - 0.5) > 0.1).sum(axis=0))


_SCRIPT = """
import warnings, sys
import numpy as np
import tierflow as tw
x = np.arange(80_000, dtype=np.float64).reshape(10_000, 8)
with tw.profile() as p:
    (got,) = tw.compute((tw.from_array(x, rows=2500) * 0.5).sum(axis=0), jit="eager")
assert np.allclose(got, (x * 0.5).sum(axis=0)), got
print(p.computes[-1].kernels[0])
"""


def _run(code: str, kernel_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TIERFLOW_KERNEL_DIR": str(kernel_dir)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_a_second_process_reads_the_kernel_from_disk(tmp_path: Path) -> None:
    first = _run(_SCRIPT, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "compiled in" in first.stdout
    second = _run(_SCRIPT, tmp_path)
    assert second.returncode == 0, second.stderr
    assert "read from disk" in second.stdout, second.stdout
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith("numba-")


def test_without_numba_the_numpy_path_runs_and_says_so_once(tmp_path: Path) -> None:
    code = (
        "import sys\nsys.modules['numba'] = None\n"
        + _SCRIPT
        + textwrap.dedent(
            """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tw.compute((tw.from_array(x, rows=2500) - 1).sum(axis=0), jit="eager")
        assert not caught, [str(w.message) for w in caught]
        """
        )
    )
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "failed: numba cannot be imported" in done.stdout
    assert done.stderr.count("fused programs run on the NumPy path") == 1


@pytest.mark.executors("processes", "dask", "ray")
def test_workers_get_the_same_results_with_kernels() -> None:
    x, a = _column_sum(rows=30_000)
    counts, _ = np.histogram(a[:, 1] * 2, bins=16, range=(0, 2))
    got = tw.compute(
        (a * 2 - 1).var(axis=0), a[a[:, 2] > 0.7].mean(axis=0), counts, a.argmin(axis=0),
        jit="eager",
    )  # fmt: skip
    want = [
        (x * np.float32(2) - 1).var(axis=0, dtype=np.float64),
        x[x[:, 2] > 0.7].mean(axis=0, dtype=np.float64),
        np.histogram(x[:, 1] * 2, bins=16, range=(0, 2))[0],
        x.argmin(axis=0),
    ]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def _kernels_here() -> list[tuple[str, str, bool]]:
    from tierflow.operators.compiled import tiered

    for kernel in tiered.kernels():
        kernel.ready.wait(60)
    return [(k.key, k.state, k.compiled) for k in tiered.kernels()]


@pytest.mark.executors("dask")
def test_dask_workers_read_the_kernel_the_driver_compiled(dask_client: object) -> None:
    _, a = _column_sum(rows=40_000)
    expr = (a * 3 + 0.5).sum(axis=0)  # an expression no other test compiles
    with tw.profile() as p:
        tw.compute(expr, jit="eager")
    (report,) = _kernels(p)
    key = report.split("kernel ")[1].split()[0]
    found = dask_client.run(_kernels_here)  # type: ignore[attr-defined]
    on_workers = [entry for entries in found.values() for entry in entries if entry[0] == key]
    assert on_workers, f"no worker asked for kernel {key}: {found}"
    assert all(state == "ready" and not compiled for _, state, compiled in on_workers)


def test_a_masked_reduction_reads_the_unfiltered_blocks_once() -> None:
    x, a = _column_sum(rows=20_000)
    x[4096:8192, 0] = 0  # a block the mask empties
    a = tw.from_array(x, rows=4096)
    expressions = [
        a[a[:, 0] > 0.5].sum(axis=0),
        (a * 2)[a[:, 0] > 0.5].mean(axis=0),
        a[(a[:, 3] < 0.2)].var(axis=0),
        a[a[:, 0] > 2].sum(axis=0),  # keeps no row at all
    ]
    with tw.profile() as p:
        got = tw.compute(*expressions, jit="eager")
    reports = _kernels(p)
    assert len(reports) == 4 and all("0 sent back" in r for r in reports), reports
    want = tw.compute(*expressions, jit=False)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-6)
    np.testing.assert_array_equal(got[3], np.zeros(8, np.float32))


def test_a_sink_takes_the_jit_option(tmp_path: Path) -> None:
    x, a = _column_sum()
    m = x.mean(axis=0)
    with tw.profile() as p:
        ((a - m) * 2).to_npy(tmp_path / "off.npy", jit=False)
    assert _kernels(p) == ["fused[multiply ∘ subtract]: NumPy path: jit is off"]
    with tw.profile() as p:
        ((a - m) * 2).to_npy(tmp_path / "on.npy", jit="eager")
    (report,) = _kernels(p)
    assert "0 waiting, 0 sent back" in report
    on, off = np.load(tmp_path / "on.npy"), np.load(tmp_path / "off.npy")
    assert on.tobytes() == off.tobytes() == ((x - m) * 2).tobytes()


def test_a_process_with_a_small_budget_runs_the_numpy_path_and_says_why() -> None:
    config.set(ram_budget="512MB")
    x, a = _column_sum()
    with tw.profile() as p:
        (got,) = tw.compute((a * 5 - 2).sum(axis=0), jit="eager")
    (report,) = _kernels(p)
    assert "not loaded: the memory budget (512.0 MB) is under 1.0 GB" in report, report
    assert "0 kernel" in report
    np.testing.assert_allclose(got, (x * np.float32(5) - 2).sum(0, dtype=np.float64), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["int32", "uint8", "bool", ">i8"])
def test_bincount_of_an_integer_array_counts_in_one_compiled_pass(dtype: str) -> None:
    values = np.random.default_rng(5).integers(0, 3000, 50_000).astype(dtype)
    a = tw.from_array(values, rows=8192)
    with tw.profile() as p:
        got = np.bincount(a, minlength=4000).compute(jit="eager")
    (report,) = _kernels(p)
    want = np.bincount(values.astype(np.intp), minlength=4000)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == want.dtype
    if dtype == ">i8":  # brought to native order before the kernel, or the NumPy path
        return
    # values past the first counts (1024): the NumPy path counts that block, and later
    # blocks get room (uint8 and bool values never outgrow them)
    outgrow = int(values[:8192].astype(np.intp).max() >= 1024)
    assert f"{7 - outgrow} kernel, 0 waiting, {outgrow} sent back" in report


@pytest.mark.parametrize("jit", ["eager", False])
def test_bincount_of_an_expression_is_fused_and_counts_in_one_compiled_pass(jit: object) -> None:
    rng = np.random.default_rng(8)
    x = rng.integers(-3000, 3000, (60_000, 3)).astype(np.int32)
    f = rng.random(60_000, dtype=np.float32)
    a, b = tw.from_array(x, rows=8192), tw.from_array(f, rows=8192)
    cases = [
        (
            np.bincount(np.clip(a[:, 1], 0, 100) + a[:, 2] // 1000 + 3),
            np.clip(x[:, 1], 0, 100) + x[:, 2] // 1000 + 3,
        ),
        (np.bincount(a[:, 0] % 7, minlength=10), x[:, 0] % 7),
        (np.bincount(np.sqrt(b) > 0.5), np.sqrt(f) > 0.5),
    ]
    for lazy, values in cases:
        with tw.profile() as p:
            got = lazy.compute(jit=jit)
        want = np.bincount(values, minlength=10 if lazy is cases[1][0] else 0)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype
        (report,) = _kernels(p)
        assert ("8 kernel, 0 waiting, 0 sent back" in report) == (jit == "eager"), report


def test_a_bincount_whose_float_steps_warn_counts_those_blocks_on_the_numpy_path() -> None:
    f = np.random.default_rng(9).random(40_000, dtype=np.float32)
    f[30_000] = -1  # sqrt warns in this block only
    with tw.profile() as p, pytest.warns(RuntimeWarning, match="invalid value encountered in sqrt"):
        got = np.bincount(np.sqrt(tw.from_array(f, rows=8192)) > 0.5).compute(jit="eager")
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(got, np.bincount(np.sqrt(f) > 0.5))
    assert "4 kernel, 0 waiting, 1 sent back" in _kernels(p)[0]


def test_bincount_refuses_as_numpy_does_and_says_what_is_not_compiled() -> None:
    values = np.arange(20_000) % 7
    values[15_000] = -1
    with pytest.raises(ValueError, match="no negative elements"):
        np.bincount(tw.from_array(values, rows=4096)).compute(jit="eager")
    weights = np.ones(20_000)
    a, w = tw.from_array(np.arange(20_000) % 7, rows=4096), tw.from_array(weights, rows=4096)
    with tw.profile() as p:
        got = np.bincount(a, weights=w).compute(jit="eager")
    np.testing.assert_array_equal(got, np.bincount(np.arange(20_000) % 7, weights=weights))
    assert _kernels(p) == ["bincount(weights): NumPy path: a bincount with weights is not compiled"]
