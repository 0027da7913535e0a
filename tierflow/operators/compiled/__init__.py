"""Fused block programs compiled to one loop (numba), beside the NumPy path.

* :mod:`.source` writes a kernel's Python source from a fused expression and its
  reduction (pure: it compiles nothing), or says why it cannot;
* :mod:`.kernels` compiles that source with numba (imported on first use) into a folder
  that keeps the machine code across processes, and runs it on a block;
* :mod:`.tiered` compiles on a background thread, so that blocks run on the NumPy path
  until the kernel is ready.

Only :mod:`tierflow.operators` and the engine import this package; numba is optional.
"""

from .kernels import (
    CompiledElementwise,
    CompiledReduction,
    Loaded,
    compiler_missing,
    kernel_folder,
    load,
)
from .source import KernelSource, Unsupported, elementwise_source, reduction_source

__all__ = [
    "CompiledElementwise",
    "CompiledReduction",
    "KernelSource",
    "Loaded",
    "Unsupported",
    "compiler_missing",
    "elementwise_source",
    "kernel_folder",
    "load",
    "reduction_source",
]
