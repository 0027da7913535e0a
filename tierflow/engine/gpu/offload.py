"""Which device a pass's block runs on: ``device=`` of a compute, and the ``"auto"`` rule.

A pass asks for a device (:func:`pass_device`) when its compute says so
(``compute(device="cuda" | "cuda:N" | "auto")``), else when one of its operators is a
``map_blocks(device="cuda:N")`` (its neighbours then run there too, so the block is not
copied back and forth), else when the ``device`` setting (``tw.config.set(device=...)``,
default ``"cpu"``) asks for one. Each block task then picks its device
(:func:`block_device`):

1. the device the scheduler admitted the task on
   (:func:`tierflow.engine.gpu.tier.current_device`), when there is one;
2. ``"cuda:N"`` as asked; ``"cuda"``: the GPU with the most free memory
   (:func:`tierflow.system.devices.best_device`);
3. ``"auto"``: that GPU only where the block's work on the CPU takes longer than
   copying its inputs to the GPU:

   .. code-block:: text

      cpu_seconds  = ops_per_row * rows / (CPU_OPS_PER_CORE * cores)
      copy_seconds = copy_bytes_per_row * rows / copy_bandwidth + launches * LAUNCH_SECONDS
      GPU when cpu_seconds > copy_seconds, else the CPU

   ``ops_per_row`` weighs each elementwise operation of the pass by its cost on the CPU
   (1 for arithmetic and comparisons, :data:`TRANSCENDENTAL` for exp, log, sin, power, ...,
   1 per element for a reduction), times the elements of a row. The GPU's own time
   is left out: it is a small fraction of the copy for elementwise work. The
   CPU side counts every core, since the CPU runs blocks on all of them at once while
   copies share one bus. ``copy_bandwidth`` is the ``copy_bandwidth`` setting (bytes
   per second, default 12 GB/s: PCIe 4 x16 from pinned memory; ``tests/gpu/
   check_gpu_engine.py`` measures a machine's own). With 16 cores and float32 data the
   GPU pays from about 10 operations per element on: ``sqrt(x * 2 + 1).sum()`` stays
   on the CPU, a 20-term polynomial goes to the GPU.

With no GPU, ``"auto"`` runs on the CPU and ``"cuda"`` raises ValueError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import config
from ...system import devices
from . import tier

__all__ = [
    "CPU_OPS_PER_CORE",
    "LAUNCH_SECONDS",
    "TRANSCENDENTAL",
    "Work",
    "block_device",
    "check",
    "elements",
    "gpu_pays",
    "op_weight",
    "pass_device",
]

CPU_OPS_PER_CORE = 2e9  # elementwise operations per second on one core (fused, in L2)
LAUNCH_SECONDS = 10e-6  # fixed cost of one GPU kernel launch or copy
TRANSCENDENTAL = 10  # weight of exp, log, trigonometric functions and powers

_TRANSCENDENTAL_UFUNCS = frozenset(
    {
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "power", "float_power",
        "sin", "cos", "tan", "arcsin", "arccos", "arctan", "arctan2", "sinh", "cosh",
        "tanh", "arcsinh", "arccosh", "arctanh", "hypot",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Work:
    """What one row of a pass costs: CPU operations (weighted, see the module docstring),
    bytes copied to the GPU, and GPU kernels launched per block."""

    ops_per_row: float
    copy_bytes_per_row: int
    launches: int

    def __add__(self, other: Work) -> Work:
        return Work(
            self.ops_per_row + other.ops_per_row,
            self.copy_bytes_per_row + other.copy_bytes_per_row,
            self.launches + other.launches,
        )


def op_weight(ufunc_name: str) -> int:
    """CPU cost of one elementwise operation, in additions."""
    return TRANSCENDENTAL if ufunc_name in _TRANSCENDENTAL_UFUNCS else 1


def gpu_pays(
    work: Work,
    rows: int,
    *,
    bandwidth: float | None = None,
    cores: int | None = None,
) -> bool:
    """Whether a block of ``rows`` rows runs faster on the GPU than on the CPU by the
    rule of the module docstring. ``bandwidth`` (bytes/s) defaults to the
    ``copy_bandwidth`` setting, ``cores`` to the usable cores."""
    if bandwidth is None:
        bandwidth = float(config.get("copy_bandwidth"))
    if cores is None:
        cores = devices.cpu_cores()
    cpu_seconds = work.ops_per_row * rows / (CPU_OPS_PER_CORE * max(1, cores))
    copy_seconds = work.copy_bytes_per_row * rows / bandwidth + work.launches * LAUNCH_SECONDS
    return cpu_seconds > copy_seconds


def pass_device(asked: str | None, neighbour: str | None) -> str | None:
    """The device a pass asks for (see the module docstring): ``asked`` (the compute's
    ``device=``), else ``neighbour`` (a map_blocks' GPU in the pass), else the ``device``
    setting; None for the CPU. Raises ValueError for a device that is not one of
    ``"cpu"``, ``"auto"``, ``"cuda"``, ``"cuda:N"``."""
    found = asked if asked is not None else neighbour
    if found is None:
        found = config.get("device") or "cpu"
    found = check(found)
    return None if found == "cpu" else found


def check(device: object) -> str:
    """``device`` as a string, if it names one (``"cpu"``, ``"auto"``, ``"cuda"``,
    ``"cuda:N"``); else ValueError."""
    text = str(device)
    if text in ("cpu", "auto", "cuda"):
        return text
    if text.startswith("cuda:") and text[5:].isdigit():
        return text
    raise ValueError(f"device={device!r}: use 'cpu', 'auto', 'cuda' or 'cuda:N'")


def require(asked: str) -> None:
    """ValueError when ``asked`` (``"cuda"``, ``"cuda:N"``) names a GPU that is not
    there, with the same words as :func:`block_device` (checked before a run starts)."""
    found = devices.gpus()
    if asked == "cuda" and not found:
        raise ValueError(
            "device='cuda': no GPU here (torch and cupy see none); use device='auto' "
            "to run on the CPU when there is no GPU"
        )
    if asked.startswith("cuda:") and not any(d.id == asked for d in found):
        have = ", ".join(d.id for d in found) or "none"
        raise ValueError(
            f"device={asked!r}: no such GPU (GPUs here: {have}); use device='auto' to "
            "run on the CPU when there is no GPU"
        )


def block_device(asked: str, work: Work, rows: int) -> str | None:
    """The GPU (``"cuda:N"``) a block task of a pass that asks for ``asked`` runs on, or
    None for the CPU (see the module docstring). Raises ValueError when ``asked`` names
    a GPU that is not there."""
    admitted = tier.current_device()
    if admitted is not None:
        # Seated on a GPU by the scheduler; "auto" still keeps a block whose copy would
        # cost more than its work on the CPU.
        return None if asked == "auto" and not gpu_pays(work, rows) else admitted
    if asked.startswith("cuda:"):
        index = int(asked[5:])
        found = devices.gpus()
        if not any(d.index == index for d in found):
            have = ", ".join(d.id for d in found) or "none"
            raise ValueError(
                f"device={asked!r}: no such GPU (GPUs here: {have}); use device='auto' to "
                "run on the CPU when there is no GPU"
            )
        return asked
    best = devices.best_device()
    if best == "cpu":
        if asked == "cuda":
            raise ValueError(
                "device='cuda': no GPU here (torch and cupy see none); use device='auto' "
                "to run on the CPU when there is no GPU"
            )
        return None
    if asked == "auto" and not gpu_pays(work, rows):
        return None
    return best


def elements(row_shape: tuple[int, ...]) -> int:
    """Elements of one row."""
    return math.prod(row_shape)
