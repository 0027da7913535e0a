"""Floating-point warnings and errors of tierflow's operators, named at the user's line.

NumPy reports a floating-point error (divide by zero, overflow, underflow, invalid value)
from inside the ufunc, as ``np.errstate`` says: a ``RuntimeWarning`` at the Python line
that called the ufunc, a ``FloatingPointError``, nothing. Inside a fused kernel that line
is one of the kernel's generated lines (``<tierflow fused kernel>:7``), which tells the
user nothing. So, while one of tierflow's own operators (a fused kernel, a built-in
reduction, a selection) runs on a block:

* **Which errstate.** The one in force where ``compute()`` (``to_npy``, ``persist``)
  was called; the errstate when the pipeline was built does not matter. The threads
  executor runs each task in a copy of the context that submitted it, and NumPy (2.0
  on) keeps its errstate in a context variable, so ``with np.errstate(divide="ignore"):
  x.compute()`` holds in the workers too. A worker process gets the caller's four modes
  with each task (:class:`~tierflow.engine.program.tasks.BlockTask`); ``"call"`` and ``"log"``
  are ``"warn"`` there (the handler stays in the caller's process).
* **"warn" becomes a warning at the user's line.** For the operator's call, the
  ``"warn"`` modes become ``"call"`` with :func:`_on_error` as the handler. It finds the
  operation the error belongs to — the generated line of the kernel on the stack, its
  expression node, and through the program's :class:`~tierflow.engine.graph.callsites.Origins`
  the line of user code that built that operation; elsewhere (an epilogue, a built-in
  reduction) the operator's own node — and issues NumPy's message (``"divide by zero
  encountered in log"``) with :func:`warnings.warn_explicit` at that file and line,
  under that module's name. Filters apply as to a NumPy warning raised on that line
  (``"error"`` makes it an exception there, ``"ignore"`` drops it, ``module=`` matches),
  and the kernel's own lines are never shown. Each message is issued once per line of
  user code and pass of a compute (:class:`WarningLog`), as Python's default filter
  shows a warning once per line.
* **Other modes stay.** ``"ignore"``, ``"raise"`` and ``"print"`` are NumPy's own; an
  errstate that uses ``"call"`` or ``"log"`` (a handler of the user's) is left as it is.
  An error an operator raises — ``FloatingPointError`` under ``"raise"``, a ufunc's
  ``TypeError``, a warning a filter turned into an error — gets a note, "raised by the
  operation built at file:line" (:func:`annotate`), and its traceback stops before the
  kernel's own frames.
* **User functions are left alone.** A ``map_blocks`` function or a user's reduction
  runs under the caller's errstate unchanged: NumPy's warning already names the line
  of the user's function.
* **Whole values.** A NumPy function of a reduction's value and a reduction's aggregate
  run in tasks of their own, outside any program; :func:`naming` does the same there,
  with the line that built them.
* **Worker processes.** There the handler keeps each message with the task's result
  (:attr:`tierflow.engine.program.tasks.BlockResult.warnings`), and the driver issues it when
  it receives the result (:meth:`tierflow.engine.program.program.Program.receive`): its filters
  decide, and one that makes it an error fails the compute there.

Cost: switching the errstate is a context-variable set and reset per operator call
(about 1.5 us on this project's machines, against 46 us for the smallest fused call the
scheduler runs); the rest runs only when NumPy reports an error.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ...operators import elementwise as ew
from ...operators import fused
from ..graph.callsites import CallSite, Origins

__all__ = ["WarningLog", "annotate", "applied", "enter", "leave", "modes", "naming"]

# NumPy >= 2 keeps the errstate in a context variable: set it without np.errstate's cost.
# NumPy 1.x has none: np.errstate then, slower, same effect.
_umath: Any = getattr(getattr(np, "_core", None), "umath", None)
_ERRSTATE: Any = getattr(_umath, "_extobj_contextvar", None)
_make_extobj: Any = getattr(_umath, "_make_extobj", None)

_KINDS = ("divide", "over", "under", "invalid")
_DEPTH = 24  # frames searched above the handler for the kernel's generated code
_NAMES = {ew.AsType: "cast", ew.Where: "where", ew.Clip: "clip", ew.Round: "round"}

_running = threading.local()  # .call: (context, op, site, label) of this thread's operator
_switched: dict[int, tuple[Any, Any]] = {}  # id(errstate) -> (errstate, converted or None)


def _converted(modes: Mapping[str, Any]) -> dict[str, Any] | None:
    """``modes`` with "warn" as "call"; None when there is nothing to convert, or when
    a handler of the user's is in use ("call", "log")."""
    values = [modes[k] for k in _KINDS]
    if "warn" not in values or "call" in values or "log" in values:
        return None
    return {k: "call" if modes[k] == "warn" else modes[k] for k in _KINDS}


