"""tierflow: an out-of-core dataflow engine.

``from tierflow import memory`` gives the toolbox (limits, pressure, budget, spill-backed
arrays, streaming, the two-tier store); ``import tierflow as tw`` gives lazy chunked
arrays over files bigger than RAM.
"""

from __future__ import annotations

from . import config, errors, memory
from .engine.api import linalg
from .engine.api.array import Array
from .engine.api.compute import compute, persist, store, to_npy
from .engine.api.creation import (
    from_array,
    from_files,
    from_hdf5,
    from_npy,
    from_parquet,
    from_raw,
    from_zarr,
)
from .engine.api.dask import from_dask
from .engine.api.frequencies import value_counts
from .engine.api.functions import concatenate, stack, where
from .engine.api.scans import bfill, cumreduction, ffill
from .engine.api.sort import sort_rows, topk
from .engine.io.cache import cache_clear, cache_info
from .engine.observe.profile import Profile, last_profile, profile
from .engine.runtime.executors import DaskExecutor, ProcessExecutor, RayExecutor, use_executor
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
    "bfill",
    "cache_clear",
    "cache_info",
    "compute",
    "concatenate",
    "config",
    "cumreduction",
    "errors",
    "ffill",
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
    "store",
    "to_npy",
    "topk",
    "use_executor",
    "value_counts",
    "where",
]
