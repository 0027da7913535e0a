"""map_blocks: inferred dtype and row shape, checked results, extra arrays, devices."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.graph.block_operators import MapBlocks
from tierflow.errors import BlockError, DependencyError, install_command


@pytest.fixture
def a() -> np.ndarray:
    return np.random.default_rng(3).normal(size=(1000, 6)).astype(np.float32)


def test_dtype_and_row_shape_come_from_a_probe_block(a: np.ndarray) -> None:
    x = tw.from_array(a, rows=300)
    y = x.map_blocks(lambda b: (b[:, :2] > 0).astype(np.int16))
    assert (y.shape, y.dtype) == ((1000, 2), np.int16)
    np.testing.assert_array_equal(y.compute(), (a[:, :2] > 0).astype(np.int16))
    z = x.map_blocks(lambda b, scale: b.reshape(len(b), 2, 3) * scale, scale=2.0)
    assert z.shape == (1000, 2, 3) and z.dtype == np.float32
    np.testing.assert_array_equal(z.compute(), a.reshape(1000, 2, 3) * 2.0)


def test_extra_arrays_come_as_aligned_blocks(a: np.ndarray) -> None:
    x = tw.from_array(a, rows=300)
    other = tw.from_array(np.arange(1000.0), rows=77)  # other blocks: rows still line up
    y = x.map_blocks(lambda b, o: b[:, 0] + o, other)
    np.testing.assert_allclose(y.compute(), a[:, 0] + np.arange(1000.0))
    with pytest.raises(ValueError, match=r"different rows: \(1000, 6\) and \(10,\)"):
        x.map_blocks(lambda b, o: b, tw.from_array(np.zeros(10)))


def test_wrong_outputs_name_the_block_and_the_shapes(a: np.ndarray) -> None:
    x = tw.from_array(a, rows=300)
    few = x.map_blocks(lambda b: b[:-1] if len(b) < 300 else b, dtype=np.float32, row_shape=(6,))
    with pytest.raises(
        BlockError,
        match=r"block 3 of 4 \(rows 900:1000\).*returned shape \(99, 6\) for a block of shape \(100, 6\)",
    ):
        few.compute(executor="serial")
    wide = x.map_blocks(lambda b: np.hstack([b, b]), dtype=np.float32, row_shape=(6,))
    with pytest.raises(
        BlockError, match=r"returned shape \(300, 12\).*must return shape \(300, 6\)"
    ):
        wide.compute(executor="serial")
    floats = x.map_blocks(lambda b: b, dtype=np.int32, row_shape=(6,))
    with pytest.raises(
        BlockError, match="returned float32, which does not cast to the declared int32"
    ):
        floats.compute(executor="serial")
    with pytest.raises(
        ValueError, match=r"returned shape \(6,\) for a probe block of shape \(2, 6\)"
    ):
        x.map_blocks(lambda b: b.sum(axis=0))
    with pytest.raises(ZeroDivisionError, match="probe block of two zero rows"):
        x.map_blocks(lambda b: 1 // 0)


def test_user_function_errors_are_block_errors_with_the_cause(a: np.ndarray) -> None:
    def bad(b: np.ndarray) -> np.ndarray:
        raise KeyError("feature 7")

    y = tw.from_array(a, rows=500).map_blocks(bad, dtype=np.float32, row_shape=(6,))
    with pytest.raises(
        BlockError,
        match=r"map_blocks\(.*bad\) failed on block 0 of 2 \(rows 0:500\).*KeyError: 'feature 7'",
    ) as info:
        y.compute(executor="serial")
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.torch
def test_device_auto_gives_torch_tensors_and_the_results_come_back(a: np.ndarray) -> None:
    torch = pytest.importorskip("torch")
    kinds: set[str] = set()

    def model(t: object) -> object:
        assert isinstance(t, torch.Tensor)
        kinds.add(t.device.type)
        return torch.nn.functional.relu(t) * 2

    y = tw.from_array(a, rows=256).map_blocks(model, device="auto")
    assert y.dtype == np.float32 and y.shape == (1000, 6)
    np.testing.assert_allclose(y.compute(), np.maximum(a, 0) * 2, rtol=1e-6)
    assert kinds <= {"cpu", "cuda"}


def test_a_gpu_that_does_not_exist_is_refused(a: np.ndarray) -> None:
    pytest.importorskip("torch")
    from tierflow.system.devices import FakeGpus, use_provider

    with (
        use_provider(FakeGpus([])),
        pytest.raises(ValueError, match=r"no such GPU .*GPUs here: none"),
    ):
        tw.from_array(a).map_blocks(lambda t: t, device="cuda:1")


@pytest.mark.gpu
def test_cuda_map_blocks_runs_on_the_gpu(a: np.ndarray) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    y = tw.from_array(a, rows=256).map_blocks(
        lambda t: (t @ t.T).diagonal()[:, None], device="cuda"
    )
    np.testing.assert_allclose(y.compute()[:, 0], (a * a).sum(axis=1), rtol=1e-4)


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_device_auto_without_torch_gives_numpy_blocks_on_the_cpu(
    a: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    kinds: list[type] = []

    def double(b: np.ndarray) -> np.ndarray:
        kinds.append(type(b))
        return b * 2

    y = tw.from_array(a, rows=256).map_blocks(double, device="auto")
    assert y.dtype == np.float32 and y.shape == (1000, 6)  # from a NumPy probe block
    assert kinds == [np.ndarray]
    np.testing.assert_array_equal(y.compute(), a * 2)
    assert set(kinds) == {np.ndarray} and len(kinds) > 1


@pytest.mark.executors("serial")  # computes nothing
def test_auto_resolved_where_torch_is_missing_gives_numpy_blocks(
    a: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plan made where torch is installed, run in a process without it.
    monkeypatch.setitem(sys.modules, "torch", None)
    op = MapBlocks(lambda b: b + 1, 1, np.float32, (6,), device="auto")
    np.testing.assert_array_equal(op.apply(a[:10]), a[:10] + 1)
    assert op.device is None and repr(op) == "MapBlocks(map_blocks)"


@pytest.mark.executors("serial")  # computes nothing
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_gpu_without_torch_names_the_extra(
    a: np.ndarray, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(DependencyError) as info:
        tw.from_array(a).map_blocks(lambda b: b * 2, device=device)
    assert str(info.value) == (
        f"map_blocks(device='{device}') needs the optional package 'torch': "
        f"{install_command('torch')}"
    )


def _kind_of(block: np.ndarray) -> np.ndarray:
    """1 where the function got a plain array viewing memory it does not own."""
    plain = type(block) is np.ndarray and not block.flags.owndata
    return np.full((len(block), 1), 1.0 if plain else 0.0)


def test_a_function_gets_file_blocks_as_plain_array_views(tmp_path: Path) -> None:
    # np.memmap's indexing runs in Python: a per-row function would pay for it per row.
    np.save(tmp_path / "a.npy", np.arange(400.0).reshape(100, 4))
    x = tw.from_npy(tmp_path / "a.npy", rows=25)
    got = x.map_blocks(_kind_of, dtype=np.float64, row_shape=(1,)).compute()
    assert got.min() == 1.0


@pytest.mark.torch
@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_torch_on_the_cpu_is_called_in_batches_of_cpu_batch_bytes(
    a: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from tierflow.engine.graph import block_operators
    from tierflow.system.devices import FakeGpus, use_provider

    monkeypatch.setattr(block_operators, "CPU_BATCH_BYTES", 40 * 6 * 4)  # 40 rows
    sizes: list[int] = []

    def model(t: object) -> object:
        assert isinstance(t, torch.Tensor) and t.device.type == "cpu"
        sizes.append(len(t))
        return (t * 2).double()  # cast back to the declared float32

    with use_provider(FakeGpus([])):
        y = tw.from_array(a, rows=256).map_blocks(
            model, dtype=np.float32, row_shape=(6,), device="auto"
        )
        np.testing.assert_array_equal(y.compute(), a * 2)
    assert max(sizes) == 40 and sum(sizes) == 1000
    assert sorted(set(sizes)) == [16, 32, 40]  # blocks of 256 = 6 x 40 + 16, 232 = 5 x 40 + 32


def test_batch_rows_make_cpu_batch_bytes_of_input_and_at_least_one() -> None:
    from tierflow.engine.graph.block_operators import CPU_BATCH_BYTES, batch_rows

    images = np.zeros((10, 3, 32, 32), np.float32)  # 12 KB a row
    assert batch_rows([images]) == CPU_BATCH_BYTES // 12288
    assert batch_rows([images, np.zeros(10)]) == CPU_BATCH_BYTES // (12288 + 8)
    assert batch_rows([np.zeros((2, CPU_BATCH_BYTES), np.uint16)]) == 1
