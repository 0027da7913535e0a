"""Out-of-memory errors: classification, GPU figures, fit_batch's halving and its advice."""

from __future__ import annotations

import gc
import sys
import types
import weakref
from typing import Any

import pytest
import torch

from tierflow import memory
from tierflow.errors import OutOfMemoryError
from tierflow.storage import oom
from tierflow.storage.oom import CudaFigures, fit_batch, is_cuda_oom, is_oom, parse_cuda_oom
from tierflow.system import limits

GiB = 1 << 30
MiB = 1 << 20

OLD_FORMAT = (
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 15.78 GiB total capacity; "
    "12.34 GiB already allocated; 1.23 GiB free; 13.45 GiB reserved in total by PyTorch) "
    "If reserved memory is >> allocated memory try setting max_split_size_mb"
)
NEW_FORMAT = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
    "79.15 GiB of which 1.20 GiB is free. Process 4242 has 3.50 GiB memory in use. "
    "Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the "
    "allocated memory 75.33 GiB is allocated by PyTorch, and 1.61 GiB is reserved by "
    "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)


class FakeCupyOOM(MemoryError):
    """Stands in for cupy.cuda.memory.OutOfMemoryError (matched by name and module)."""


FakeCupyOOM.__name__ = FakeCupyOOM.__qualname__ = "OutOfMemoryError"
FakeCupyOOM.__module__ = "cupy.cuda.memory"


class FakeCupyBackendOOM(RuntimeError):
    pass


FakeCupyBackendOOM.__name__ = "OutOfMemoryError"
FakeCupyBackendOOM.__module__ = "cupy_backends.cuda.api.runtime"


@pytest.fixture(autouse=True)
def _forget_sizes() -> None:
    fit_batch.forget()


# -- classification ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        MemoryError(),
        OutOfMemoryError("ours"),
        torch.cuda.OutOfMemoryError("CUDA out of memory."),
        RuntimeError(OLD_FORMAT),
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported"),
        FakeCupyOOM("Out of memory allocating 1,024 bytes"),
        FakeCupyBackendOOM("out of memory"),
    ],
)
def test_out_of_memory_errors_are_recognised(exc: BaseException) -> None:
    assert is_oom(exc)


@pytest.mark.parametrize(
    "exc",
    [RuntimeError("shape mismatch"), ValueError("CUDA out of memory"), KeyError("x"), OSError()],
)
def test_other_errors_are_not(exc: BaseException) -> None:
    assert not is_oom(exc)


def test_cuda_or_ram() -> None:
    assert is_cuda_oom(torch.cuda.OutOfMemoryError("x"))
    assert is_cuda_oom(FakeCupyOOM("x"))
    assert not is_cuda_oom(MemoryError())


# -- figures ----------------------------------------------------------------------------


def test_parse_old_format() -> None:
    f = parse_cuda_oom(OLD_FORMAT)
    assert f is not None
    assert (f.device, f.requested, f.source) == (1, 2 * GiB, "message")
    assert f.total == int(15.78 * GiB)
    assert f.allocated == int(12.34 * GiB)
    assert f.free == int(1.23 * GiB)
    assert f.reserved == int(13.45 * GiB)


def test_parse_new_format() -> None:
    f = parse_cuda_oom(NEW_FORMAT)
    assert f is not None
    assert (f.device, f.requested) == (0, 20 * MiB)
    assert f.total == int(79.15 * GiB) and f.free == int(1.20 * GiB)
    assert f.allocated == int(75.33 * GiB)
    assert f.reserved == int(75.33 * GiB) + int(1.61 * GiB)
    assert f.unallocated == int(1.61 * GiB)
    assert f.processes == ((4242, int(3.5 * GiB)),)


def test_parse_small_units_and_cupy() -> None:
    f = parse_cuda_oom(
        "Tried to allocate 512.00 KiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB already "
        "allocated; 0 bytes free; 188.00 MiB reserved in total by PyTorch)"
    )
    assert f is not None and f.requested == 512 * 1024 and f.free == 0
    c = parse_cuda_oom("Out of memory allocating 1,024 bytes (allocated so far: 4,096 bytes).")
    assert c is not None and (c.requested, c.allocated) == (1024, 4096)
    assert parse_cuda_oom("CUDA out of memory.") is None


