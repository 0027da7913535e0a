"""tierflow: an out-of-core dataflow engine.

``from tierflow import memory`` gives the toolbox (limits, pressure, budget, spill-backed
arrays, streaming, the two-tier store); ``import tierflow as tw`` gives lazy chunked
arrays over files bigger than RAM.
"""

from __future__ import annotations

from . import config, errors, memory
from .errors import TierflowError

__version__ = "0.1.0"

__all__ = ["TierflowError", "__version__", "config", "errors", "memory"]
