"""Fused operators and reductions on a GPU, with simulated GPUs (torch CPU tensors
accounted as ``cuda:N``): results against NumPy, copies counted, copy/compute order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierflow as tw
from engine.api.test_properties import arrays, outcome
from tierflow import config
from tierflow.engine.gpu import offload, tier, transfer
from tierflow.system.devices import FakeGpus, use_provider

from common import examples

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.executors("threads", "serial")]

GB = 1 << 30
ROWS = 256  # rows per block: 1000 rows are 4 blocks


@pytest.fixture
def a() -> np.ndarray:
    return np.random.default_rng(5).normal(size=(1000, 6)).astype(np.float32)


@pytest.fixture
def gpus() -> Iterator[None]:
    """Two simulated GPUs, cuda:1 with the more free memory; copy counts from zero.
    Slots enough that every task of a compute fits on cuda:1 (the GPU with the most
    room takes each task, while it has a free slot: tests of the spreading are in
    test_gpu_tier.py)."""
    with use_provider(FakeGpus([(4 * GB, 16 * GB), (8 * GB, 16 * GB)])), config.set(gpu_slots=64):
        transfer.reset_stats()
        transfer.record_order(True)
        yield
        transfer.record_order(False)
        transfer.reset_stats()


def _copies(device: str = "cuda:1") -> transfer.CopyStats:
    return transfer.stats(device)


EXPRESSIONS = [
    ("arithmetic", lambda x: (x * 2 + 1) / 3 - x),
    ("transcendental", lambda x: np.exp(-(x**2)) + np.log1p(abs(x))),
    ("comparison and where", lambda x: tw.where(x > 0.5, x, -x)),
    ("clip and round", lambda x: np.round(np.clip(x, -1, 1), 2)),
    ("cast to int and back", lambda x: (x * 10).astype(np.int16) // 3 + 0.5),
    ("mixed dtypes", lambda x: x.astype(np.int8) + np.float64(0.25)),
    ("scalar first", lambda x: 2 - x / (np.float32(3) * 2)),
    ("row vectors", lambda x: (x - np.arange(6.0)) / np.linspace(1, 2, 6, dtype=np.float32)),
    ("scalar branches", lambda x: tw.where(x > 0, 1.0, -1.0) * (x.astype(np.int16) * 2.5)),
]


@pytest.mark.parametrize("expr", [e for _, e in EXPRESSIONS], ids=[n for n, _ in EXPRESSIONS])
@pytest.mark.usefixtures("gpus")
def test_fused_expressions_on_the_gpu_match_numpy(a: np.ndarray, expr: object) -> None:
    x = tw.from_array(a, rows=ROWS)
    y = expr(x)  # type: ignore[operator]
    want = y.compute(device="cpu")
    got = y.compute(device="cuda")
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert _copies().h2d == 4  # it did run on the (simulated) GPU


REDUCTIONS = ["sum", "mean", "min", "max", "prod", "any", "all", "count_nonzero"]


@pytest.mark.parametrize("kind", REDUCTIONS)
@pytest.mark.usefixtures("gpus")
def test_reductions_on_the_gpu_match_numpy(a: np.ndarray, kind: str) -> None:
    """float32 sums and means accumulate in float64 on both sides, in a different
    order: within rtol=1e-6 of NumPy's float64 result (the documented tolerance)."""
    x = tw.from_array(a, rows=ROWS) * 0.5 + 1
    data = a * np.float32(0.5) + np.float32(1)
    for axis in (0, None, (0, 1)):
        if kind == "count_nonzero":
            lazy: Any = np.count_nonzero(x, axis=axis)  # an Array, by __array_function__
            got = lazy.compute(device="cuda")
            want = np.count_nonzero(data, axis=axis)
        else:
            got = getattr(x, kind)(axis=axis).compute(device="cuda")
            ref = data.astype(np.float64) if kind in ("sum", "mean", "prod") else data
            want = getattr(np, kind)(ref, axis=axis).astype(np.asarray(got).dtype)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert _copies().d2h >= 4  # partials came back from the device


@pytest.mark.usefixtures("gpus")
def test_integer_sums_on_the_gpu_are_exact_and_wrap_as_numpy_does() -> None:
    data = np.arange(-3000, 3000, dtype=np.int32).reshape(2000, 3) * 1_000_000
    x = tw.from_array(data, rows=300)
    got = (x * 3).sum(axis=0).compute(device="cuda")
    np.testing.assert_array_equal(got, (data * 3).sum(axis=0))
    assert got.dtype == np.int64