def test_live_torch_figures_fill_the_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (1 * GiB, 16 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 10 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 12 * GiB)
    f = oom.cuda_figures(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert f == CudaFigures(0, None, 16 * GiB, 1 * GiB, 10 * GiB, 12 * GiB, (), "torch")
    assert f.outside == 3 * GiB
    # message figures win (taken at the failure), live ones fill in what is missing
    g = oom.cuda_figures(torch.cuda.OutOfMemoryError("Tried to allocate 4.00 GiB. GPU 0 x"))
    assert g is not None and g.requested == 4 * GiB and g.total == 16 * GiB
    assert g.source == "message+torch"


def test_no_figures_without_cuda() -> None:
    assert not torch.cuda.is_initialized()
    assert oom.cuda_figures(torch.cuda.OutOfMemoryError("CUDA out of memory.")) is None
    assert "No GPU memory figures were available" in oom.explain_cuda_oom(MemoryError())


def test_cupy_figures_from_its_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = types.SimpleNamespace(used_bytes=lambda: 2 * GiB, total_bytes=lambda: 3 * GiB)
    runtime = types.SimpleNamespace(memGetInfo=lambda: (1 * GiB, 8 * GiB), getDevice=lambda: 2)
    fake = types.SimpleNamespace(
        get_default_memory_pool=lambda: pool, cuda=types.SimpleNamespace(runtime=runtime)
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    f = oom.cuda_figures(FakeCupyOOM("Out of memory allocating 1,024 bytes"))
    assert f is not None
    assert (f.device, f.requested, f.total, f.free, f.allocated, f.reserved) == (
        2,
        1024,
        8 * GiB,
        1 * GiB,
        2 * GiB,
        3 * GiB,
    )


# -- explanations -----------------------------------------------------------------------


def figures(**kw: Any) -> CudaFigures:
    base: dict[str, Any] = dict(
        device=0, requested=1 * GiB, total=80 * GiB, free=0, allocated=70 * GiB
    )
    base.update(kw)
    return CudaFigures(**base)


def test_explain_fragmentation() -> None:
    text = oom.explain_cuda_oom(MemoryError(), figures(reserved=79 * GiB, free=int(0.5 * GiB)))
    assert "GPU 0: 80.00 GB total, 512.00 MB free, 70.00 GB allocated" in text
    assert "79.00 GB reserved" in text
    assert "Looks like fragmentation: 9.00 GB is reserved but unallocated" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text
    assert "outside" not in text


def test_explain_memory_outside_pytorch() -> None:
    text = oom.explain_cuda_oom(MemoryError(), figures(reserved=70 * GiB, free=0))
    assert "10.00 GB of the device is used outside this allocator" in text
    assert "another process" in text and "cuBLAS" in text
    assert "fragmentation" not in text


def test_explain_too_big() -> None:
    text = oom.explain_cuda_oom(MemoryError(), figures(reserved=int(70.5 * GiB), free=9 * GiB))
    assert "simply does not fit" in text and "smaller min_batch" in text
    huge = oom.explain_cuda_oom(MemoryError(), figures(requested=100 * GiB, reserved=70 * GiB))
    assert "Too big for the device: one request of 100.00 GB exceeds its 80.00 GB" in huge


def test_explain_the_new_message_as_fragmentation() -> None:
    text = oom.explain_oom(torch.cuda.OutOfMemoryError(NEW_FORMAT))
    assert "Looks like fragmentation: 1.61 GB" in text
    assert "The failed request was 20.00 MB" in text
    assert "pid 4242: 3.50 GB" in text


def test_explain_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        limits,
        "read_memory",
        lambda root=None: limits.MemoryFigures(
            usable=4 * GiB,
            free=256 * MiB,
            source="cgroup v1",
            cgroup_dir=None,
            host_total=32 * GiB,
            limited_by="/job",
        ),
    )
    text = oom.explain_oom(MemoryError())
    assert "RAM: 4.00 GB usable (limited by cgroup v1 /job), 256.00 MB free now" in text


# -- fit_batch --------------------------------------------------------------------------


def fails_above(limit: int, error: type[BaseException] = MemoryError) -> Any:
    calls: list[int] = []

    def fn(n: int) -> str:
        calls.append(n)
        if n > limit:
            raise error("CUDA out of memory. Tried to allocate 1.00 GiB")
        return f"ran {n}"

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


@pytest.mark.parametrize("error", [MemoryError, torch.cuda.OutOfMemoryError])
def test_halves_until_it_fits(error: type[BaseException]) -> None:
    fn = fails_above(100, error)
    assert memory.fit_batch(fn, 1000) == ("ran 62", 62)
    assert fn.calls == [1000, 500, 250, 125, 62]
    assert fit_batch.remembered(fn) == 62


def test_the_last_try_is_min_batch() -> None:
    fn = fails_above(30)
    assert fit_batch(fn, 100, min_batch=30) == ("ran 30", 30)
    assert fn.calls == [100, 50, 30]


def test_a_size_that_fits_at_once_is_not_remembered() -> None:
    fn = fails_above(10**6)
    assert fit_batch(fn, 512) == ("ran 512", 512)
    assert fit_batch.remembered(fn) is None


def test_the_next_call_starts_at_the_remembered_size() -> None:
    fn = fails_above(100)
    fit_batch(fn, 1000)
    fn.calls.clear()
    assert fit_batch(fn, 1000) == ("ran 62", 62)
    assert fn.calls == [62]
    assert fit_batch(fn, 40) == ("ran 40", 40)  # min(batch, remembered)
    fn.calls.clear()
    assert fit_batch(fn, 1000, remember=False)[1] == 62
    assert fn.calls == [1000, 500, 250, 125, 62]
    fit_batch.forget(fn)
    assert fit_batch.remembered(fn) is None


def test_remembered_below_min_batch_starts_at_min_batch() -> None:
    fn = fails_above(100)
    fit_batch(fn, 1000)  # remembers 62
    fn.calls.clear()
    assert fit_batch(fn, 1000, min_batch=80) == ("ran 80", 80)
    assert fn.calls == [80]


def test_lambdas_made_by_the_same_line_share_what_was_learned() -> None:
    limit = 50
    seen: list[int] = []

    def attempt(n: int) -> int:
        seen.append(n)
        if n > limit:
            raise MemoryError
        return n

    def run() -> int:
        return fit_batch(lambda n: attempt(n), 400)[1]  # a new lambda on every call

    assert run() == 50 and seen == [400, 200, 100, 50]
    seen.clear()
    assert run() == 50 and seen == [50]


def test_always_failing_explains_with_cuda_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        oom,
        "cuda_figures",
        lambda exc: CudaFigures(
            device=0,
            requested=2 * GiB,
            total=24 * GiB,
            free=256 * MiB,
            allocated=12 * GiB,
            reserved=23 * GiB,
        ),
    )

    def fn(n: int) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(OutOfMemoryError) as info:
        fit_batch(fn, 8, min_batch=2)
    text = str(info.value)
    assert text.startswith(
        "fit_batch: fn ran out of GPU memory at every batch size tried (8, 4, 2; "
        "min_batch=2); last error OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "2.00 GiB. GPU 0: 24.00 GB total"
    )
    assert "GPU 0: 24.00 GB total, 256.00 MB free, 12.00 GB allocated" in text
    assert "23.00 GB reserved" in text
    assert "Looks like fragmentation: 11.00 GB" in text
    assert "expandable_segments:True" in text
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)
    assert isinstance(info.value, MemoryError)


