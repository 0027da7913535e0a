"""Golden plans: the full ``describe(plan, tasks=True)`` text of a dozen representative
pipelines, compared with ``golden/plans.txt``.

The text lists each pass's program (its roots and steps) and every task (name,
dependencies, rows, projected bytes), so a change to planning, lowering or fusion that
alters what runs shows here. After a deliberate change, regenerate the file with
``TIERFLOW_REGOLD=1 python -m pytest tests/engine/planning/test_plan.py`` and review its
diff.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.graph.nodes import Chunked, Const
from tierflow.engine.io import cache as cache_module
from tierflow.engine.io.memory import ArraySink
from tierflow.engine.io.npy import NpySink
from tierflow.engine.planning.plan import ConstOutput, Target, TaskOutput, build_plan, describe

GOLDEN = Path(__file__).parent / "golden" / "plans.txt"
BUDGET = 64 << 20
WORKERS = 2


def _plan_text(arrays: list[tw.Array], npy: Path | None = None, cache: object = None) -> str:
    nodes = [a._node for a in arrays]
    if npy is not None:
        assert isinstance(nodes[0], Chunked)
        requests = [Target(nodes[0], NpySink(nodes[0], npy))]
    else:
        requests = [Target(n, ArraySink(n) if isinstance(n, Chunked) else None) for n in nodes]
    session = cache_module.session(cache, nodes)
    try:
        if session is not None:
            session.resolve(nodes)
        plan = build_plan(requests, workers=WORKERS, budget=BUDGET, cache=session)
        for sink in plan.sinks:
            sink.abort()
    finally:
        if session is not None:
            session.finish()
    return describe(plan, tasks=True)


def _double_rows(block: np.ndarray) -> np.ndarray:
    return np.repeat(block, 2, axis=1)


def _load(path: str) -> np.ndarray:
    n = int(os.path.basename(path).split("_")[1].split(".")[0])
    return np.full((n, 3), n, dtype=np.float32)


def _pipelines(tmp: Path) -> dict[str, Callable[[], str]]:
    data = np.arange(4000 * 3, dtype=np.float32).reshape(4000, 3) / 7 - 500
    np.save(tmp / "src.npy", data)
    np.save(tmp / "other.npy", data[:1500] * 2)
    x = tw.from_npy(tmp / "src.npy", rows=1000)
    y = tw.from_npy(tmp / "other.npy", rows=500)
    w = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
    paths = []
    for k, n in enumerate([5, 9, 2, 7]):
        p = tmp / f"f{k}_{n}.bin"
        p.write_bytes(b"")
        paths.append(str(p))
    files = tw.from_files(paths, _load, rows_per_file=None, dtype=np.float32, row_shape=(3,))
    store = tmp / "store"
    return {
        "column sum": lambda: _plan_text([x.sum(axis=0)]),
        "fused reduction": lambda: _plan_text([np.sqrt(x * 2 + 1).sum(axis=0)]),
        "mean and std in one pass": lambda: _plan_text([x.mean(axis=0), x.std(axis=0)]),
        "standardise to npy": lambda: _plan_text(
            [(x - x.mean(axis=0)) / x.std(axis=0)], npy=tmp / "out.npy"
        ),
        "mask to npy": lambda: _plan_text([x[x[:, 0] > 0]], npy=tmp / "masked.npy"),
        "map_blocks compute": lambda: _plan_text([x.map_blocks(_double_rows, row_shape=(6,))]),
        "matmul then sum": lambda: _plan_text([(x @ w).sum(axis=0)]),
        "row slice": lambda: _plan_text([x[10:2500] * 2]),
        "concatenate": lambda: _plan_text([tw.concatenate([x, y]).max(axis=0)]),
        "rows picked out of order": lambda: _plan_text([x[np.array([3999, 5, 2000, 7])] + 1]),
        "cached map_blocks": lambda: _plan_text(
            [x.map_blocks(_double_rows, row_shape=(6,)).cache().mean(axis=0)], cache=store
        ),
        "files of unknown rows": lambda: _plan_text([files.sum(axis=0), files * 3]),
        "var and head": lambda: _plan_text([x.var(axis=0, ddof=1), x.head(1500)]),
    }


def _read_golden() -> dict[str, str]:
    if not GOLDEN.exists():
        return {}
    found: dict[str, str] = {}
    for part in re.split(r"^=== ", GOLDEN.read_text(), flags=re.M)[1:]:
        name, _, body = part.partition("\n")
        found[name.strip()] = body.rstrip("\n")
    return found


def test_golden_plans(tmp_path: Path) -> None:
    texts = {name: make() for name, make in _pipelines(tmp_path).items()}
    if os.environ.get("TIERFLOW_REGOLD"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text("".join(f"=== {k}\n{v}\n" for k, v in texts.items()))
    golden = _read_golden()
    assert set(golden) == set(texts), "golden/plans.txt names other pipelines"
    for name, text in texts.items():
        assert text == golden[name], f"the plan of {name!r} changed"


def test_golden_file_covers_a_dozen_pipelines() -> None:
    golden = _read_golden()
    assert len(golden) >= 12
    assert all(body.count("\n") >= 2 for body in golden.values())


@pytest.mark.parametrize("budget", [BUDGET])
def test_describe_without_tasks_is_one_line(tmp_path: Path, budget: int) -> None:
    np.save(tmp_path / "a.npy", np.ones((100, 2), np.float32))
    x = tw.from_npy(tmp_path / "a.npy", rows=50)
    plan = build_plan([Target(x.sum(axis=0)._node)], workers=WORKERS, budget=budget)
    assert describe(plan) == "3 tasks in 1 stage(s), 1 pass(es): 2 block, 1 finish"


def test_planning_opens_nothing_and_the_compute_opens_the_sinks(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.ones((100, 2), np.float32))
    x = tw.from_npy(tmp_path / "a.npy", rows=50)
    out = tmp_path / "out"
    out.mkdir()
    npy = NpySink((x * 2)._node, out / "y.npy")
    held = ArraySink((x + 1)._node)
    plan = build_plan(
        [Target((x * 2)._node, npy), Target((x + 1)._node, held), Target(x.sum()._node)],
        workers=WORKERS,
        budget=BUDGET,
    )
    assert os.listdir(out) == [] and held.out is None  # nothing created or allocated
    assert isinstance(plan.outputs[2], TaskOutput) and len(plan.kept()) == 3
    plan.open()
    assert len(os.listdir(out)) == 1 and held.out is not None
    plan.abort()
    assert os.listdir(out) == [] and held.out is None


def test_a_constant_target_is_a_constant_output() -> None:
    plan = build_plan([Target(Const(np.float64(3.5)))], workers=WORKERS, budget=BUDGET)
    assert plan.outputs == [ConstOutput(np.float64(3.5))] and plan.tasks == []
    assert plan.results({}) == [3.5]
