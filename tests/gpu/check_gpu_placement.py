"""Check memory.array's GPU placement through torch on a real CUDA machine.

Run it on a machine with a GPU and torch built for CUDA::

    python tests/gpu/check_gpu_placement.py

Prints one PASS/FAIL line per check and exits 1 if any failed; prints SKIP and exits 0
where torch sees no CUDA device. Not collected by pytest (no ``test_`` prefix): the
suite's GPU placement tests run everywhere with simulated GPUs
(``tests/storage/test_gpu_placement.py``); this script covers the real torch path.
Spill files go to a temporary folder, never to ~/.tierflow.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import check, results

GB = 1 << 30
MB = 1 << 20


def _allocation_checks(torch: Any, found: list[Any]) -> list[Callable[[], None]]:
    """Tensors on the GPUs: where they go, their dtypes, and their memory given back."""
    from tierflow import memory

    @check("devices.gpus() lists the CUDA devices through torch")
    def _gpus() -> None:
        assert len(found) == torch.cuda.device_count(), found
        assert all(d.backend == "torch" for d in found), found
        print("     ", "; ".join(str(d) for d in found))

    @check("device='auto' gives a zero-filled torch tensor on a GPU")
    def _auto() -> None:
        x = memory.array((1000, 1000), "float32", device="auto")
        assert isinstance(x, torch.Tensor), type(x)
        assert x.is_cuda and x.dtype == torch.float32 and tuple(x.shape) == (1000, 1000)
        assert float(x.abs().sum()) == 0.0
        best = max(found, key=lambda d: (d.free, -d.index))
        assert x.device.index == best.index, (x.device, best)
        assert str(memory.report()[-1]).endswith(f"3.815 MB cuda:{best.index}")

    @check("device='cuda:0' with several dtypes")
    def _explicit() -> None:
        for dtype, expected in (
            ("float64", torch.float64),
            ("int64", torch.int64),
            ("uint8", torch.uint8),
            ("bool", torch.bool),
            ("float16", torch.float16),
            ("complex64", torch.complex64),
        ):
            x = memory.array((17, 3), dtype, device="cuda:0")
            assert isinstance(x, torch.Tensor) and x.device == torch.device("cuda:0"), x.device
            assert x.dtype == expected, (dtype, x.dtype)

    @check("a 2 GB tensor, then free() and collection give it back")
    def _big_and_free() -> None:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(0)
        x = memory.array((2 * GB // 4,), "float32", device="cuda:0")
        assert torch.cuda.memory_allocated(0) - before >= 2 * GB
        x += 1
        assert float(x[-1]) == 1.0
        count = len(memory.report())
        memory.free(x[5:])
        assert len(memory.report()) == count - 1
        assert float(x[-1]) == 1.0  # free leaves the tensor valid until it is dropped
        del x
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated(0) - before < MB

    return [_gpus, _auto, _explicit, _big_and_free]


def _fallback_checks(torch: Any, found: list[Any]) -> list[Callable[[], None]]:
    """Arrays that cannot go to a GPU: to the host, or a clear error."""
    import numpy as np

    from tierflow import memory
    from tierflow.storage import placement
    from tierflow.system import devices

    @check("a collected GPU tensor leaves the report")
    def _collected() -> None:
        count = len(memory.report())
        x = memory.array(1000, device="auto")
        assert len(memory.report()) == count + 1
        del x
        gc.collect()
        assert len(memory.report()) == count

    @check("an array that does not fit the free memory less the margin goes to the host")
    def _too_big() -> None:
        real = devices.gpus()

        class Crowded:
            """The real GPUs, as if another process held all but 2 GB of each."""

            def gpus(self) -> list[devices.Device]:
                return [
                    devices.Device(
                        d.kind, d.index, d.name, min(d.free, 2 * GB), d.total, None, "torch"
                    )
                    for d in real
                ]

        margin = placement.gpu_margin(real[0].total)
        with devices.use_provider(Crowded()):
            n = max(2 * GB - margin + MB, 64 * MB)
            x = memory.array((n,), "uint8", device="auto")
            assert isinstance(x, np.ndarray), type(x)
            assert memory.on_disk(x)  # over the 256 MB RAM budget: on the SSD
            memory.free(x)
            y = memory.array((n,), "uint8", device="cuda:0")
            assert isinstance(y, np.ndarray), type(y)
            memory.free(y)
        z = memory.array((64 * MB,), "uint8", device="cuda:0")
        assert isinstance(z, torch.Tensor)

    @check("a GPU that does not exist is a clear error")
    def _missing() -> None:
        try:
            memory.array(10, device=f"cuda:{len(found) + 7}")
        except ValueError as exc:
            assert "does not exist" in str(exc), exc
        else:
            raise AssertionError("no error for a missing GPU")

    @check("a dtype torch cannot hold: auto goes to the host, cuda:0 raises TypeError")
    def _dtype() -> None:
        x = memory.array(4, "S8", device="auto")
        assert isinstance(x, np.ndarray)
        try:
            memory.array(4, "S8", device="cuda:0")
        except TypeError as exc:
            assert "torch has no dtype" in str(exc), exc
        else:
            raise AssertionError("no TypeError for a string dtype on cuda:0")

    return [_collected, _too_big, _missing, _dtype]


def main() -> int:
    os.environ.setdefault("TIERFLOW_SPILL_DIR", tempfile.mkdtemp(prefix="tierflow-gpu-check-"))
    os.environ.setdefault("TIERFLOW_RAM_BUDGET", "256MB")
    try:
        import torch
    except ImportError:
        print("SKIP torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("SKIP torch sees no CUDA device")
        return 0

    from tierflow.system import devices

    found = devices.gpus()
    for run in [*_allocation_checks(torch, found), *_fallback_checks(torch, found)]:
        run()
    failed = [name for name, ok in results if not ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