def _converted_errstate(current: Any) -> Any:
    """The errstate object for ``current`` with "warn" as "call" (None: keep current);
    made once per errstate object."""
    found = _switched.get(id(current))
    if found is not None and found[0] is current:
        return found[1]
    converted = _converted(np.geterr())  # geterr reads ``current``: it is in force here
    value = None if converted is None else _make_extobj(call=_on_error, **converted)
    if len(_switched) > 64:
        _switched.clear()
    _switched[id(current)] = (current, value)
    return value


def enter(ctx: Any, op: Any, site: CallSite | None, label: str) -> tuple[Any, ...]:
    """Before operator ``op`` runs on this thread for task ``ctx`` (a
    :class:`~tierflow.engine.program.context.Context`): "warn" modes go to :func:`_on_error`,
    which names ``site`` and ``label`` when the error is not in a generated line of
    ``op``. Give the result to :func:`leave` when the call is over."""
    outer = getattr(_running, "call", None)
    _running.call = (ctx, op, site, label)
    if _ERRSTATE is not None:
        value = _converted_errstate(_ERRSTATE.get())
        return (outer, None if value is None else _ERRSTATE.set(value), None)
    converted = _converted(np.geterr())  # pragma: no cover -- NumPy 1.x
    if converted is None:  # pragma: no cover
        return (outer, None, None)
    manager = np.errstate(call=_on_error, **converted)  # pragma: no cover
    manager.__enter__()  # pragma: no cover
    return (outer, None, manager)  # pragma: no cover


def leave(entered: tuple[Any, ...]) -> None:
    """Undo :func:`enter` (the errstate and the operator this thread runs)."""
    outer, token, manager = entered
    if token is not None:
        _ERRSTATE.reset(token)
    if manager is not None:  # pragma: no cover -- NumPy 1.x
        manager.__exit__(None, None, None)
    _running.call = outer


def _on_error(kind: str, flag: int) -> None:
    """NumPy's handler for a floating-point error in an operator (see the module
    docstring): ``kind`` is NumPy's "divide by zero", "overflow", ..."""
    call = getattr(_running, "call", None)
    if call is None:  # a ufunc outside an operator call: cannot happen, but say it
        warnings.warn(f"{kind} encountered", RuntimeWarning, stacklevel=2)
        return
    ctx, op, site, label = call
    found, name = _locate(op, ctx.program.origins, sys._getframe(1))
    message = f"{kind} encountered in {name or label}"
    where = found or site
    caught = ctx.caught
    if caught is None:
        ctx.program.warnings.warn(message, where)
    elif (message, where) not in caught:
        caught.append((message, where))


def _locate(op: Any, origins: Origins, frame: Any) -> tuple[CallSite | None, str | None]:
    """The call site and the operation name of the expression node whose generated
    line of ``op`` is on the stack from ``frame`` up; (None, None) when none is."""
    find = getattr(op, "expression_at", None)
    if find is None:
        return None, None
    for _ in range(_DEPTH):
        if frame is None:
            break
        expr = find(frame.f_code, frame.f_lineno)
        if expr is not None:
            name = expr.ufunc.__name__ if isinstance(expr, ew.Apply) else _NAMES.get(type(expr))
            return origins.site(expr), name
        frame = frame.f_back
    return None, None


def _note(exc: BaseException, site: CallSite) -> None:
    note = f"raised by the operation built at {site}"
    if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)