@pytest.mark.usefixtures("gpus")
def test_a_chain_through_a_gpu_model_copies_each_block_in_once_and_only_partials_out(
    a: np.ndarray,
) -> None:
    seen: list[str] = []

    def model(t: object) -> object:
        assert isinstance(t, torch.Tensor)
        seen.append(str(t.device))
        return torch.relu(t) * 3

    x = tw.from_array(a, rows=ROWS)
    y = ((x - 0.5) * 2).map_blocks(model, device="cuda:1").sum(axis=0)
    seen.clear()  # the call on a probe block that found the result's dtype
    transfer.reset_stats()  # ... and its copies
    got = y.compute(executor="serial")
    np.testing.assert_allclose(got, (np.maximum((a - 0.5) * 2, 0) * 3).sum(axis=0), rtol=1e-6)
    copies = _copies()
    assert (copies.h2d, copies.h2d_bytes) == (4, a.nbytes)
    assert (copies.d2h, copies.d2h_bytes) == (4, 4 * 6 * 8)  # one float64 partial a block
    assert len(seen) == 4


@pytest.mark.usefixtures("gpus")
def test_the_copy_of_the_next_block_is_issued_before_this_block_computes(
    a: np.ndarray,
) -> None:
    x = tw.from_array(a, rows=ROWS)
    (x * 2).sum(axis=0).compute(device="cuda:1", executor="serial")
    assert _copies().order == [
        ("copy", 0),
        ("copy", 1),
        ("compute", 0),
        ("copy", 2),
        ("compute", 1),
        ("copy", 3),
        ("compute", 2),
        ("compute", 3),
    ]


@pytest.mark.usefixtures("gpus")
def test_blocks_read_from_a_file_are_staged_ahead_and_written_to_a_file(
    a: np.ndarray, tmp_path: Path
) -> None:
    np.save(tmp_path / "x.npy", a)
    x = tw.from_npy(tmp_path / "x.npy", rows=ROWS)
    y: Any = np.sqrt(abs(x)) * 2
    y.to_npy(tmp_path / "y.npy", device="cuda:1")
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), np.sqrt(abs(a)) * 2, rtol=1e-6)
    copies = _copies()
    assert (copies.h2d, copies.d2h, copies.d2h_bytes) == (4, 4, a.nbytes)


@pytest.mark.usefixtures("gpus")
def test_a_gpu_map_blocks_pulls_its_neighbours_onto_the_gpu(a: np.ndarray) -> None:
    x = tw.from_array(a, rows=ROWS)
    y = (x + 1).map_blocks(lambda t: t * 2, device="cuda:1").mean(axis=0)
    transfer.reset_stats()
    np.testing.assert_allclose(y.compute(), ((a + 1) * 2).mean(axis=0), rtol=1e-6)
    copies = _copies()
    assert (copies.h2d, copies.d2h, copies.d2h_bytes) == (4, 4, 4 * 6 * 8)  # partials out
    transfer.reset_stats()
    y.compute(device="cpu")  # asked for the CPU: the model's blocks go back and forth
    copies = _copies()
    assert (copies.h2d, copies.d2h, copies.d2h_bytes) == (4, 4, a.nbytes)  # blocks out


@pytest.mark.usefixtures("gpus")
def test_the_device_setting_applies_when_a_compute_does_not_say(a: np.ndarray) -> None:
    x = tw.from_array(a, rows=ROWS)
    (x * 2).sum().compute()
    assert _copies().h2d == 0
    with config.set(device="cuda:0"):
        (x * 2).sum().compute()
    assert (transfer.stats("cuda:0").h2d, _copies().h2d) == (4, 0)


@pytest.mark.usefixtures("gpus")
def test_cuda_takes_the_gpu_with_the_most_free_memory_or_the_admitted_one(
    a: np.ndarray,
) -> None:
    x = tw.from_array(a, rows=ROWS)
    (x * 2).sum().compute(device="cuda", executor="serial")
    assert (transfer.stats("cuda:0").h2d, transfer.stats("cuda:1").h2d) == (0, 4)
    with tier.running_on("cuda:0"):
        (x * 2).sum().compute(device="cuda", executor="serial")
    assert transfer.stats("cuda:0").h2d == 4


