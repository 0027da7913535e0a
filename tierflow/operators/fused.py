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

A kernel can end in an *epilogue*: a single-input :class:`~tierflow.operators.types.BlockOp`
(a reduction over trailing axes, ``@ w``) applied to each sub-block's result, so the
full-width intermediate block never exists. :class:`FusedReduction` does the same for a
reduction over rows: each sub-block result is chunked and combined into the block's
partial at once (``np.sqrt(x*2+1).sum(axis=0)`` reads ``x`` once and allocates nothing
block-sized). Its float partials accumulate in float64, see
:mod:`tierflow.operators.reductions`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._blocks import check_blocks, prepare_out
from .elementwise import Apply, AsType, Clip, Expr, Input, Round, Where, infer, walk
from .types import BlockOp, Partial, ReductionOp

__all__ = ["SUBBLOCK_BYTES", "FusedKernel", "FusedReduction", "subblock_rows"]

SUBBLOCK_BYTES = 512 * 1024  # bytes of the widest temporary of one sub-block (see above)

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
    """Where an operand of a step comes from: an input block, a constant, or a register."""

    kind: str  # "input", "const" or "reg"
    index: int = 0
    value: Any = None


@dataclass(frozen=True)
class _Step:
    run: Callable[[list[Any], np.ndarray], None]
    operands: tuple[_Ref, ...]
    out: int  # register number, or _OUT


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


def _ufunc_step(node: Apply) -> Callable[[list[Any], np.ndarray], None]:
    ufunc, kwargs = node.ufunc, dict(node.kwargs)

    def run(args: list[Any], out: np.ndarray) -> None:
        ufunc(*args, out=out, **kwargs)

    return run


def _where_step(args: list[Any], out: np.ndarray) -> None:
    cond, a, b = args
    np.copyto(out, b, casting="unsafe")
    np.copyto(out, a, casting="unsafe", where=cond)


def _clip_step(node: Clip) -> Callable[[list[Any], np.ndarray], None]:
    has_lo, has_hi = node.lo is not None, node.hi is not None

    def run(args: list[Any], out: np.ndarray) -> None:
        values = iter(args)
        a = next(values)
        lo = next(values) if has_lo else None
        hi = next(values) if has_hi else None
        np.clip(a, lo, hi, out=out)

    return run


def _round_step(node: Round, in_dtype: np.dtype) -> Callable[[list[Any], np.ndarray], None]:
    decimals = node.decimals
    if in_dtype.kind in "biu" and decimals < 0:
        # NumPy rounds integers to tens and hundreds through a float division whose
        # result cannot be cast into an integer ``out=``; round first, then copy.
        def run(args: list[Any], out: np.ndarray) -> None:
            np.copyto(out, np.round(args[0], decimals))

    else:

        def run(args: list[Any], out: np.ndarray) -> None:
            np.round(args[0], decimals, out=out)

    return run


def _cast_step(args: list[Any], out: np.ndarray) -> None:
    np.copyto(out, args[0], casting="unsafe")


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
            run: Callable[[list[Any], np.ndarray], None]
            in_place = True
            if isinstance(node, Apply):
                run = _ufunc_step(node)
            elif isinstance(node, Clip):
                run = _clip_step(node)
            elif isinstance(node, Round):
                run = _round_step(node, spec(node.a)[0])
            elif isinstance(node, AsType):
                run, in_place = _cast_step, False
            elif isinstance(node, Where):
                run, in_place = _where_step, False
                operands[0] = self._bool_condition(node.cond, operands[0], values, plan, scratch)
            else:
                raise TypeError(f"unknown node {node!r}")
            if node is expr and not keep_root:
                out = _OUT
            else:
                # An elementwise ufunc may write over an operand that dies here (exact
                # overlap is safe in NumPy); where and astype read operands after writing.
                candidates = dying + plan.free if in_place else list(plan.free)
                out = plan.register(spec(node), candidates)
            plan.steps.append(_Step(run, tuple(operands), out))
            plan.free.extend(r for r in dying + scratch if r != out)
            refs[id(node)] = _Ref("reg", out)

        if not ops:  # the expression is one of its inputs
            if keep_root:
                self.result = ref(expr)
            else:
                plan.steps.append(_Step(_cast_step, (ref(expr),), _OUT))
                self.result = _Ref("reg", _OUT)
        else:
            self.result = refs[id(expr)]
        self.steps = plan.steps
        self.specs = plan.specs
        widest = max(
            [math.prod(s) * d.itemsize for d, s in plan.specs]
            + [math.prod(self.row_shape) * self.dtype.itemsize]
        )
        self.sub_rows = subblock_rows(widest, subblock_bytes)

    @staticmethod
    def _bool_condition(
        cond: Expr, operand: _Ref, values: dict[int, Any], plan: _Plan, scratch: list[int]
    ) -> _Ref:
        """The condition of a where as booleans (truth of each value, NaN is true)."""
        value = values[id(cond)]
        if operand.kind == "const":
            if isinstance(value, np.ndarray):
                return _Ref("const", value=value.astype(bool))
            return _Ref("const", value=bool(value))
        if value.dtype == bool:
            return operand
        reg = plan.register((np.dtype(bool), tuple(value.shape[1:])), list(plan.free))
        plan.steps.append(_Step(_cast_step, (operand,), reg))
        scratch.append(reg)
        return _Ref("reg", reg)

    def run(
        self,
        blocks: Sequence[np.ndarray],
        rows: int,
        out: np.ndarray | None,
        registers: list[np.ndarray],
        sink: Callable[[np.ndarray, int, int], None] | None,
    ) -> None:
        """Evaluate sub-block by sub-block; ``sink(result, start, stop)`` sees each result."""
        if out is None and not self.keeps_root:
            raise ValueError("this program writes its result into an output block; pass out")
        step_rows = self.sub_rows
        for start in range(0, rows, step_rows):
            stop = min(start + step_rows, rows)
            count = stop - start
            inputs = [b[start:stop] for b in blocks]
            regs = [r[:count] for r in registers]
            target = out[start:stop] if out is not None else None
            for step in self.steps:
                args = [
                    inputs[r.index]
                    if r.kind == "input"
                    else regs[r.index]
                    if r.kind == "reg"
                    else r.value
                    for r in step.operands
                ]
                step.run(args, target if step.out == _OUT else regs[step.out])  # type: ignore[arg-type]
            if sink is not None:
                result = self.result
                value = inputs[result.index] if result.kind == "input" else regs[result.index]
                sink(value, start, stop)