def annotate(exc: BaseException, op: Any, origins: Origins, site: CallSite | None) -> None:
    """Name the line of user code behind an error that operator ``op`` raised: the
    operation of the kernel's generated line in the traceback, else ``site``. When the
    error came from the kernel's generated code, the traceback stops before the kernel."""
    find = getattr(op, "expression_at", None)
    tb = exc.__traceback__ if find is not None else None
    while tb is not None:
        expr = find(tb.tb_frame.f_code, tb.tb_lineno)  # type: ignore[misc]
        if expr is not None:
            site = origins.site(expr) or site
            _hide_kernel(exc)
            break
        tb = tb.tb_next
    if site is not None:
        _note(exc, site)


def _hide_kernel(exc: BaseException) -> None:
    """Cut ``exc``'s traceback before its first frame in the fused kernel's module."""
    previous = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == fused.__file__:
            if previous is not None:
                previous.tb_next = None
            return
        previous, tb = tb, tb.tb_next


class WarningLog:
    """The warnings of one program (a pass of a compute): each message of each line of
    user code issued once, with :func:`warnings.warn_explicit` at that line. Thread
    safe; travels to a worker process empty (the driver's log issues what workers
    send back)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[tuple[type[Warning], str, CallSite | None]] = set()
        self._registry: dict[Any, Any] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (WarningLog, ())

    def warn(
        self, message: str, site: CallSite | None, category: type[Warning] = RuntimeWarning
    ) -> None:
        """Issue ``category(message)`` at ``site`` unless issued before. Raises it (with
        a note naming ``site``) where a filter makes it an error. A site without a
        module name is matched by filters as its file name without ``.py``, as
        :func:`warnings.warn_explicit` does."""
        with self._lock:
            if (category, message, site) in self._seen:
                return
            self._seen.add((category, message, site))
        if site is None:
            warnings.warn(message, category, stacklevel=2)
            return
        try:
            warnings.warn_explicit(
                message,
                category,
                site.filename,
                site.lineno,
                site.module or _module_of(site.filename),
                self._registry,
            )
        except Warning as exc:
            _note(exc, site)
            raise


def _module_of(filename: str) -> str:
    """The module name filters match a warning of ``filename`` by when its module is not
    known: the file name without ``.py``, as :func:`warnings.warn_explicit` makes it
    (passing it None there drops the warning)."""
    return filename[:-3] if filename.lower().endswith(".py") else filename or "<unknown>"


class _Alone:
    """What :func:`enter` needs of a task, for an operation outside any program (a
    NumPy function on whole values, a reduction's aggregate): its own log, nothing
    fused. Such an operation runs once per compute, so its log is the compute's."""

    caught = None

    def __init__(self) -> None:
        self.program = self
        self.origins = Origins()
        self.warnings = WarningLog()


@contextlib.contextmanager
def naming(site: CallSite | None, label: str) -> Iterator[None]:
    """In the block, floating-point warnings and errors name ``site`` (the line that
    built the operation ``label``), as :func:`enter` and :func:`annotate` do for an
    operator of a program. For the tasks that run whole in-memory values."""
    entered = enter(_Alone(), None, site, label)
    try:
        yield
    except Exception as exc:
        if site is not None:
            _note(exc, site)
        raise
    finally:
        leave(entered)


_modes_of: dict[int, tuple[Any, tuple[str, ...]]] = {}  # id(errstate) -> (errstate, modes)


def modes() -> tuple[str, ...]:
    """The calling thread's four modes (divide, over, under, invalid), for a task that
    runs in another process (:func:`applied` there)."""
    if _ERRSTATE is None:  # pragma: no cover -- NumPy 1.x
        errstate: Mapping[str, Any] = np.geterr()
        return tuple(errstate[k] for k in _KINDS)
    state = _ERRSTATE.get()
    found = _modes_of.get(id(state))
    if found is not None and found[0] is state:
        return found[1]
    current: Mapping[str, Any] = np.geterr()
    value = tuple(current[k] for k in _KINDS)
    if len(_modes_of) > 64:
        _modes_of.clear()
    _modes_of[id(state)] = (state, value)
    return value


@contextlib.contextmanager
def applied(given: tuple[str, ...] | None) -> Iterator[None]:
    """The modes :func:`modes` gave, in force in the block (None: as they are);
    "call" and "log" are "warn" here (their handler stayed in the other process)."""
    if given is None:
        yield
        return
    settings = {
        k: "warn" if m in ("call", "log") else m for k, m in zip(_KINDS, given, strict=True)
    }
    with np.errstate(**settings):  # type: ignore[arg-type]
        yield