def test_always_failing_in_ram_gives_the_ram_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        limits,
        "read_memory",
        lambda root=None: limits.MemoryFigures(
            usable=2 * GiB, free=100 * MiB, source="host", cgroup_dir=None, host_total=2 * GiB
        ),
    )
    with pytest.raises(
        OutOfMemoryError,
        match=r"fit_batch: <lambda> ran out of memory at every batch size tried \(4, 2, 1; "
        r"min_batch=1\); last error MemoryError\. RAM: 2\.00 GB usable \(limited by host\), "
        r"100\.00 MB free now\. Use a smaller min_batch",
    ):
        fit_batch(lambda n: (_ for _ in ()).throw(MemoryError()), 4)


def test_other_errors_are_raised_at_once() -> None:
    calls: list[int] = []
    error = ValueError("bad input")

    def fn(n: int) -> None:
        calls.append(n)
        raise error

    with pytest.raises(ValueError) as info:
        fit_batch(fn, 64)
    assert info.value is error and calls == [64]


def test_the_failed_attempt_is_freed_before_the_retry() -> None:
    class Big:
        pass

    refs: list[weakref.ref[Big]] = []
    alive_at_retry: list[bool] = []

    def fn(n: int) -> int:
        if refs:
            alive_at_retry.append(refs[-1]() is not None)
        big = Big()  # held by this frame when the error is raised
        refs.append(weakref.ref(big))
        if n > 1:
            raise MemoryError
        return n

    assert fit_batch(fn, 4) == (1, 1)
    assert alive_at_retry == [False, False]
    gc.collect()