def test_without_a_gpu_auto_runs_on_the_cpu_and_cuda_is_refused(a: np.ndarray) -> None:
    x = tw.from_array(a, rows=ROWS)
    with use_provider(FakeGpus([])):
        y = (x * 2).sum(axis=0)
        np.testing.assert_array_equal(y.compute(device="auto"), y.compute(device="cpu"))
        with pytest.raises(ValueError, match=r"device='cuda': no GPU here"):
            (x * 2).sum().compute(device="cuda")
        with pytest.raises(ValueError, match=r"device='cuda:3': no such GPU \(GPUs here: none"):
            (x * 2).sum().compute(device="cuda:3")
    with pytest.raises(ValueError, match=r"use 'cpu', 'auto', 'cuda' or 'cuda:N'"):
        (x * 2).sum().compute(device="gpu")
    with pytest.raises(tw.errors.ConfigError, match=r"device='gpu'"):
        config.set(device="gpu")


@pytest.mark.usefixtures("gpus")
def test_what_torch_cannot_do_the_numpy_way_stays_on_the_cpu(a: np.ndarray) -> None:
    x = tw.from_array(a, rows=ROWS)
    y = np.cbrt(x).var(axis=0)  # no torch cbrt; var has no GPU partial
    np.testing.assert_allclose(y.compute(device="cuda"), np.cbrt(a).var(axis=0), rtol=1e-5)
    assert _copies().h2d == 0


# -- device="auto" ----------------------------------------------------------------------


def test_the_auto_rule_weighs_cpu_work_against_the_copy() -> None:
    cheap = offload.Work(ops_per_row=3 * 8, copy_bytes_per_row=4 * 8, launches=4)
    heavy = offload.Work(ops_per_row=40 * 8, copy_bytes_per_row=4 * 8, launches=4)
    rows = 1 << 20
    # 16 cores at 2e9 ops/s: cheap 24 ops a row = 0.79 ms; copying 32 MiB at 12 GB/s 2.6 ms.
    assert not offload.gpu_pays(cheap, rows, bandwidth=12e9, cores=16)
    assert offload.gpu_pays(heavy, rows, bandwidth=12e9, cores=16)  # 10.5 ms of CPU
    assert offload.gpu_pays(cheap, rows, bandwidth=100e9, cores=16)  # 0.34 ms copy
    assert not offload.gpu_pays(heavy, 10, bandwidth=12e9, cores=16)  # launches dominate


@pytest.mark.usefixtures("gpus")
def test_auto_puts_a_block_on_the_gpu_only_where_the_copy_pays() -> None:
    # Blocks big enough for the work to outweigh 11 kernel launches (110 us).
    data = np.random.default_rng(6).normal(size=(4 * 8192, 6)).astype(np.float32)
    x = tw.from_array(data, rows=8192)
    heavy = np.exp(np.sin(x) * np.cos(x)) + np.log1p(abs(x))
    with config.set(copy_bandwidth="1KB"):  # a slow bus: every copy outweighs the work
        np.testing.assert_allclose(heavy.sum(0).compute(device="auto"), heavy.sum(0).compute())
    assert _copies().h2d == 0
    with config.set(copy_bandwidth="1000TB"):  # a bus faster than any work: the GPU
        got = heavy.sum(0).compute(device="auto")
    np.testing.assert_allclose(got, heavy.sum(0).compute(), rtol=1e-6)
    assert _copies().h2d == 4


@pytest.mark.usefixtures("gpus")
def test_a_gpu_model_that_runs_out_of_memory_is_halved_on_the_device(a: np.ndarray) -> None:
    from tierflow.engine.program import halving

    sizes: list[int] = []

    def model(t: object) -> object:
        assert isinstance(t, torch.Tensor)
        sizes.append(len(t))
        if len(t) > 64:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return t * 2

    halving.forget()
    try:
        y = (x := tw.from_array(a, rows=ROWS)).map_blocks(model, device="cuda:1") + x
        sizes.clear()  # the probe's call and copy
        transfer.reset_stats()
        got = y.sum(axis=0).compute(executor="serial")
    finally:
        halving.forget()
    np.testing.assert_allclose(got, (a.astype(np.float64) * 3).sum(axis=0), rtol=1e-6)
    assert sizes[:3] == [256, 128, 64] and sizes.count(256) == 1  # later blocks: remembered
    assert (_copies().h2d, _copies().d2h) == (4, 4)  # halves stayed on the device


