"""The staging pool and the lanes of :mod:`tierflow.engine.gpu.transfer`."""

from __future__ import annotations

import numpy as np
import pytest

from tierflow.engine.gpu import transfer
from tierflow.engine.io.memory import ArrayReader
from tierflow.system.devices import FakeGpus, use_provider

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.executors("serial")]  # no compute here


class Event:
    """A copy's event that completes when the test says so (or when waited for)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_staging_reuses_a_buffer_only_after_its_copy_completed() -> None:
    pool = transfer._Staging(torch, False, 2)
    first, e1 = pool.take(1000), Event()
    assert first.numel() >= 1000
    pool.give(first, e1)
    second, e2 = pool.take(1000), Event()
    assert second is not first  # the first one's copy is still running
    pool.give(second, e2)
    third = pool.take(1000)  # both busy, the pool is full: wait for the oldest
    assert third is first and e1.waited and not e2.waited
    pool.give(third, None)
    e2.done = True
    assert pool.take(10) in (first, second)  # completed: free again, no waiting
    assert not e2.waited


def test_a_bigger_block_replaces_a_free_buffer_too_small_for_it() -> None:
    pool = transfer._Staging(torch, False, 1)
    small = pool.take(4096)
    pool.give(small, None)
    big = pool.take(1 << 20)
    assert big is not small and big.numel() >= 1 << 20


def test_staged_rows_are_taken_once_and_a_missed_guess_is_dropped() -> None:
    data = np.arange(40.0).reshape(20, 2)
    reader = ArrayReader(data)
    with use_provider(FakeGpus([(1 << 30, 1 << 30)])):
        transfer.reset_stats()
        lane = transfer.lane("cuda:0")
        assert lane.fake and lane.torch_device == torch.device("cpu")
        lane.stage(1, reader, 10, 20)
        got = lane.ready(lane.take(1, reader, 10, 20))
        np.testing.assert_array_equal(got.numpy(), data[10:20])
        for a in (0, 5, 15):  # three guesses nobody takes: the pool keeps the last two
            lane.stage(9, reader, a, a + 5)
        assert len(lane._staged) == transfer.STAGING_BUFFERS
        lane.upload(0, data[:1])  # copies run in order: this one done, all are
        assert transfer.stats("cuda:0").h2d == 5
        transfer.reset_stats()


def test_a_big_block_is_staged_in_pieces_and_arrives_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transfer, "FILL_PIECE_BYTES", 1000)
    data = np.arange(12_000, dtype=np.int64).reshape(1000, 12)  # 96 kB: 4 pieces
    host = np.zeros_like(data)
    calls: list[int] = []
    real = np.copyto

    def counted(dst: np.ndarray, src: np.ndarray, **kwargs: object) -> None:
        calls.append(len(src))
        real(dst, src, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(transfer.np, "copyto", counted)
    transfer._fill(host, data)
    np.testing.assert_array_equal(host, data)
    assert sorted(calls) == [250, 250, 250, 250]
