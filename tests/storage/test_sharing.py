"""Disk-backed arrays and tensors cross process boundaries by path, under spawn and fork."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import signal
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from tierflow import config, memory
from tierflow.errors import SpillError
from tierflow.storage import sharing, spill
from tierflow.storage.pages import file_range, mapped_bytes

MB = 1 << 20
TIMEOUT = 60  # seconds a child may take (a spawned child imports numpy and tierflow)


def _spilled(n: int = 8 * MB) -> np.memmap:
    """A spill-backed float64 array of ``n`` elements (64 MB by default, fallocated)."""
    return spill.map_array((n,), np.dtype(np.float64))


def _roundtrip(x: Any) -> Any:
    return pickle.loads(ForkingPickler.dumps(x))


# -- children (module level: a spawned child imports them by name) ---------------------


def _child_receives(from_args: np.ndarray, inbox: Any, outbox: Any) -> None:
    """Report how two arrays arrived (one in args, one through a queue), then write."""
    proc = psutil.Process()
    report: dict[str, Any] = {
        "args_mapped": mapped_bytes(from_args),
        "args_path": file_range(from_args).path,  # type: ignore[union-attr]
    }
    rss_before = proc.memory_info().rss
    x = inbox.get()
    report["rss_growth"] = proc.memory_info().rss - rss_before
    report["queue_mapped"] = mapped_bytes(x)
    report["queue_path"] = file_range(x).path  # type: ignore[union-attr]
    report["nbytes"] = x.nbytes
    report["head"] = x[:4].tolist()
    report["args_values"] = from_args.tolist()
    x[0] = -1.0  # the parent must see both writes
    from_args[-1] = -2.0
    outbox.put(report)
    inbox.get()  # the parent has written x[1]
    outbox.put(float(x[1]))


def _block_report(x: np.ndarray) -> tuple[float, int, str | None]:
    mapped = mapped_bytes(x)
    found = file_range(x)
    return float(x.sum()), mapped, None if found is None else found.path


def _echo(x: np.ndarray) -> np.ndarray:
    return x


def _child_recv_error(conn: Any) -> None:
    try:
        conn.recv()
    except SpillError as exc:
        conn.send(("error", str(exc)))
    else:
        conn.send(("ok", ""))


def _child_tensor(inbox: Any, outbox: Any) -> None:
    import torch

    proc = psutil.Process()
    rss_before = proc.memory_info().rss
    t = inbox.get()
    growth = proc.memory_info().rss - rss_before
    report = {
        "rss_growth": growth,
        "mapped": mapped_bytes(t.numpy()),  # a view: touches nothing
        "filename": t.untyped_storage().filename,
        "dtype": str(t.dtype),
        "shape": tuple(t.shape),
        "stride": t.stride(),
        "first": t[0, 0].item(),
        "is_tensor": isinstance(t, torch.Tensor),
    }
    t[0, 1] = 5.0  # single-element ops only: no intra-op threads in a forked child
    outbox.put(report)
    inbox.get()
    outbox.put(t[1, 0].item())


def _child_big(inbox: Any, outbox: Any) -> None:
    proc = psutil.Process()
    rss_before = proc.memory_info().rss
    x = inbox.get()
    untouched = proc.memory_info().rss - rss_before
    block = x[: 64 * MB // x.itemsize]
    total = float(block.sum())  # now touch 64 MB of it
    touched = proc.memory_info().rss - rss_before
    outbox.put((untouched, touched, total, x.nbytes))


# -- Queue and Process(args) under spawn and fork --------------------------------------


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_spilled_array_crosses_by_path_via_args_and_queue(method: str) -> None:
    ctx = mp.get_context(method)
    x = _spilled()
    x[:4] = [10.0, 11.0, 12.0, 13.0]
    view = x[100:103]  # a view crosses as a view of the same file
    view[:] = [1.0, 2.0, 3.0]
    path = spill.spill_file_of(x).path  # type: ignore[union-attr]
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child_receives, args=(view, inbox, outbox))
    child.start()
    try:
        inbox.put(x)
        report = outbox.get(timeout=TIMEOUT)
        assert report["queue_path"] == path and report["args_path"] == path
        assert report["nbytes"] == x.nbytes
        # Nothing copied: the child has none of the 64 MB mapped, and its RSS barely moved.
        assert report["queue_mapped"] == 0 and report["args_mapped"] == 0
        assert report["rss_growth"] < 8 * MB, report["rss_growth"]
        assert report["head"] == [10.0, 11.0, 12.0, 13.0]
        assert report["args_values"] == [1.0, 2.0, 3.0]
        # The child's writes are in the parent's array...
        assert x[0] == -1.0 and x[102] == -2.0
        # ...and the parent's in the child's.
        x[1] = 77.0
        inbox.put("written")
        assert outbox.get(timeout=TIMEOUT) == 77.0
        child.join(TIMEOUT)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_pool_map_sends_blocks_by_path_and_results_come_back_by_path(method: str) -> None:
    x = _spilled(MB)
    x[:] = 1.0
    blocks = [x[i : i + MB // 4] for i in range(0, MB, MB // 4)]
    path = spill.spill_file_of(x).path  # type: ignore[union-attr]
    with mp.get_context(method).Pool(1 if method == "spawn" else 2) as pool:
        reports = pool.map(_block_report, blocks)
        echoed = pool.apply(_echo, (x[::-1][:10],))
    assert reports == [(MB / 4, 0, path)] * 4
    # A received array goes back by path too: a new mapping of the same file.
    assert file_range(echoed).path == path  # type: ignore[union-attr]
    assert spill.spill_file_of(echoed) is None
    x[-1] = 5.0
    assert echoed[0] == 5.0


def test_a_fork_pool_ends_on_terminate_with_ray_running_in_the_process(ray_runtime: Any) -> None:
    """A forked child inherits its parent's signal handlers: with Ray's SIGTERM handlers
    in the test process, a fork pool's terminate() ran them in its workers, and one hung
    there (the pool's join then waited for the test's timeout). The session's Ray runtime
    leaves SIGTERM as it was, so a worker ends as SIGTERM ends a process."""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    pool = mp.get_context("fork").Pool(2)
    assert pool.map(abs, [-1, -2]) == [1, 2]
    workers = list(pool._pool)  # type: ignore[attr-defined]
    pool.terminate()
    # Ended by the pool's sentinel or by SIGTERM's default action, never by a handler.
    assert {w.exitcode for w in workers} <= {0, -signal.SIGTERM}


def test_memory_array_on_disk_crosses_by_path() -> None:
    with config.set(ram_budget="1MB"):
        x = memory.array((1000, 1000), "float32")
    assert memory.on_disk(x)
    y = _roundtrip(x[10:20, ::3])
    assert file_range(y).path == spill.spill_file_of(x).path  # type: ignore[union-attr]
    assert mapped_bytes(y) == 0
    y[0, 0] = 4.0
    assert x[10, 0] == 4.0
    assert type(_roundtrip(x)) is np.memmap  # a C-contiguous whole array stays a memmap


def test_strided_and_read_only_views_keep_their_layout() -> None:
    x = _spilled(4096)
    x[:] = np.arange(4096)
    grid = x.reshape(64, 64)
    for view in (grid[::-2, 5:9], grid.T[3], grid[10:20:3, ::7]):
        got = _roundtrip(view)
        np.testing.assert_array_equal(got, view)
        assert got.strides == view.strides
        assert file_range(got).path == spill.spill_file_of(x).path  # type: ignore[union-attr]
    frozen = grid[1:3]
    frozen.flags.writeable = False
    got = _roundtrip(frozen)
    assert not got.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        got[0, 0] = 1.0


# -- refusals --------------------------------------------------------------------------


def test_receiver_refuses_a_missing_file() -> None:
    x = _spilled(1000)
    record = spill.spill_file_of(x)
    assert record is not None
    rebuild, args = ForkingPickler._extra_reducers[np.memmap](x[10:20])  # type: ignore[attr-defined]
    spill.discard(record)  # what memory.free does: the file is deleted

    with pytest.raises(
        SpillError,
        match=rf"its file {re.escape(record.path)} no longer exists.*keep the sender's array alive",
    ):
        rebuild(*args)
    assert not os.path.exists(record.path)  # and it was not re-created


def test_receiver_refuses_a_file_too_short() -> None:
    x = _spilled(1000)
    record = spill.spill_file_of(x)
    assert record is not None
    rebuild, args = ForkingPickler._extra_reducers[np.memmap](x[10:20])  # type: ignore[attr-defined]
    spill.discard(record)
    Path(record.path).write_bytes(b"\0" * 100)  # replaced by a shorter file

    with pytest.raises(
        SpillError, match=rf"{re.escape(record.path)} holds 100 bytes .* needs 160 bytes"
    ):
        rebuild(*args)
    assert os.path.getsize(record.path) == 100  # left as it was, not extended
    os.unlink(record.path)


def test_a_child_gets_a_clear_error_when_the_array_was_freed_first() -> None:
    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_child_recv_error, args=(child_end,))
    child.start()
    x = _spilled(1000)
    path = spill.spill_file_of(x).path  # type: ignore[union-attr]
    payload = ForkingPickler.dumps(x)  # pickled while alive...
    spill.discard(spill.spill_file_of(x))  # type: ignore[arg-type]
    parent_end.send_bytes(payload)  # ...received after it was freed
    status, message = parent_end.recv()
    child.join(TIMEOUT)
    assert status == "error"
    assert path in message and "no longer exists" in message


def test_a_received_array_whose_file_is_gone_is_sent_by_value() -> None:
    x = _spilled(1000)
    x[:] = 3.0
    received = _roundtrip(x)
    spill.discard(spill.spill_file_of(x))  # type: ignore[arg-type]
    assert received[5] == 3.0  # the mapping outlives the file's name
    again = _roundtrip(received)
    assert file_range(again) is None and again[5] == 3.0


# -- everything else pickles as before -------------------------------------------------


def test_plain_arrays_and_foreign_memmaps_pickle_by_value(tmp_path: Path) -> None:
    plain = np.arange(1000.0)
    assert bytes(ForkingPickler.dumps(plain)) == pickle.dumps(plain, pickle.DEFAULT_PROTOCOL)
    foreign = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(256,))
    foreign[:] = 2.0
    assert bytes(ForkingPickler.dumps(foreign)) == pickle.dumps(foreign, pickle.DEFAULT_PROTOCOL)
    copy = _roundtrip(foreign[3:9])
    copy[0] = 9.0
    assert foreign[3] == 2.0  # a copy, not a mapping
    assert file_range(_roundtrip(foreign)) is None


def test_arrays_in_the_other_byte_order_keep_it_across_processes() -> None:
    """NumPy's pickle below protocol 5 rebuilds a ``'>i4'`` array as a native one;
    multiprocessing pickles with protocol 4, so the reducer puts the order back."""
    swapped = np.dtype(np.int32).newbyteorder()
    for x in (
        np.array([1, 256, 70000], swapped),
        np.arange(12, dtype=swapped).reshape(3, 4)[:, ::2],
        np.asfortranarray(np.arange(6.0).reshape(2, 3).astype(">f8")),
    ):
        back = _roundtrip(x)
        assert back.dtype == x.dtype and back.flags.writeable
        np.testing.assert_array_equal(back, x)
        plain = pickle.loads(pickle.dumps(sharing.in_byte_order(x), protocol=2))
        assert plain.dtype == x.dtype
        np.testing.assert_array_equal(plain, x)
    native = np.arange(4)
    assert sharing.in_byte_order(native) is native


def test_plain_pickle_of_a_spilled_array_copies() -> None:
    x = _spilled(1000)
    x[:] = 1.0
    copy = pickle.loads(pickle.dumps(x))
    np.testing.assert_array_equal(copy, x)
    x[0] = 2.0
    assert copy[0] == 1.0
    assert sharing.shared_range(x) is not None
    assert len(pickle.dumps(x)) > x.nbytes  # the values, not a path


def test_install_is_idempotent_and_keeps_earlier_reducers() -> None:
    before = {cls: ForkingPickler._extra_reducers[cls] for cls in (np.ndarray, np.memmap)}  # type: ignore[attr-defined]
    sharing.install()
    sharing.install()
    after = {cls: ForkingPickler._extra_reducers[cls] for cls in (np.ndarray, np.memmap)}  # type: ignore[attr-defined]
    assert after == before

    seen: list[object] = []

    def other_library(x: np.ndarray) -> Any:
        seen.append(x)
        return (np.zeros, (3,))

    wrapped = sharing._array_reducer(other_library)
    assert wrapped(np.ones(5)) == (np.zeros, (3,)) and len(seen) == 1
    assert wrapped(_spilled(10))[0] is sharing._rebuild_array and len(seen) == 1


def test_importing_tierflow_does_not_import_torch() -> None:
    code = (
        "import sys, numpy, tierflow; from multiprocessing.reduction import ForkingPickler as P;"
        "print('torch' in sys.modules, getattr(P._extra_reducers[numpy.ndarray], "
        "'_tierflow_reducer', False))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert out.stdout.split() == ["False", "True"], out.stderr


# -- torch -----------------------------------------------------------------------------


@pytest.mark.torch
def test_to_tensor_maps_the_spill_file() -> None:
    torch = pytest.importorskip("torch")
    x = _spilled(6000).reshape(100, 60)[10:, 5:45:2]
    x[:] = 1.5
    t = memory.to_tensor(x)
    path = spill.spill_file_of(x).path  # type: ignore[union-attr]
    assert t.untyped_storage().filename == path
    assert t.dtype == torch.float64 and tuple(t.shape) == x.shape
    assert t.stride() == tuple(s // 8 for s in x.strides)
    t[0, 0] = 8.0
    assert x[0, 0] == 8.0
    x[1, 1] = 9.0
    assert t[1, 1].item() == 9.0
    # The storage keeps the array, hence its spill file, alive.
    del x
    import gc

    gc.collect()
    assert os.path.exists(path)
    assert t.sum().item() == pytest.approx(1.5 * (t.numel() - 2) + 17.0)


@pytest.mark.torch
def test_to_tensor_of_ram_and_refused_views() -> None:
    torch = pytest.importorskip("torch")
    ram = np.arange(6.0)
    t = memory.to_tensor(ram)
    t[0] = 5.0
    assert ram[0] == 5.0 and t.untyped_storage().filename is None
    x = _spilled(64)
    with pytest.raises(ValueError, match="negative strides"):
        memory.to_tensor(x[::-1])
    with pytest.raises(ValueError, match="not whole 8-byte elements"):
        memory.to_tensor(x.view(np.uint8)[4:-4].view(np.float64))
    with pytest.raises(TypeError, match="torch has no dtype"):
        memory.to_tensor(x.view("S8"))
    assert memory.to_tensor(x.view(np.int32)).dtype == torch.int32


@pytest.mark.torch
def test_plain_tensors_still_go_through_torch() -> None:
    torch = pytest.importorskip("torch")
    from torch.multiprocessing import reductions

    memory.to_tensor(_spilled(8))  # installs the tensor reducer
    reducer = ForkingPickler._extra_reducers[torch.Tensor]  # type: ignore[attr-defined]
    assert getattr(reducer, "_tierflow_reducer", False)
    assert reducer(torch.ones(3))[0] is reductions.rebuild_tensor
    t = memory.to_tensor(_spilled(8))
    assert reducer(t)[0] is sharing._rebuild_tensor
    sharing.install()
    assert ForkingPickler._extra_reducers[torch.Tensor] is reducer  # type: ignore[attr-defined]


@pytest.mark.torch
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_spilled_tensor_crosses_by_path(method: str) -> None:
    pytest.importorskip("torch")
    x = _spilled().reshape(-1, 8)
    x[0, 0], x[1, 0] = 3.0, 4.0
    t = memory.to_tensor(x)
    ctx = mp.get_context(method)
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child_tensor, args=(inbox, outbox))
    child.start()
    try:
        inbox.put(t)
        report = outbox.get(timeout=TIMEOUT)
        assert report["filename"] == spill.spill_file_of(x).path  # type: ignore[union-attr]
        assert report["is_tensor"] and report["dtype"] == "torch.float64"
        assert report["shape"] == tuple(t.shape) and report["stride"] == t.stride()
        assert report["first"] == 3.0
        # None of the 64 MB is mapped; RSS grows only by the torch code the child runs
        # for the first time (a forked child faults in library pages as it goes).
        assert report["mapped"] == 0
        assert report["rss_growth"] < 32 * MB, report["rss_growth"]
        assert x[0, 1] == 5.0 and t[0, 1].item() == 5.0
        t[1, 0] = 6.0
        inbox.put("written")
        assert outbox.get(timeout=TIMEOUT) == 6.0
        child.join(TIMEOUT)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()


@pytest.mark.torch
def test_tensor_receiver_refuses_a_short_file() -> None:
    pytest.importorskip("torch")
    x = _spilled(1000)
    record = spill.spill_file_of(x)
    t = memory.to_tensor(x)
    rebuild, args = ForkingPickler._extra_reducers[type(t)](t)  # type: ignore[attr-defined]
    del t
    spill.discard(record)  # type: ignore[arg-type]
    Path(record.path).write_bytes(b"\0" * 8)  # type: ignore[union-attr]
    with pytest.raises(SpillError, match=r"holds 8 bytes .* needs 8000 bytes"):
        rebuild(*args)
    assert os.path.getsize(record.path) == 8  # type: ignore[union-attr]  # not extended
    os.unlink(record.path)  # type: ignore[union-attr]


# -- the figure: 1 GB across a spawn boundary -------------------------------------------


@pytest.mark.slow
def test_a_spawned_child_receives_1gb_without_copying_it() -> None:
    x = spill.map_array((1 << 27,), np.dtype(np.float64))  # 1 GB, fallocated, unwritten
    x[: 64 * MB // 8] = 1.0
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child_big, args=(inbox, outbox))
    child.start()
    try:
        inbox.put(x)
        untouched, touched, total, nbytes = outbox.get(timeout=TIMEOUT)
        child.join(TIMEOUT)
    finally:
        if child.is_alive():
            child.kill()
    assert nbytes == 1 << 30
    assert untouched < 50 * MB, untouched
    assert touched > 60 * MB  # the measurement sees the pages it does touch
    assert total == 64 * MB // 8
