"""What a step of a block program runs in: the task's :class:`Context` (its block, its
memoised results, its device lane), and the one call of an operator on a block
(:func:`operator_call`) that halves it after an out-of-memory error, names user code's
errors by block and records floating-point warnings at the user's line."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import BlockError, OutOfMemoryError
from ...system.types import Level
from ..gpu import transfer
from ..graph import callsites
from ..types import Request, RowRange
from . import float_errors

if TYPE_CHECKING:
    from .program import Program
    from .roots import ReduceRoot
    from .steps import KernelStep

__all__ = [
    "HIGH_PRESSURE",
    "SKIPPED",
    "Context",
    "operator_call",
    "user_error",
]


HIGH_PRESSURE = frozenset({Level.HIGH, Level.CRITICAL})


class _Skipped:
    def __repr__(self) -> str:
        return "SKIPPED"

    def __reduce__(self) -> str:
        return "SKIPPED"


SKIPPED: Any = _Skipped()
"""A reduction's partial for a block it does not need (a complete prefix exists)."""


class Context:
    """One task's state: the memo of evaluated steps, the source rows it read, the
    device lane its device steps run on (None: everything on the CPU), and in a worker
    process the floating-point warnings of its operators, ``caught`` for the driver
    (None: issued at once; see :mod:`tierflow.engine.program.float_errors`)."""

    __slots__ = ("caught", "index", "lane", "memo", "program", "reads", "req", "started")

    def __init__(
        self, index: int, req: Request, program: Program, lane: transfer.Lane | None = None
    ) -> None:
        self.index = index
        self.req = req
        self.program = program
        self.lane = lane
        self.started = False
        self.memo: dict[tuple[Any, ...], Any] = {}
        self.reads: list[tuple[Any, int, int]] = []
        self.caught: list[tuple[str, callsites.CallSite | None]] | None = None

    def start(self) -> None:
        """The block's compute on the device starts (its inputs are there)."""
        if not self.started and self.lane is not None:
            self.started = True
            self.lane.started(self.index)

    def describe(self) -> str:
        """Which block this task computes, in words (made only for an error message)."""
        req, program = self.req, self.program
        rows = f" (rows {req.start}:{req.stop})" if isinstance(req, RowRange) else ""
        return f"block {self.index} of {program.count}{rows} of {program.name}"

    @property
    def where(self) -> str:
        """:meth:`describe`."""
        return self.describe()


def _where_of(ctx: Context, req: Request) -> tuple[int, int, int]:
    if isinstance(req, RowRange):
        return ctx.index, req.start, req.stop
    return ctx.index, -1, -1


def user_error(label: str, ctx: Context, req: Request, exc: Exception) -> BlockError:
    index, start, stop = _where_of(ctx, req)
    return BlockError(
        f"{label} failed on {ctx.where}: {type(exc).__name__}: {exc}",
        index=index,
        start=max(start, 0),
        stop=max(stop, 0),
    )


class Calling(Protocol):
    """What :func:`operator_call` reads of a step that calls an operator: its ``node``
    (the line that built it), its halving ``site`` (the operator's label) and whether
    the operator is the user's function (``user``)."""

    node: Any
    site: Any
    user: bool


def operator_call(
    step: KernelStep | ReduceRoot | Calling,
    ctx: Context,
    req: Request,
    op: Any,
    call: Callable[[], Any],
) -> Any:
    """``call()``: a call of ``step``'s operator ``op`` on the rows of ``req`` (through
    :mod:`~tierflow.engine.program.halving`), its errors told as the user needs them.
    Halving's own (a :class:`BlockError`, an :class:`OutOfMemoryError`) pass
    as they are; a user function's error becomes a :class:`BlockError` that names the
    operator and the block; the floating-point warnings and errors of tierflow's own
    operators name the user's line (:mod:`tierflow.engine.program.float_errors`)."""
    built_at, label = step.node.built_at, step.site.label
    entered = None if step.user else float_errors.enter(ctx, op, built_at, label)
    try:
        return call()
    except (BlockError, OutOfMemoryError):
        raise
    except Exception as exc:
        if step.user:
            raise user_error(label, ctx, req, exc) from exc
        float_errors.annotate(exc, op, ctx.program.origins, built_at)
        raise
    finally:
        if entered is not None:
            float_errors.leave(entered)
