"""Fused evaluation of an elementwise expression on a row block, in cache-sized sub-blocks.

Plain NumPy evaluates ``np.sqrt(x * 2 + 1)`` on a block as three passes over block-sized
temporaries, so every temporary goes through main memory. A :class:`FusedKernel` runs the
same calls on sub-blocks of rows small enough for the temporaries to stay in the L2
cache, writing each one with ``out=`` into scratch buffers that are reused from
sub-block to sub-block and from call to call:

* Sub-block rows: the largest power of two for which the widest temporary is at most
  ``SUBBLOCK_BYTES`` (512 KiB). Measured on a 2-core EPYC (512 KiB L2 per core) for
  ``sqrt(x*2+1)`` on float32 ``[N, 8]``: 64 KiB sub-blocks 2.4 GB/s, 256 KiB 2.9,
  512 KiB 3.0, 1 MiB 2.9, 4 MiB 2.4, whole 64 MiB blocks 1.2 (one thread).
* Registers: every intermediate value gets a scratch register; a register is reused as
  soon as its value is dead, and an elementwise ufunc writes in place into a dead
  operand of the same dtype and shape. The last operation writes straight into the
  output block.
* Scratch is per thread (a kernel is shared by the scheduler's threads); it is
  allocated on first use, kept for the next call, and dropped by ``release_scratch``.
* Results are bitwise those of :func:`~tierflow.operators.elementwise.evaluate`: the
  same ufunc calls with the same dtypes on fewer rows at a time.

The fixed cost of a call matters as much as the throughput: the engine runs one call per
block, and blocks of a few thousand rows are common. The expression is compiled once,
when the kernel is built, into one generated Python function with one line per step
(``f0(i0, c0, out=r0)``, ...), so a sub-block costs the ufunc calls and little else; the
blocks are checked once per call, and a block that fits in one sub-block is evaluated
without slicing anything and handed to an epilogue or a reduction in one piece.
Measured for ``((x + 1) * 2 - 3).sum(axis=0)`` as a :class:`FusedReduction` on 1000
float32 rows of 8 (one thread): 77 us per call before, 46 us now, against 39 us for
NumPy's own expression and float32 sum. The generated code's file name is
``KERNEL_FILENAME``, and ``expression_at(code, lineno)`` names the expression node a
frame of it was evaluating: what a warning or an error raised there is about (the
engine names the user's line for it, see :mod:`tierflow.engine.program.float_errors`).

Wide view. A constant with more than one element (a row vector of column means) makes
NumPy iterate one row at a time: on float32 ``[N, 8]`` its inner loops are 8 elements
long and most of the time goes into its casting buffers. When every input block is
C-contiguous with the result's row shape, and the constants broadcast along the trailing
axes only, the kernel evaluates the same steps on a wide 2-D view of the block instead
(``(-1, W)`` with ``W`` rows' worth of elements, ``W`` about ``_WIDE_ELEMENTS``) against
the constants tiled to ``W`` elements once per kernel; rows that do not fill a wide row
run as one flat piece against the first elements of the tiled constants. Element ``k``
of the flat block meets the same constant element either way, so results stay bitwise
NumPy's. Measured for ``(x - m) / s`` on float32 ``[N, 8]`` (one thread): row by row
1.0 GB/s, wide rows of 4096 elements 3.1, of 16384 elements 3.8.

A kernel can end in an *epilogue*: a single-input :class:`~tierflow.operators.types.BlockOp`
(a reduction over trailing axes, ``@ w``) applied to each sub-block's result, so the
full-width intermediate block never exists. :class:`FusedReduction` does the same for a
reduction over rows: each sub-block result is folded into the block's partial at once
(``np.sqrt(x*2+1).sum(axis=0)`` reads ``x`` once and allocates nothing block-sized). The
built-in sums, products, min/max, any/all, means and var/std keep running per-lane
partials across the sub-blocks and fold them once per block
(see :mod:`tierflow.operators.reductions`); their float partials accumulate in float64.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._blocks import check_blocks, prepare_out, wide_fold
from .elementwise import Apply, AsType, Clip, Expr, Input, Round, Where, infer, walk
from .reductions import RowReduction
from .types import BlockOp, Partial, ReductionOp

__all__ = ["KERNEL_FILENAME", "SUBBLOCK_BYTES", "FusedKernel", "FusedReduction", "subblock_rows"]

SUBBLOCK_BYTES = 512 * 1024  # bytes of the widest temporary of one sub-block (see above)
_WIDE_ELEMENTS = 16384  # elements per row of the wide view (measured above)
_CACHED_VIEWS = 32  # register views kept per thread, keyed by piece size

_OUT = -1  # register number of the caller's output block


def subblock_rows(row_bytes: int, subblock_bytes: int = SUBBLOCK_BYTES) -> int:
    """Rows per sub-block: the largest power of two with ``rows * row_bytes <= subblock_bytes``.

    At least 1; a row of zero bytes gives 2**30 (one sub-block per block in practice).

    >>> subblock_rows(32)
    16384
    """
    if row_bytes <= 0:
        return 1 << 30
    rows = max(1, subblock_bytes // row_bytes)
    return 1 << (rows.bit_length() - 1)


@dataclass(frozen=True)
class _Ref:
    """Where an operand of a step comes from.

    ``kind`` is "input" (block ``index``), "reg" (register ``index``), "out" (the output
    block), "const" (an in-memory value) or "literal" (a fixed argument such as a None
    bound of clip or the decimals of round).
    """

    kind: str
    index: int = 0
    value: Any = None


@dataclass(frozen=True)
class _Step:
    """One call ``fn(*operands, out=target, **kwargs)``, made for the expression node
    ``expr`` (None for a copy of an input)."""

    fn: Callable[..., Any]
    operands: tuple[_Ref, ...]
    out: int  # register number, or _OUT
    kwargs: tuple[tuple[str, Any], ...] = ()
    expr: Expr | None = None


@dataclass
class _Plan:
    steps: list[_Step] = field(default_factory=list)
    specs: list[tuple[np.dtype, tuple[int, ...]]] = field(default_factory=list)
    free: list[int] = field(default_factory=list)

    def register(self, spec: tuple[np.dtype, tuple[int, ...]], candidates: list[int]) -> int:
        """A register of ``spec``: a dead one from ``candidates`` if any, else a new one."""
        for reg in candidates:
            if self.specs[reg] == spec:
                candidates.remove(reg)
                if reg in self.free:
                    self.free.remove(reg)
                return reg
        self.specs.append(spec)
        return len(self.specs) - 1


def _where(cond: Any, a: Any, b: Any, out: np.ndarray) -> None:
    np.copyto(out, b, casting="unsafe")
    np.copyto(out, a, casting="unsafe", where=cond)


def _cast(a: Any, out: np.ndarray) -> None:
    if out.dtype.kind not in "bc" and np.iscomplexobj(a):
        # NumPy's cast keeps the real part, and warns (ComplexWarning) whatever the
        # values: the engine gives that warning once, where the cast is built.
        a = np.real(a)
    np.copyto(out, a, casting="unsafe")


def _round_then_copy(a: Any, decimals: int, out: np.ndarray) -> None:
    # NumPy rounds integers to tens and hundreds through a float division whose result
    # cannot be cast into an integer ``out=``; round first, then copy.
    np.copyto(out, np.round(a, decimals))


KERNEL_FILENAME = "<tierflow fused kernel>"  # the file name of the generated code
KERNEL_MODULE = "tierflow.operators.fused.<kernel>"  # its module: none of that name


def _generate(
    steps: Sequence[_Step], n_inputs: int, n_registers: int
) -> tuple[Any, list[Any], dict[int, Expr]]:
    """The steps as one Python function ``program(ins, regs, out, consts)``; the
    constants, in the order ``consts`` must list them; and the expression node of each
    line of the function's source that calls a step (by line number).

    Only names made here enter the source (``i0`` inputs, ``r0`` registers, ``c0``
    constants, ``f0`` step functions, ``k0`` keyword dicts, ``l0`` literals); every value
    is bound through the function's namespace.
    """
    # A module name no module has: the function pickles by value, and cloudpickle need
    # not search every loaded module for it (what a function without one costs, 5 ms).
    namespace: dict[str, Any] = {"__name__": KERNEL_MODULE}
    consts: list[Any] = []

    def name(ref: _Ref) -> str:
        if ref.kind == "input":
            return f"i{ref.index}"
        if ref.kind == "reg":
            return f"r{ref.index}"
        if ref.kind == "out":
            return "out"
        if ref.kind == "const":
            consts.append(ref.value)
            return f"c{len(consts) - 1}"
        key = f"l{len(namespace)}"
        namespace[key] = ref.value
        return key

    lines = ["def program(ins, regs, out, consts):"]
    lines.append("    " + "".join(f"i{i}, " for i in range(n_inputs)) + "= ins")
    if n_registers:
        lines.append("    " + "".join(f"r{i}, " for i in range(n_registers)) + "= regs")
    body = []
    for k, step in enumerate(steps):
        namespace[f"f{k}"] = step.fn
        args = "".join(f"{name(ref)}, " for ref in step.operands)
        target = "out" if step.out == _OUT else f"r{step.out}"
        extra = ""
        if step.kwargs:
            namespace[f"k{k}"] = dict(step.kwargs)
            extra = f", **k{k}"
        body.append(f"    f{k}({args}out={target}{extra})")
    if consts:
        lines.append("    " + "".join(f"c{i}, " for i in range(len(consts))) + "= consts")
    first = len(lines) + 1
    exprs = {first + k: step.expr for k, step in enumerate(steps) if step.expr is not None}
    lines.extend(body or ["    pass"])
    # The source holds generated names only; values reach it through the namespace.
    exec(compile("\n".join(lines), KERNEL_FILENAME, "exec"), namespace)
    return namespace["program"], consts, exprs


def _tile(value: Any, row_shape: tuple[int, ...], fold: int) -> Any:
    """A constant as ``fold`` rows of the flat block: arrays broadcast to ``row_shape``,
    flattened and repeated (same dtype, read-only); scalars unchanged."""
    if not isinstance(value, np.ndarray) or value.ndim == 0:
        return value
    trailing = value.reshape(value.shape[value.ndim - len(row_shape) :])
    row = np.ascontiguousarray(np.broadcast_to(trailing, row_shape)).reshape(-1)
    tiled = np.tile(row, fold)
    tiled.flags.writeable = False
    return tiled


class _Program:
    """An expression compiled into steps over registers, run one sub-block at a time."""

    def __init__(
        self,
        expr: Expr,
        input_dtypes: Sequence[np.dtype],
        input_row_shapes: Sequence[tuple[int, ...]],
        subblock_bytes: int,
        keep_root: bool,
    ) -> None:
        self.keeps_root = keep_root
        inferred = infer(expr, input_dtypes, input_row_shapes)
        self.dtype = inferred.dtype
        self.row_shape = inferred.row_shape
        values = inferred.values

        def spec(node: Expr) -> tuple[np.dtype, tuple[int, ...]]:
            value = values[id(node)]
            return (np.dtype(value.dtype), tuple(value.shape[1:]))

        ops = [n for n in walk(expr) if inferred.depends_on_input(n) and not isinstance(n, Input)]
        last_use: dict[int, int] = {}
        for pos, node in enumerate(ops):
            for child in node.children():
                last_use[id(child)] = pos
        last_use[id(expr)] = len(ops)

        plan = _Plan()
        refs: dict[int, _Ref] = {}

        def ref(node: Expr) -> _Ref:
            if isinstance(node, Input):
                return _Ref("input", node.index)
            if id(node) in refs:
                return refs[id(node)]
            return _Ref("const", value=values[id(node)])

        for pos, node in enumerate(ops):
            children = node.children()
            operands = [ref(c) for c in children]
            dying = sorted(
                {refs[id(c)].index for c in children if id(c) in refs and last_use[id(c)] == pos}
            )
            scratch: list[int] = []
            fn, operands, kwargs, in_place = self._operation(node, operands, values, plan, scratch)
            if node is expr and not keep_root:
                out = _OUT
            else:
                candidates = dying + plan.free if in_place else list(plan.free)
                out = plan.register(spec(node), candidates)
            plan.steps.append(_Step(fn, tuple(operands), out, kwargs, node))
            plan.free.extend(r for r in dying + scratch if r != out)
            refs[id(node)] = _Ref("reg", out)

        if not ops:  # the expression is one of its inputs
            if keep_root:
                self.result = ref(expr)
            else:
                plan.steps.append(_Step(_cast, (ref(expr),), _OUT))
                self.result = _Ref("out")
        else:
            self.result = refs[id(expr)]
        self.steps = plan.steps
        self.specs = plan.specs
        widest = max(
            [math.prod(s) * d.itemsize for d, s in plan.specs]
            + [math.prod(self.row_shape) * self.dtype.itemsize]
        )
        self.sub_rows = subblock_rows(widest, subblock_bytes)
        self._result_is_input = self.result.kind == "input"
        self._function, self._consts, self._exprs = _generate(
            plan.steps, len(input_dtypes), len(plan.specs)
        )
        self._plan_wide(input_row_shapes)

    def _operation(
        self,
        node: Expr,
        operands: list[_Ref],
        values: dict[int, Any],
        plan: _Plan,
        scratch: list[int],
    ) -> tuple[Callable[..., Any], list[_Ref], tuple[tuple[str, Any], ...], bool]:
        """What a step of ``node`` calls: the function, its operands and keyword
        arguments, and whether it may write over an operand that dies there (an
        elementwise ufunc may: exact overlap is safe in NumPy; where and astype read
        operands after writing). A ``where`` condition that needs a cast to bool takes
        a register of ``plan``, listed in ``scratch``."""
        if isinstance(node, Apply):
            return node.ufunc, operands, node.kwargs, True
        if isinstance(node, Clip):
            bounds = iter(operands[1:])
            clipped = [
                operands[0],
                next(bounds) if node.lo is not None else _Ref("literal", value=None),
                next(bounds) if node.hi is not None else _Ref("literal", value=None),
            ]
            return np.clip, clipped, (), True
        if isinstance(node, Round):
            integer = np.dtype(values[id(node.a)].dtype).kind in "biu" and node.decimals < 0
            rounded = [*operands, _Ref("literal", value=node.decimals)]
            return (_round_then_copy if integer else np.round), rounded, (), True
        if isinstance(node, AsType):
            return _cast, operands, (), False
        if isinstance(node, Where):
            condition = self._bool_condition(node, operands[0], values, plan, scratch)
            # np.where converts a Python number to an array and casts it unsafely into
            # the result (-1 into uint8 is 255); copyto would refuse the Python int.
            choices = [
                _Ref("const", value=np.asarray(r.value))
                if r.kind == "const" and isinstance(r.value, (bool, int, float, complex))
                else r
                for r in operands[1:]
            ]
            return _where, [condition, *choices], (), False
        raise TypeError(f"unknown node {node!r}")

    @staticmethod
    def _bool_condition(
        where: Where, operand: _Ref, values: dict[int, Any], plan: _Plan, scratch: list[int]
    ) -> _Ref:
        """The condition of a where as booleans (truth of each value, NaN is true)."""
        value = values[id(where.cond)]
        if operand.kind == "const":
            if isinstance(value, np.ndarray):
                return _Ref("const", value=value.astype(bool))
            return _Ref("const", value=bool(value))
        if value.dtype == bool:
            return operand
        reg = plan.register((np.dtype(bool), tuple(value.shape[1:])), list(plan.free))
        plan.steps.append(_Step(_cast, (operand,), reg, (), where))
        scratch.append(reg)
        return _Ref("reg", reg)

    def expression_at(self, code: Any, lineno: int) -> Expr | None:
        """The expression node whose step a frame of this program's generated function
        (``code`` at line ``lineno``) was running; None for another frame."""
        if code is not self._function.__code__:
            return None
        return self._exprs.get(lineno)

    def _plan_wide(self, input_row_shapes: Sequence[tuple[int, ...]]) -> None:
        """Decide whether the wide view pays (see the module docstring) and tile the
        constants for it; ``self.fold`` is the number of rows per wide row, 1 for none."""
        row_shape = self.row_shape
        self.row_elements = math.prod(row_shape)
        self.fold = 1
        self.width = self.row_elements
        self._wide_consts: list[Any] = []
        self._tails: dict[int, list[Any]] = {}
        row_vectors = any(isinstance(c, np.ndarray) and c.size > 1 for c in self._consts)
        same_rows = all(tuple(s) == row_shape for s in input_row_shapes) and all(
            shape == row_shape for _, shape in self.specs
        )
        if not (row_shape and row_vectors and same_rows):
            return
        fold = min(wide_fold(self.row_elements, _WIDE_ELEMENTS), self.sub_rows)
        if fold < 2:
            return
        self.fold = fold
        self.width = fold * self.row_elements
        self._wide_consts = [_tile(c, row_shape, fold) for c in self._consts]

    def _tail_consts(self, elements: int) -> list[Any]:
        """The tiled constants cut to the first ``elements`` elements (cached per size)."""
        found = self._tails.get(elements)
        if found is None:
            if len(self._tails) >= _CACHED_VIEWS:
                self._tails.clear()
            found = [
                c[:elements] if isinstance(c, np.ndarray) and c.ndim else c
                for c in self._wide_consts
            ]
            self._tails[elements] = found
        return found

    def run(
        self,
        blocks: Sequence[np.ndarray],
        rows: int,
        out: np.ndarray | None,
        held: _Held,
        sink: Callable[[np.ndarray, int, int], None] | None,
    ) -> None:
        """Evaluate sub-block by sub-block; ``sink(result, start, stop)`` sees each result.

        The result a sink sees holds rows ``[start, stop)``, C-contiguous in row order:
        narrow ``(stop - start, *row_shape)``, or, on the wide path, a ``(-1, width)`` view
        or a flat piece of the same elements. A block of at most ``sub_rows`` rows reaches
        the sink once, narrow. The result lives in scratch that the next call reuses.
        """
        if out is None and not self.keeps_root:
            raise ValueError("this program writes its result into an output block; pass out")
        if (
            self.fold > 1
            and all(b.flags.c_contiguous for b in blocks)
            and (out is None or out.flags.c_contiguous)
        ):
            self._run_wide(blocks, rows, out, held, sink)
        else:
            self._run_narrow(blocks, rows, out, held, sink)

    def evaluate(self, blocks: Sequence[np.ndarray], rows: int, held: _Held) -> np.ndarray:
        """The result of a block of at most ``sub_rows`` rows, ``(rows, *row_shape)``: a
        view of scratch that the next call reuses (or of an input block)."""
        if self.fold > 1 and all(b.flags.c_contiguous for b in blocks):
            self._run_wide(blocks, rows, None, held, None)
            regs = held.narrow(rows)
        else:
            regs = held.narrow(rows)
            self._function(blocks, regs, None, self._consts)
        return blocks[self.result.index] if self._result_is_input else regs[self.result.index]

    def _run_narrow(
        self,
        blocks: Sequence[np.ndarray],
        rows: int,
        out: np.ndarray | None,
        held: _Held,
        sink: Callable[[np.ndarray, int, int], None] | None,
    ) -> None:
        program, consts, step = self._function, self._consts, self.sub_rows
        index, from_input = self.result.index, self._result_is_input
        if rows <= step:  # one sub-block: nothing to slice
            regs = held.narrow(rows)
            program(blocks, regs, out, consts)
            if sink is not None:
                sink(blocks[index] if from_input else regs[index], 0, rows)
            return
        regs = held.narrow(step)
        for start in range(0, rows, step):
            stop = start + step
            if stop > rows:
                stop = rows
                regs = held.narrow(rows - start)
            ins = [b[start:stop] for b in blocks]
            program(ins, regs, None if out is None else out[start:stop], consts)
            if sink is not None:
                sink(ins[index] if from_input else regs[index], start, stop)

    def _run_wide(
        self,
        blocks: Sequence[np.ndarray],
        rows: int,
        out: np.ndarray | None,
        held: _Held,
        sink: Callable[[np.ndarray, int, int], None] | None,
    ) -> None:
        program, fold, width = self._function, self.fold, self.width
        index, from_input = self.result.index, self._result_is_input
        flats = [b.reshape(-1) for b in blocks]
        flat_out = None if out is None else out.reshape(-1)
        whole = rows - rows % fold
        end = whole * self.row_elements
        one = rows <= self.sub_rows  # one sub-block: the sink sees the whole result at once
        if whole:
            n = whole // fold
            wide_ins = [f[:end].reshape(n, width) for f in flats]
            wide_out = None if flat_out is None else flat_out[:end].reshape(n, width)
            consts, step = self._wide_consts, self.sub_rows // fold
            regs = held.wide(min(step, n))
            for a in range(0, n, step):
                b = a + step
                if b > n:
                    b = n
                    regs = held.wide(n - a)
                ins = wide_ins if b - a == n else [w[a:b] for w in wide_ins]
                program(ins, regs, None if wide_out is None else wide_out[a:b], consts)
                if sink is not None and not one:
                    sink(ins[index] if from_input else regs[index], a * fold, b * fold)
        if whole < rows:
            elements = (rows - whole) * self.row_elements
            ins = flats if not whole else [f[end:] for f in flats]
            # After a single wide piece the rest goes right behind it in the registers,
            # so that the result is one contiguous run of rows.
            regs = held.flat(elements, end if one else 0)
            target = None if flat_out is None else flat_out[end:]
            program(ins, regs, target, self._tail_consts(elements))
            if sink is not None and not one:
                sink(ins[index] if from_input else regs[index], whole, rows)
        if sink is not None and one:
            sink(blocks[index] if from_input else held.narrow(rows)[index], 0, rows)


class _Held:
    """One thread's registers: flat buffers, and views of them cached by piece size."""

    __slots__ = ("_shapes", "_views", "_width", "buffers", "rows")

    def __init__(
        self, specs: list[tuple[np.dtype, tuple[int, ...]]], rows: int, width: int
    ) -> None:
        self.rows = rows
        self._shapes = [shape for _, shape in specs]
        self._width = width
        self.buffers = [np.empty(rows * math.prod(shape), dtype) for dtype, shape in specs]
        self._views: dict[tuple[int, int, int], list[np.ndarray]] = {}

    def _cached(self, key: tuple[int, int, int]) -> list[np.ndarray] | None:
        if len(self._views) >= _CACHED_VIEWS:
            self._views.clear()
        return self._views.get(key)

    def narrow(self, rows: int) -> list[np.ndarray]:
        """Views of ``rows`` rows in each register's own row shape."""
        views = self._cached((0, rows, 0))
        if views is None:
            views = [
                buf[: rows * math.prod(shape)].reshape((rows, *shape))
                for buf, shape in zip(self.buffers, self._shapes, strict=True)
            ]
            self._views[(0, rows, 0)] = views
        return views

    def wide(self, n: int) -> list[np.ndarray]:
        """Views of ``n`` wide rows of the kernel's width."""
        views = self._cached((1, n, 0))
        if views is None:
            views = [buf[: n * self._width].reshape(n, self._width) for buf in self.buffers]
            self._views[(1, n, 0)] = views
        return views

    def flat(self, elements: int, offset: int = 0) -> list[np.ndarray]:
        """Flat views of ``elements`` elements from element ``offset`` on."""
        views = self._cached((2, elements, offset))
        if views is None:
            views = [buf[offset : offset + elements] for buf in self.buffers]
            self._views[(2, elements, offset)] = views
        return views