class _Scratch:
    """Per-thread scratch registers of one kernel.

    ``get`` and ``clear`` may run on any thread; the lock guards the table only, and a
    thread's buffers are used by that thread alone.
    """

    def __init__(self, specs: list[tuple[np.dtype, tuple[int, ...]]], max_rows: int) -> None:
        self._specs = specs
        self._max_rows = max_rows
        self._lock = threading.Lock()
        self._by_thread: dict[int, list[np.ndarray]] = {}

    def get(self, rows: int) -> list[np.ndarray]:
        """This thread's registers with room for ``rows`` rows (grown when needed)."""
        ident = threading.get_ident()
        with self._lock:
            buffers = self._by_thread.get(ident)
        if buffers is not None and (not buffers or buffers[0].shape[0] >= rows):
            return buffers
        rows = min(max(rows, 1), self._max_rows)
        buffers = [np.empty((rows, *shape), dtype=dtype) for dtype, shape in self._specs]
        with self._lock:
            self._by_thread[ident] = buffers
        return buffers

    def nbytes(self) -> int:
        """Bytes of scratch held, all threads together."""
        with self._lock:
            return sum(b.nbytes for buffers in self._by_thread.values() for b in buffers)

    def clear(self) -> int:
        """Drop every thread's buffers; returns the bytes dropped."""
        with self._lock:
            held = sum(b.nbytes for buffers in self._by_thread.values() for b in buffers)
            self._by_thread.clear()
        return held


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
        self._scratch = _Scratch(self._program.specs, self.sub_rows)

    def __repr__(self) -> str:
        tail = f" -> {self.epilogue!r}" if self.epilogue is not None else ""
        return f"FusedKernel({self.expr!r}{tail}, {self.sub_rows} rows per sub-block)"

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Evaluate on one set of row blocks; writes into ``out`` when given.

        Raises ValueError for blocks that do not match the kernel's dtypes and row shapes,
        or an ``out`` of the wrong shape or dtype or overlapping an input.
        """
        rows = check_blocks(blocks, self.input_dtypes, self.input_row_shapes, "FusedKernel")
        result = prepare_out(out, rows, self.out_row_shape, self.out_dtype, blocks, "FusedKernel")
        if rows == 0:
            return result
        registers = self._scratch.get(rows)
        epilogue = self.epilogue
        if epilogue is None:
            self._program.run(blocks, rows, result, registers, None)
        else:

            def sink(value: np.ndarray, start: int, stop: int) -> None:
                epilogue.apply(value, out=result[start:stop])

            self._program.run(blocks, rows, None, registers, sink)
        return result

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
    result into the partial (``reduction.chunk`` then ``reduction.combine``), so no
    block-sized intermediate exists. ``combine`` and ``aggregate`` are the reduction's.
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
        self._scratch = _Scratch(self._program.specs, self._program.sub_rows)
        self.n_inputs = kernel.n_inputs
        self.out_dtype = reduction.out_dtype
        self.out_shape = reduction.out_shape
        self.commutative = reduction.commutative

    def __repr__(self) -> str:
        return f"FusedReduction({self.kernel.expr!r} -> {self.reduction!r})"

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """The reduction's partial of ``expr(blocks)``; None for blocks without rows."""
        kernel = self.kernel
        rows = check_blocks(blocks, kernel.input_dtypes, kernel.input_row_shapes, "FusedReduction")
        if rows == 0:
            return None
        reduction = self.reduction
        partial: Partial = None

        def sink(value: np.ndarray, start: int, stop: int) -> None:
            nonlocal partial
            piece = reduction.chunk(value, row_offset=row_offset + start)
            partial = piece if partial is None else reduction.combine(partial, piece)

        self._program.run(blocks, rows, None, self._scratch.get(rows), sink)
        return partial

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
