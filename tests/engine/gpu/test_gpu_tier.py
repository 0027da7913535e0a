"""The GPU tier in the scheduler, on simulated GPUs: admission against each GPU's budget,
its slots, spreading over several GPUs, and the task that can never fit.

Simulated GPUs (``FakeGpus``) hold torch CPU tensors, accounted as ``cuda:N``. Each
function below holds its seat until as many tasks run as the test allows plus one, or
half a second has passed: tasks then pile up to whatever admission lets through, and
the most seen at once is what admission allowed.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow import config
from tierflow.engine.gpu import tier
from tierflow.errors import OutOfMemoryError
from tierflow.system import device_budget
from tierflow.system.devices import FakeGpus, use_provider

torch = pytest.importorskip("torch")

# Device tasks are seated in this process; worker processes see their own GPUs.
pytestmark = pytest.mark.executors("threads")

ROWS, COLS = 100, 64
# A task's projected GPU bytes (Program.device_bytes): the float32 block copied in twice
# (the next block's copy waits beside it) and the function's result three times (its
# output, a halving output, and one block for the function's own tensors).
BLOCK = ROWS * COLS * 4
TASK = 2 * BLOCK + 3 * BLOCK
HOLD = 0.5  # seconds a task waits for more company at most


@pytest.fixture(autouse=True)
def _seats_given_back() -> Iterator[None]:
    """Every compute gives back its GPU seats, whether it finished or failed."""
    device_budget.ledger.reset_peak()
    with config.set(gpu_margin=0):
        yield
    for device in ("cuda:0", "cuda:1"):
        assert device_budget.ledger.admitted(device) == 0, device
        assert device_budget.ledger.running(device) == 0, device


def gpus(*tasks_that_fit: float) -> FakeGpus:
    """Fake GPUs whose budgets (margin 0) fit that many tasks; a third of each is free."""
    return FakeGpus([(int(n * TASK), int(3 * n * TASK)) for n in tasks_that_fit])


class Watch:
    """A torch function that records where it ran and how many ran at once."""

    def __init__(self, company: int) -> None:
        self.company = company  # hold seats until this many run together
        self.lock = threading.Lock()
        self.now: Counter[str | None] = Counter()
        self.most: Counter[str | None] = Counter()
        self.blocks: Counter[str | None] = Counter()
        self.slots: set[tuple[str | None, int | None]] = set()
        self.tensors: set[str] = set()
        self.together = threading.Event()

    def __call__(self, t: Any) -> Any:
        device = tier.current_device()
        with self.lock:
            self.now[device] += 1
            self.most[device] = max(self.most[device], self.now[device])
            self.blocks[device] += 1
            self.slots.add((device, tier.current_slot()))
            self.tensors.add(t.device.type)
            if sum(self.now.values()) >= self.company:
                self.together.set()
        self.together.wait(HOLD)
        with self.lock:
            self.now[device] -= 1
        return t * 2


def run(watch: Watch, blocks: int, workers: int, device: str = "cuda") -> np.ndarray:
    a = np.arange(blocks * ROWS * COLS, dtype=np.float32).reshape(-1, COLS)
    y = tw.from_array(a, rows=ROWS).map_blocks(
        watch, device=device, dtype=np.float32, row_shape=(COLS,)
    )
    (got,) = tw.compute(y, workers=workers, progress=False)
    np.testing.assert_array_equal(got, a * 2)
    return np.asarray(got)


def test_the_function_gets_cpu_tensors_accounted_as_the_gpu_it_was_seated_on() -> None:
    watch = Watch(company=1)
    with use_provider(gpus(100)):
        run(watch, blocks=4, workers=2)
    assert watch.tensors == {"cpu"}
    assert set(watch.blocks) == {"cuda:0"}
    assert sum(watch.blocks.values()) == 4


def test_tasks_wait_while_the_gpu_budget_is_full() -> None:
    watch = Watch(company=3)
    with use_provider(gpus(2.5)), config.set(gpu_slots=8):
        run(watch, blocks=8, workers=4)
    budget = int(2.5 * TASK)
    assert watch.most["cuda:0"] == 2  # 4 workers, 8 slots: the budget held back the rest
    assert 2 * TASK <= device_budget.ledger.peak("cuda:0") <= budget


def test_slots_limit_the_tasks_running_on_one_gpu() -> None:
    for slots in (1, 2):
        watch = Watch(company=slots + 1)
        with use_provider(gpus(100)), config.set(gpu_slots=slots):
            run(watch, blocks=3 * slots, workers=4)
        assert watch.most["cuda:0"] == slots
        assert watch.slots == {("cuda:0", s) for s in range(slots)}


def test_blocks_spread_over_two_gpus_by_free_memory_and_never_over_a_budget() -> None:
    watch = Watch(company=7)
    with use_provider(gpus(2.5, 4.5)), config.set(gpu_slots=8):
        run(watch, blocks=24, workers=6)
    assert (watch.most["cuda:0"], watch.most["cuda:1"]) == (2, 4)
    assert watch.blocks["cuda:1"] > watch.blocks["cuda:0"] > 0
    assert sum(watch.blocks.values()) == 24
    assert device_budget.ledger.peak("cuda:0") <= int(2.5 * TASK)
    assert device_budget.ledger.peak("cuda:1") <= int(4.5 * TASK)


def test_each_task_goes_to_the_gpu_with_the_most_room() -> None:
    watch = Watch(company=1)
    # Even with all 4 blocks seated at once, cuda:1 has more room left than cuda:0.
    with use_provider(gpus(1.5, 10)), config.set(gpu_slots=8):
        run(watch, blocks=4, workers=1)
    assert watch.blocks == Counter({"cuda:1": 4})


def test_a_named_gpu_takes_every_block() -> None:
    watch = Watch(company=1)
    with use_provider(gpus(100, 200)):
        run(watch, blocks=4, workers=2, device="cuda:0")
    assert set(watch.blocks) == {"cuda:0"}


def test_a_full_gpu_at_high_pressure_runs_one_task_at_a_time() -> None:
    watch = Watch(company=2)
    # 6 % free: high. Admission takes one task while the GPU holds none, never two.
    with use_provider(FakeGpus([(100 * TASK, int(100 * TASK / 0.06))])):
        run(watch, blocks=3, workers=4)
    assert watch.most["cuda:0"] == 1


def test_a_task_bigger_than_the_whole_gpu_budget_is_refused_before_anything_runs() -> None:
    watch = Watch(company=1)
    with (
        use_provider(gpus(0.5, 0.8)),
        pytest.raises(
            OutOfMemoryError,
            match=rf"needs {TASK / 1024:.3f} KB on the GPU .*more than the whole budget of "
            rf"cuda:1 \(the largest of the GPUs here\): {0.8 * TASK / 1024:.3f} KB .*smaller "
            r"\(rows=\).*another device",
        ),
    ):
        run(watch, blocks=3, workers=2)
    assert sum(watch.blocks.values()) == 0


def test_a_named_gpu_that_is_too_small_is_named() -> None:
    watch = Watch(company=1)
    with (
        use_provider(gpus(100, 0.5)),
        pytest.raises(OutOfMemoryError, match=r"more than the whole budget of cuda:1: "),
    ):
        run(watch, blocks=2, workers=2, device="cuda:1")
    assert sum(watch.blocks.values()) == 0


def test_auto_runs_on_the_cpu_when_a_task_fits_no_gpu_budget() -> None:
    watch = Watch(company=1)
    with use_provider(gpus(0.5)):
        run(watch, blocks=2, workers=2, device="auto")
    assert set(watch.blocks) == {None}
    watch = Watch(company=1)
    with use_provider(gpus(2)):
        run(watch, blocks=2, workers=2, device="auto")
    assert set(watch.blocks) == {"cuda:0"}


def test_a_gpu_gone_by_the_time_the_compute_runs_is_named() -> None:
    a = np.ones((2 * ROWS, COLS), np.float32)
    with use_provider(gpus(100, 100)):
        y = tw.from_array(a, rows=ROWS).map_blocks(
            lambda t: t, device="cuda:1", dtype=np.float32, row_shape=(COLS,)
        )
    with (
        use_provider(gpus(100)),
        pytest.raises(ValueError, match=r"'cuda:1': no such GPU \(GPUs here: cuda:0\)"),
    ):
        y.compute(progress=False)


def test_a_failing_device_task_gives_its_seat_back() -> None:
    def fails(t: Any) -> Any:
        raise ValueError("bad block")

    a = np.ones((4 * ROWS, COLS), np.float32)
    with use_provider(gpus(100)):
        y = tw.from_array(a, rows=ROWS).map_blocks(
            fails, device="cuda", dtype=np.float32, row_shape=(COLS,)
        )
        with pytest.raises(Exception, match="bad block"):
            y.compute(progress=False)
    # _seats_given_back checks the ledger.


def test_a_compute_inside_a_device_task_runs_though_its_caller_holds_the_only_slot() -> None:
    inner = np.ones((2 * ROWS, COLS), np.float32)

    def outer(t: Any) -> Any:
        y = tw.from_array(inner, rows=ROWS).map_blocks(
            lambda u: u + 1, device="cuda", dtype=np.float32, row_shape=(COLS,)
        )
        return t + float(y.compute(progress=False).sum())

    a = np.zeros((2 * ROWS, COLS), np.float32)
    with use_provider(gpus(100)), config.set(gpu_slots=1):
        got = (
            tw.from_array(a, rows=ROWS)
            .map_blocks(outer, device="cuda", dtype=np.float32, row_shape=(COLS,))
            .compute(progress=False)
        )
    assert np.all(got == 2.0 * inner.size)


def test_the_plan_gives_block_tasks_their_device_and_gpu_bytes() -> None:
    from tierflow.engine.io.memory import ArraySink
    from tierflow.engine.planning.plan import Target, build_plan, describe

    a = np.ones((2 * ROWS, COLS), np.float32)
    with use_provider(gpus(100)):
        y = tw.from_array(a, rows=ROWS).map_blocks(
            lambda t: t, device="cuda", dtype=np.float32, row_shape=(COLS,)
        )
        node = y._node
        plan = build_plan([Target(node, ArraySink(node))], workers=2, budget=1 << 30)
    blocks = [t for t in plan.tasks if t.block]
    assert [(t.device, t.device_bytes) for t in blocks] == [("cuda", TASK)] * 2
    assert f"device=cuda/{TASK}" in describe(plan, tasks=True)
    assert not any(t.device for t in plan.tasks if not t.block)


def test_a_probed_function_gets_tensors_on_a_simulated_gpu() -> None:
    kinds: set[str] = set()

    def double(t: Any) -> Any:
        kinds.add(t.device.type)
        return t * 2

    a = np.ones((2 * ROWS, COLS), np.float32)
    with use_provider(gpus(100)):
        y = tw.from_array(a, rows=ROWS).map_blocks(double, device="cuda")  # probes
        np.testing.assert_array_equal(y.compute(progress=False), a * 2)
    assert kinds == {"cpu"}


def test_running_on_sets_the_device_for_the_block_only() -> None:
    assert tier.current_device() is None
    with tier.running_on("cuda:1"):
        assert tier.current_device() == "cuda:1"
    assert tier.current_device() is None


@pytest.mark.gpu
def test_each_slot_runs_on_its_own_cuda_stream() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    streams: set[tuple[int | None, Any]] = set()

    def where(t: Any) -> Any:
        device, slot = tier.current_device(), tier.current_slot()
        assert device is not None and slot is not None
        assert torch.cuda.current_stream(t.device) == tier.slot_stream(device, slot)
        streams.add((slot, torch.cuda.current_stream(t.device)))
        return t * 2

    a = np.ones((8 * ROWS, COLS), np.float32)
    y = tw.from_array(a, rows=ROWS).map_blocks(
        where, device="cuda", dtype=np.float32, row_shape=(COLS,)
    )
    np.testing.assert_array_equal(y.compute(progress=False), a * 2)
    assert streams


def test_blocks_persisted_on_the_gpu_take_room_and_make_way_for_device_tasks() -> None:
    # The budget fits 2.5 tasks, and persisted blocks leave less than one task's room:
    # the array's blocks and a block of two tasks' worth.
    with use_provider(gpus(2.5)), config.set(gpu_slots=8):
        kept = tw.from_array(np.ones((4 * ROWS, COLS // 2), np.float32), rows=ROWS)
        kept = kept.persist(device="cuda:0")
        store = kept._node.reader.store
        store.put("big", np.ones(TASK // 2, np.float32))
        assert store.held() == 2 * TASK + 4 * ROWS * (COLS // 2) * 4  # no room for a task
        watch = Watch(company=3)
        run(watch, blocks=6, workers=4)
        # The tasks ran within the budget, and the largest persisted block was spilled
        # to the host to make way for them.
        assert watch.most["cuda:0"] >= 1
        # Off the GPU: to RAM, or on to the SSD when the machine's RAM is under pressure.
        assert store.spilled >= 1 and store.where("big") in ("ram", "ssd")
        assert device_budget.ledger.peak("cuda:0") <= int(2.5 * TASK)
        np.testing.assert_array_equal(kept.compute(), np.ones((4 * ROWS, COLS // 2)))


def test_a_gpu_under_pressure_has_its_persisted_blocks_spilled_before_tasks_run() -> None:
    provider = gpus(10)
    with config.set(gpu_slots=8), use_provider(provider):
        kept = tw.from_array(np.ones((4 * ROWS, COLS), np.float32), rows=ROWS)
        kept = kept.persist(device="cuda:0")
        store = kept._node.reader.store
        assert store.held() == 4 * BLOCK
        # Another process takes most of the GPU: 1 % of it is free now (critical).
        total = provider._memory[0][1]
        provider._memory = [(total // 100, total)]
        device_budget._levels_at = -1e18  # the level is read again at the next task
        run(Watch(company=1), blocks=2, workers=2)
        assert store.held() == 0 and store.spilled == 4
        np.testing.assert_array_equal(kept.compute(), np.ones((4 * ROWS, COLS)))