class _Scratch:
    """Per-thread scratch registers of one kernel.

    ``get`` and ``clear`` may run on any thread; the lock guards changes to the table
    (a lookup is one dict read), and a thread's buffers are used by that thread alone.
    """

    def __init__(
        self, specs: list[tuple[np.dtype, tuple[int, ...]]], max_rows: int, width: int
    ) -> None:
        self._specs = specs
        self._max_rows = max_rows
        self._width = width
        self._lock = threading.Lock()
        self._by_thread: dict[int, _Held] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Buffers are this process's own: a kernel travels (to a worker process) bare.
        return {"specs": self._specs, "max_rows": self._max_rows, "width": self._width}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["specs"], state["max_rows"], state["width"])  # type: ignore[misc]

    def get(self, rows: int) -> _Held:
        """This thread's registers with room for ``rows`` rows (grown when needed)."""
        ident = threading.get_ident()
        held = self._by_thread.get(ident)
        if held is not None and (held.rows >= min(rows, self._max_rows) or not self._specs):
            return held
        held = _Held(self._specs, min(max(rows, 1), self._max_rows), self._width)
        with self._lock:
            self._by_thread[ident] = held
        return held

    def nbytes(self) -> int:
        """Bytes of scratch held, all threads together."""
        with self._lock:
            return sum(b.nbytes for held in self._by_thread.values() for b in held.buffers)

    def clear(self) -> int:
        """Drop every thread's buffers; returns the bytes dropped."""
        with self._lock:
            held = sum(b.nbytes for h in self._by_thread.values() for b in h.buffers)
            self._by_thread.clear()
        return held


