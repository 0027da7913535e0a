"""Building a pipeline computes nothing: no task, no block read, no user function call."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.runtime.executors import ComputeForbidden
from tierflow.storage.sources import FileSource


@pytest.fixture
def no_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    seen: list[str] = []

    def refuse(self: FileSource, *args: object, **kwargs: object) -> np.ndarray:
        seen.append(self.path)
        raise AssertionError(f"a block of {self.path} was read while building")

    monkeypatch.setattr(FileSource, "block", refuse)
    yield seen


def test_building_every_kind_of_pipeline_computes_nothing(
    tmp_path: Path, no_reads: list[str]
) -> None:
    np.save(tmp_path / "x.npy", np.ones((100, 4), np.float32))
    calls: list[str] = []

    def f(b: np.ndarray) -> np.ndarray:
        calls.append("map")
        return b[:, :2]

    def keep(b: np.ndarray) -> np.ndarray:
        calls.append("filter")
        return b[:, 0] > 0

    with tw.use_executor("raise"):
        x = tw.from_npy(tmp_path / "x.npy", rows=16)
        y = np.sqrt(x * 2 + 1) - x.mean(axis=0)
        pipelines = [
            y,
            y.sum(axis=0),
            tw.where(y > 0, y, -y).astype(np.float64).round(2).clip(0, 3),
            x[x[:, 0] > 0][:, [0, 2]],
            x[5:90:3],
            x.head(3),
            x.filter(keep).head(2),
            tw.concatenate([x, y]),
            x.map_blocks(f, dtype=np.float32, row_shape=(2,)),
            x @ np.ones((4, 2)),
            np.histogram(x, bins=4, range=(0, 2))[0],
            x.reduction(lambda b: len(b), lambda p, q: p + q),
            (x.std(axis=0) / x.var()).max(),
            x[3],
            np.cumsum(y, axis=1),
            np.sort(x, axis=-1)[:, :2],
        ]
        for p in pipelines:
            assert isinstance(p, tw.Array)
            repr(p)
            assert len(p.key) == 32
        with pytest.raises(ComputeForbidden, match="building a pipeline must not run it"):
            y.sum().compute()
    assert calls == [] and no_reads == []


def test_keys_and_repr_of_from_files_need_no_load_when_described(tmp_path: Path) -> None:
    calls: list[str] = []

    def load(path: str) -> np.ndarray:
        calls.append(path)
        return np.zeros(3)

    x = tw.from_files(
        [str(tmp_path / f"{i}") for i in range(5)], load, dtype="float64", row_shape=(3,)
    )
    repr(x + 1)
    assert calls == []
