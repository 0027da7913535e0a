"""tierflow: an out-of-core dataflow engine.

``from tierflow import memory`` gives the toolbox (limits, pressure, budget, spill-backed
arrays, streaming, the two-tier store); ``import tierflow as tw`` gives lazy chunked
arrays over files bigger than RAM.
"""

from __future__ import annotations

from . import config, errors, memory
from .engine import factorize as linalg
from .engine.api.creation import (
    from_array,
    from_files,
    from_hdf5,
    from_npy,
    from_parquet,
    from_raw,
    from_zarr,
)
from .engine.array import Array
from .engine.cache import cache_clear, cache_info
from .engine.compute import compute, persist, to_npy
from .engine.dask_arrays import from_dask
from .engine.executors import DaskExecutor, ProcessExecutor, RayExecutor, use_executor
from .engine.frequencies import value_counts
from .engine.functions import concatenate, stack, where
from .engine.profile import Profile, last_profile, profile
from .engine.sorting import sort_rows, topk
from .engine.types import Callback
from .errors import TierflowError

__version__ = "0.1.0"

__all__ = [
    "Array",
    "Callback",
    "DaskExecutor",
    "ProcessExecutor",
    "Profile",
    "RayExecutor",
    "TierflowError",
    "__version__",
    "cache_clear",
    "cache_info",
    "compute",
    "concatenate",
    "config",
    "errors",
    "from_array",
    "from_dask",
    "from_files",
    "from_hdf5",
    "from_npy",
    "from_parquet",
    "from_raw",
    "from_zarr",
    "last_profile",
    "linalg",
    "memory",
    "persist",
    "profile",
    "sort_rows",
    "stack",
    "to_npy",
    "topk",
    "use_executor",
    "value_counts",
    "where",
]