def _narrow(value: np.ndarray, rows: int, row_shape: tuple[int, ...]) -> np.ndarray:
    """A sink's value as ``(rows, *row_shape)`` (a view: the value is C-contiguous)."""
    if value.shape[0] == rows and value.ndim == len(row_shape) + 1:
        return value
    return value.reshape((rows, *row_shape))


class FusedKernel:
    """An elementwise expression as a :class:`~tierflow.operators.types.BlockOp`.

    ``input_dtypes`` and ``input_row_shapes`` describe the blocks ``apply`` will get, one
    per input index. ``epilogue`` is an optional single-input block op applied to each
    sub-block's result (its input dtype and row shape must be the expression's).
    Construction raises what NumPy's type resolution raises (see
    :func:`~tierflow.operators.elementwise.infer`).

    >>> from tierflow.operators.elementwise import Input, call
    >>> k = FusedKernel(call(np.sqrt, Input(0) * 2 + 1), [np.float32], [(8,)])
    >>> k.apply(np.zeros((3, 8), np.float32))[0, :2]
    array([1., 1.], dtype=float32)
    """

    row_independent = True

    def __init__(
        self,
        expr: Expr,
        input_dtypes: Sequence[Any],
        input_row_shapes: Sequence[tuple[int, ...]],
        *,
        epilogue: BlockOp | None = None,
        subblock_bytes: int = SUBBLOCK_BYTES,
    ) -> None:
        self.expr = expr
        self.input_dtypes = [np.dtype(d) for d in input_dtypes]
        self.input_row_shapes = [tuple(int(n) for n in s) for s in input_row_shapes]
        self.n_inputs = len(self.input_dtypes)
        self._program = _Program(
            expr, self.input_dtypes, self.input_row_shapes, subblock_bytes, epilogue is not None
        )
        self.expr_dtype: np.dtype = self._program.dtype
        self.expr_row_shape: tuple[int, ...] = self._program.row_shape
        self.epilogue = epilogue
        if epilogue is not None:
            _check_consumer(epilogue, self.expr_dtype, self.expr_row_shape, "epilogue")
            self.out_dtype: np.dtype = np.dtype(epilogue.out_dtype)
            self.out_row_shape: tuple[int, ...] = tuple(epilogue.out_row_shape)
        else:
            self.out_dtype = self.expr_dtype
            self.out_row_shape = self.expr_row_shape
        self.subblock_bytes = subblock_bytes
        self.sub_rows = self._program.sub_rows
        self._scratch = _Scratch(self._program.specs, self.sub_rows, self._program.width)
        # The compiled form of a kernel without an epilogue (a
        # tierflow.operators.compiled.CompiledSlot), attached by the engine; or why
        # there is none.
        self.compiled: Any = None
        self.not_compiled: str | None = None

    def __repr__(self) -> str:
        tail = f" -> {self.epilogue!r}" if self.epilogue is not None else ""
        return f"FusedKernel({self.expr!r}{tail}, {self.sub_rows} rows per sub-block)"

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Evaluate on one set of row blocks; writes into ``out`` when given.

        Raises ValueError for blocks that do not match the kernel's dtypes and row shapes,
        or an ``out`` of the wrong shape or dtype or overlapping an input.
        """
        rows = check_blocks(blocks, self.input_dtypes, self.input_row_shapes, "FusedKernel")
        result = prepare_out(
            out, (rows, *self.out_row_shape), self.out_dtype, blocks, "FusedKernel"
        )
        if rows == 0:
            return result
        compiled = self.compiled
        if compiled is not None and compiled.apply(blocks, rows, result):
            return result
        held = self._scratch.get(rows)
        epilogue = self.epilogue
        if epilogue is None:
            self._program.run(blocks, rows, result, held, None)
        elif rows <= self.sub_rows:
            epilogue.apply(self._program.evaluate(blocks, rows, held), out=result)
        else:
            row_shape = self.expr_row_shape

            def sink(value: np.ndarray, start: int, stop: int) -> None:
                epilogue.apply(_narrow(value, stop - start, row_shape), out=result[start:stop])

            self._program.run(blocks, rows, None, held, sink)
        return result

    def expression_at(self, code: Any, lineno: int) -> Expr | None:
        """The expression node a frame (its ``code`` at ``lineno``) of this kernel's
        generated code was evaluating, or None: what a floating-point warning or error
        raised there is about (see :mod:`tierflow.engine.program.float_errors`)."""
        return self._program.expression_at(code, lineno)

    def temp_bytes(self, rows: int) -> int:
        """Scratch bytes of one ``apply`` on ``rows`` rows (registers, epilogue scratch)."""
        sub = min(rows, self.sub_rows)
        registers = sum(sub * math.prod(s) * d.itemsize for d, s in self._program.specs)
        if self.epilogue is not None:
            registers += self.epilogue.temp_bytes(sub)
        return registers

    def scratch_bytes(self) -> int:
        """Bytes of scratch the kernel holds now, all threads together."""
        return self._scratch.nbytes()

    def release_scratch(self) -> int:
        """Drop the scratch of every thread (it is reallocated on next use); bytes dropped."""
        return self._scratch.clear()


class FusedReduction:
    """A fused elementwise expression followed by a reduction over rows: a ReductionOp.

    ``chunk`` evaluates the kernel sub-block by sub-block and folds each sub-block's
    result into the partial, so no block-sized intermediate exists: the built-in
    reductions of :mod:`~tierflow.operators.reductions` keep running per-lane partials
    and fold them once per block, other reductions get ``chunk`` then ``combine`` per
    sub-block. ``combine`` and ``aggregate`` are the reduction's.
    """

    row_independent = False

    def __init__(self, kernel: FusedKernel, reduction: ReductionOp) -> None:
        if kernel.epilogue is not None:
            raise ValueError("a FusedReduction takes a kernel without an epilogue")
        if reduction.row_independent:
            raise ValueError(
                f"{reduction!r} reduces trailing axes only; pass it as the kernel's epilogue"
            )
        _check_consumer(reduction, kernel.out_dtype, kernel.out_row_shape, "reduction")
        self.kernel = kernel
        self.reduction = reduction
        # The kernel's own program writes its last step into the output block; this one
        # keeps the last value in a register for the reduction to read.
        self._program = _Program(
            kernel.expr,
            kernel.input_dtypes,
            kernel.input_row_shapes,
            kernel.subblock_bytes,
            keep_root=True,
        )
        self._scratch = _Scratch(self._program.specs, self._program.sub_rows, self._program.width)
        self._builtin = reduction if isinstance(reduction, RowReduction) else None
        self.n_inputs = kernel.n_inputs
        self.out_dtype = reduction.out_dtype
        self.out_shape = reduction.out_shape
        self.commutative = reduction.commutative
        # The compiled form (a tierflow.operators.compiled.CompiledSlot), attached by
        # the engine; or why there is none.
        self.compiled: Any = None
        self.not_compiled: str | None = None

    def __repr__(self) -> str:
        return f"FusedReduction({self.kernel.expr!r} -> {self.reduction!r})"

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """The reduction's partial of ``expr(blocks)``; None for blocks without rows."""
        kernel = self.kernel
        rows = check_blocks(blocks, kernel.input_dtypes, kernel.input_row_shapes, "FusedReduction")
        if rows == 0:
            return None
        held = self._scratch.get(rows)
        program = self._program
        compiled = self.compiled
        if compiled is not None:

            def head(n: int) -> np.ndarray:
                return program.evaluate([b[:n] for b in blocks], n, held)

            found = compiled.partial(blocks, rows, head, int(row_offset))
            if found is not None:
                return found
        builtin = self._builtin
        # The blocks were checked above; a built-in reduction's own chunk would check the
        # values again on every sub-block.
        reduce = builtin._chunk if builtin is not None else self._chunk_checked
        if rows <= program.sub_rows:  # the reduction's chunk of the one result
            return reduce(program.evaluate(blocks, rows, held), row_offset)
        accumulator = builtin._accumulator(rows) if builtin is not None else None
        if accumulator is not None:
            program.run(blocks, rows, None, held, accumulator.add)
            return accumulator.partial()
        combine = self.reduction.combine
        row_shape = program.row_shape
        partial: Partial = None

        def sink(value: np.ndarray, start: int, stop: int) -> None:
            nonlocal partial
            piece = reduce(_narrow(value, stop - start, row_shape), row_offset + start)
            partial = piece if partial is None else combine(partial, piece)

        program.run(blocks, rows, None, held, sink)
        return partial

    def expression_at(self, code: Any, lineno: int) -> Expr | None:
        """:meth:`FusedKernel.expression_at` for this reduction's own program."""
        return self._program.expression_at(code, lineno)

    def _chunk_checked(self, block: np.ndarray, row_offset: int) -> Partial:
        return self.reduction.chunk(block, row_offset=row_offset)

    def combine(self, a: Partial, b: Partial) -> Partial:
        """The reduction's combine."""
        return self.reduction.combine(a, b)

    def aggregate(self, partial: Partial) -> Any:
        """The reduction's aggregate."""
        return self.reduction.aggregate(partial)

    def temp_bytes(self, rows: int) -> int:
        """Kernel registers, plus the reduction's scratch and partials for one sub-block."""
        sub = min(rows, self._program.sub_rows)
        registers = sum(sub * math.prod(s) * d.itemsize for d, s in self._program.specs)
        return registers + self.reduction.temp_bytes(sub) + 2 * self.reduction.partial_bytes()

    def partial_bytes(self) -> int:
        """The reduction's partial size."""
        return self.reduction.partial_bytes()

    def scratch_bytes(self) -> int:
        """Bytes of scratch held now, all threads together."""
        return self._scratch.nbytes()

    def release_scratch(self) -> int:
        """Drop the scratch of every thread; returns the bytes dropped."""
        return self._scratch.clear()


def _check_consumer(op: Any, dtype: np.dtype, row_shape: tuple[int, ...], what: str) -> None:
    """ValueError unless ``op`` takes one input of ``dtype`` and ``row_shape``."""
    if op.n_inputs != 1:
        raise ValueError(f"the {what} must take one input, {op!r} takes {op.n_inputs}")
    in_dtype = getattr(op, "in_dtype", None)
    in_row_shape = getattr(op, "in_row_shape", None)
    if (in_dtype is not None and np.dtype(in_dtype) != dtype) or (
        in_row_shape is not None and tuple(in_row_shape) != row_shape
    ):
        raise ValueError(
            f"the {what} {op!r} was built for blocks of dtype {in_dtype} and row shape "
            f"{in_row_shape}, but the expression gives dtype {dtype} and row shape {row_shape}"
        )