def test_gpu_caches_are_emptied_only_when_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    emptied: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append("torch"))
    oom.empty_gpu_caches()
    assert emptied == []  # CUDA not initialised: no context is created for nothing
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    pool = types.SimpleNamespace(free_all_blocks=lambda: emptied.append("cupy"))
    pinned = types.SimpleNamespace(free_all_blocks=lambda: emptied.append("pinned"))
    fake = types.SimpleNamespace(
        get_default_memory_pool=lambda: pool, get_default_pinned_memory_pool=lambda: pinned
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    fit_batch(fails_above(1), 2)
    assert emptied == ["torch", "cupy", "pinned"]


def test_bad_sizes() -> None:
    fn = fails_above(10)
    with pytest.raises(ValueError, match=r"min_batch=8 is larger than batch=4"):
        fit_batch(fn, 4, min_batch=8)
    with pytest.raises(ValueError, match=r"batch must be at least 1, got 0"):
        fit_batch(fn, 0)
    with pytest.raises(TypeError, match=r"batch must be an integer, got 2\.5"):
        fit_batch(fn, 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"min_batch must be at least 1, got 0"):
        fit_batch(fn, 4, min_batch=0)
    assert fn.calls == []


# -- recover: the one recovery sequence ---------------------------------------------------


def _never_give_up(figures: CudaFigures | None) -> OutOfMemoryError:
    raise AssertionError("gave up on an attempt that was not the last")


def test_recover_leaves_other_errors_and_our_own_verdict_to_the_caller() -> None:
    assert oom.recover(ValueError("bad"), last=False, give_up=_never_give_up) is False
    verdict = OutOfMemoryError("already tried down to one row")
    assert oom.recover(verdict, last=True, give_up=_never_give_up) is False


def test_recover_reads_figures_then_frees_then_empties_the_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps: list[str] = []
    figures = CudaFigures(device=0, total=8 * GiB, free=0)
    monkeypatch.setattr(oom, "cuda_figures", lambda exc: steps.append("figures") or figures)
    monkeypatch.setattr(oom, "empty_gpu_caches", lambda: steps.append("empty"))

    class Big:
        pass

    ref: list[weakref.ref[Big]] = []

    def attempt() -> None:
        big = Big()  # held by this frame when the error is raised
        ref.append(weakref.ref(big))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    try:
        attempt()
    except Exception as exc:
        assert oom.recover(exc, last=False, give_up=_never_give_up) is True
        steps.append("freed" if ref[0]() is None else "still held")
    assert steps == ["figures", "empty", "freed"]

    given: list[CudaFigures | None] = []

    def give_up(f: CudaFigures | None) -> OutOfMemoryError:
        given.append(f)
        return OutOfMemoryError("gave up")

    error = torch.cuda.OutOfMemoryError("CUDA out of memory.")
    with pytest.raises(OutOfMemoryError, match="gave up") as info:
        oom.recover(error, last=True, give_up=give_up)
    assert given == [figures] and info.value.__cause__ is error


def test_a_nested_verdict_is_not_retried_by_fit_batch() -> None:
    calls: list[int] = []

    def fn(n: int) -> None:
        calls.append(n)
        raise OutOfMemoryError("inner fit_batch gave up")

    with pytest.raises(OutOfMemoryError, match="inner fit_batch gave up"):
        fit_batch(fn, 64)
    assert calls == [64]
