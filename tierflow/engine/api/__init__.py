"""The face of lazy arrays: NumPy's functions and methods over them, and the helpers
that build their graph nodes.

* :mod:`.dispatch`: the registry where each NumPy name meets its implementation
  (``@implements(np.median)``, ``@method("transpose")``) or its refusal.
* :mod:`.build`: the node-building helpers; they return Arrays through the one type
  :mod:`tierflow.engine.api.array` registers, so no module needs the Array class.
* :mod:`.creation`: the constructors (``tw.from_npy`` and the others).

Importing this package imports every module that registers, so the registry is full
before the first call. Who may import what: the registering modules import
:mod:`.build` and :mod:`.dispatch`, never :mod:`tierflow.engine.api.array`; the Array class
imports :mod:`.build`, :mod:`.dispatch` and :mod:`.creation`, never a registering module.
"""

from . import (
    einsum,
    frequencies,
    functions,
    linalg,
    methods,
    nanfunctions,
    overlap,
    products,
    quantiles,
    scans,
    sort,
    stacking,
    windows,
)

__all__ = [
    "einsum",
    "frequencies",
    "functions",
    "linalg",
    "methods",
    "nanfunctions",
    "overlap",
    "products",
    "quantiles",
    "scans",
    "sort",
    "stacking",
    "windows",
]
