"""Where user code built an operation: the file and line a warning or an error names.

Every graph node records, when it is built, the line of user code that built it: the
first frame on the stack outside tierflow and outside NumPy (NumPy's functions hand
tierflow arrays to tierflow, so their frames sit between the user's line and ours). Only
the file name, the line number and the module's ``__name__`` are kept, never the frame
(it would keep every local of the caller alive); the walk passes a few frames and costs
about a microsecond per node.

The operators layer knows nothing of graph nodes: a fused kernel names the expression
node a line of its generated code evaluates
(:meth:`~tierflow.operators.fused.FusedKernel.expression_at`), and a program's
:class:`Origins` maps those expression nodes back to the call sites of the graph nodes
they were lowered from (:mod:`tierflow.engine.planning.lower` fills it). See
:mod:`tierflow.engine.program.float_errors` for what uses them.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CallSite", "Origins", "here", "warn_here"]

_TIERFLOW = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_NUMPY = os.path.dirname(os.path.abspath(np.__file__)) + os.sep
# Frames of these folders are not the user's. A module's code object holds the file name
# it was imported under, which is the absolute path for packages on sys.path.
_NOT_USERS = (_TIERFLOW, _NUMPY)


@dataclass(frozen=True)
class CallSite:
    """A line of user code: ``filename``, ``lineno`` and the ``module`` (its
    ``__name__``, what ``warnings.filterwarnings(module=...)`` matches)."""

    filename: str
    lineno: int
    module: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}"


def here() -> CallSite | None:
    """The first frame of the caller's stack outside tierflow and NumPy, or None when
    the whole stack is theirs."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(_NOT_USERS):
            return CallSite(code.co_filename, frame.f_lineno, frame.f_globals.get("__name__", ""))
        frame = frame.f_back
    return None


# Python's registries of warnings already shown, one per file, as a module's own
# ``__warningregistry__`` is: what Python's default filter shows once per line.
_REGISTRIES: dict[str, dict[Any, Any]] = {}


def warn_here(message: str, category: type[Warning]) -> None:
    """Issue ``category(message)`` at the line of user code that called tierflow (see
    :func:`here`), as NumPy's own warning of that call would be: filters apply as to a
    warning raised on that line, and the default one shows it once per line."""
    site = here()
    if site is None:
        warnings.warn(message, category, stacklevel=2)
        return
    module = site.module or site.filename.removesuffix(".py")
    registry = _REGISTRIES.setdefault(site.filename, {})
    warnings.warn_explicit(message, category, site.filename, site.lineno, module, registry)


class Origins:
    """The call sites of a program's elementwise expression nodes, by node.

    Keyed by the identity of the expression node (nodes compare by identity); the node
    itself is held, so its id is not reused. Pickled as pairs, so a program that
    travels to a worker process (in one pickle with its kernels, whose nodes are the
    same objects there) finds them again.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, CallSite]] = {}

    def add(self, expr: Any, site: CallSite | None) -> None:
        """Record that ``expr`` was lowered from a node built at ``site``."""
        if site is not None:
            self._by_id[id(expr)] = (expr, site)

    def site(self, expr: Any) -> CallSite | None:
        """Where ``expr``'s graph node was built, if known."""
        found = self._by_id.get(id(expr))
        return found[1] if found is not None and found[0] is expr else None

    def __len__(self) -> int:
        return len(self._by_id)

    def __getstate__(self) -> list[tuple[Any, CallSite]]:
        return list(self._by_id.values())

    def __setstate__(self, pairs: list[tuple[Any, CallSite]]) -> None:
        self._by_id = {id(expr): (expr, site) for expr, site in pairs}