@pytest.mark.gpu
def test_on_a_real_gpu_a_chain_copies_each_block_in_once(a: np.ndarray) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = tw.from_array(a, rows=ROWS)
    y = (x * 2 + 1).map_blocks(lambda t: torch.tanh(t), device="cuda:0").sum(axis=0)
    transfer.reset_stats()  # after the probe block's copies
    want = np.tanh(a.astype(np.float64) * 2 + 1).sum(axis=0)
    np.testing.assert_allclose(y.compute(), want, rtol=1e-5)
    assert (transfer.stats("cuda:0").h2d, transfer.stats("cuda:0").d2h) == (4, 4)
    assert not transfer.lane("cuda:0").fake


@pytest.mark.usefixtures("gpus")
def test_a_programs_device_bytes_count_copies_outputs_and_intermediates(a: np.ndarray) -> None:
    from tierflow.engine.planning.lower import lower_pass

    x = tw.from_array(a, rows=ROWS)
    y = ((x - 0.5) * 2).map_blocks(lambda t: t * 3, device="cuda:1").sum(axis=0)
    program, _ = lower_pass([], [y._node], {}, None, None)
    row = 6 * 4  # bytes of a float32 row of 6
    kernel = 2 * row + 2 * row  # output and halving output; subtract and multiply
    model = 2 * row + row  # output and halving output; one output block of scratch
    copied = 2 * row  # x's block, and the next block's staged beside it
    partial = 6 * 16 + 64
    assert program.device == "cuda:1"
    assert program.device_bytes(ROWS) == ROWS * (kernel + model + copied) + partial
    on_cpu, _ = lower_pass([], [y._node], {}, None, "cpu")
    assert on_cpu.device is None and on_cpu.device_bytes(ROWS) == 0


def test_the_device_setting_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERFLOW_DEVICE", "cuda:1")
    config.reset()
    assert config.get("device") == "cuda:1"
    monkeypatch.setenv("TIERFLOW_DEVICE", "gpu0")
    config.reset()
    with pytest.raises(tw.errors.ConfigError, match=r"TIERFLOW_DEVICE='gpu0'"):
        config.get("device")


# -- properties: the GPU against the CPU -------------------------------------------------

GPU_EXPRESSIONS = {
    "x * 3 - 1": lambda x: x * 3 - 1,
    "abs(x) + x": lambda x: abs(x) + x,
    "maximum(x, 0)": lambda x: np.maximum(x, 0),
    "x > 0": lambda x: x > 0,
    "where(x > 0, x, 0)": lambda x: tw.where(x > 0, x, 0),
    "x // 3 + x % 3": lambda x: x // 3 + x % 3,
    "x / 2": lambda x: x / 2,
    "sqrt(abs(x)) * exp(x * 0.01)": lambda x: np.sqrt(abs(x)) * np.exp(x * 0.01),
    "clip(x, -5, 5) ** 2": lambda x: np.clip(x, -5, 5) ** 2,
}


@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    a=arrays(),
    expr=st.sampled_from(sorted(GPU_EXPRESSIONS)),
    kind=st.sampled_from([None, "sum", "min", "max", "any", "mean"]),
    block=st.integers(1, 7),
)
def test_any_dtype_and_block_size_gives_the_cpus_result_on_the_gpu(
    a: np.ndarray, expr: str, kind: str | None, block: int
) -> None:
    with use_provider(FakeGpus([(GB, GB)])):
        y = GPU_EXPRESSIONS[expr](tw.from_array(a, rows=block))
        if kind is not None:
            y = getattr(y, kind)(axis=0)
        cpu = outcome(lambda: y.compute(device="cpu"))
        gpu = outcome(lambda: y.compute(device="cuda"))
    assert gpu[0] == cpu[0], (gpu, cpu)
    if cpu[0] == "ok":
        got, want = np.asarray(gpu[1]), np.asarray(cpu[1])
        assert got.dtype == want.dtype and got.shape == want.shape
        if want.dtype.kind in "fc":
            np.testing.assert_allclose(got, want, rtol=1e-3 if want.dtype == np.float16 else 1e-6)
        else:
            np.testing.assert_array_equal(got, want)
    else:
        assert gpu[1] is cpu[1]


@pytest.mark.usefixtures("gpus")
def test_a_masked_reduction_on_the_gpu_keeps_its_mask_with_kernels_on(a: np.ndarray) -> None:
    """The compiled masked reduction reads unfiltered blocks; a reduction whose device
    form runs on the GPU keeps the filter's rows (jit on, eager)."""
    pytest.importorskip("numba")
    x = tw.from_array(a, rows=ROWS)
    for device in ("cuda", "cpu"):
        got = x[x[:, 0] > 0.2].sum(axis=0).compute(device=device, jit="eager")
        want = a[a[:, 0] > 0.2].sum(axis=0, dtype=np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5)
