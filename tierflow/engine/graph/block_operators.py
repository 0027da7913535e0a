"""Block operators the engine adds to :mod:`tierflow.operators`: user functions, reshapes,
trailing-axis stacking, multi-output ufuncs, and the reductions behind ``head`` and
materialising a small array.

They follow the operators layer's contracts (:mod:`tierflow.operators.types`): a
``BlockOp`` maps a row block to a row block of the same number of rows, a
``ReductionOp`` is chunk / combine / aggregate.
"""

from __future__ import annotations

import math
import operator
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np

from ...config import MB
from ...operators import byteorder
from ...operators.types import Partial, block_bytes, combine_partials
from ..gpu import transfer
from ..gpu.tier import current_device

__all__ = [
    "ALONG_AXIS",
    "CPU_BATCH_BYTES",
    "AlongAxis",
    "Collect",
    "Head",
    "MapBlocks",
    "Reshape",
    "Stack",
    "UfuncOutput",
    "batch_rows",
    "has_torch",
    "numpy_dtype",
    "to_device",
    "to_host",
]


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def to_host(value: Any, device: str | None = None) -> Any:
    """A torch tensor as a NumPy array (copied off the GPU if it is there); else ``value``.
    ``device`` (``"cuda:N"``) is where the tensor is, for the copy counts
    (:func:`tierflow.engine.gpu.transfer.stats`) of a simulated GPU."""
    if _is_tensor(value):
        where = device if device and device.startswith("cuda") else None
        if value.is_cuda:
            where = f"cuda:{value.device.index}"
        array = value.detach().cpu().numpy()
        if where is not None:
            transfer.count(where, d2h=1, d2h_bytes=array.nbytes)
        return array
    return value


def has_torch() -> bool:
    """Whether torch imports in this process (importing it): what ``device="auto"``
    needs to hand a function tensors rather than NumPy blocks."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def to_device(block: Any, device: str) -> Any:
    """A NumPy block as a torch tensor on ``device`` (a tensor is moved if needed); a
    simulated GPU's tensors are the CPU's (:func:`tierflow.engine.gpu.transfer.torch_device`).
    A copy to a GPU is counted (:func:`tierflow.engine.gpu.transfer.stats`)."""
    import torch

    target: Any = device
    if device.startswith("cuda"):
        target = transfer.torch_device(device)
    if _is_tensor(block):
        moved = block.to(target)
    else:
        array = np.asarray(block)
        if not (array.flags.writeable and array.flags.c_contiguous and array.dtype.isnative):
            # torch shares the buffer, warns about read-only memory (a file's pages) and
            # has no other byte order; one copy avoids all three, and the copy to the GPU
            # costs it anyway.
            array = np.array(array, dtype=byteorder.native_dtype(array.dtype), order="C")
        moved = torch.from_numpy(array).to(target, non_blocking=False)
    if device.startswith("cuda") and moved is not block:
        transfer.count(device, h2d=1, h2d_bytes=moved.nbytes)
    return moved


# Input bytes of one call of a function on torch tensors on the CPU (see batch_rows).
CPU_BATCH_BYTES = 1 * MB


def batch_rows(blocks: Sequence[Any]) -> int:
    """Rows per call of a ``map_blocks`` function on torch tensors on the CPU: as many as
    make :data:`CPU_BATCH_BYTES` of input (at least one).

    A model on the CPU runs fastest on batches whose activations stay in the caches, and
    a block is made for reading, up to 32 MB. A small convolutional net (two 3x3
    convolutions over 3x32x32 samples, 2 torch threads, 2 cores) ran 15,600-17,100
    samples/s on batches of 32 to 256 samples (0.4 to 3 MB), 7,400 on 512 and 6,200-6,800
    on 1,024 to 4,096; the default block of ``from_files`` held 2,500 of them. So the
    engine calls the function on pieces of a block, as a DataLoader's batches would be;
    ``map_blocks`` functions treat rows independently, so the pieces give the rows the
    whole block would. A GPU gets whole blocks: it wants big batches.
    """
    row = sum(numpy_dtype(b).itemsize * math.prod(b.shape[1:]) for b in blocks)
    return max(1, CPU_BATCH_BYTES // max(1, row))


def numpy_dtype(value: Any) -> np.dtype:
    """The NumPy dtype of an array or a torch tensor."""
    if _is_tensor(value):
        import torch

        try:
            return torch.empty(0, dtype=value.dtype).numpy().dtype
        except TypeError as exc:
            raise TypeError(
                f"a {value.dtype} tensor has no NumPy dtype; convert it (e.g. .float()) "
                "before returning it"
            ) from exc
    return np.asarray(value).dtype


def _shape_text(rows: Any, row_shape: tuple[int, ...]) -> str:
    return "(" + ", ".join([str(rows), *map(str, row_shape)]) + ("," if not row_shape else "") + ")"


@dataclass(eq=False, repr=False)
class MapBlocks:
    """``fn(*blocks, **kwargs)`` on row blocks: a user function as a BlockOp.

    ``device`` None gives ``fn`` NumPy blocks; ``"cpu"`` or ``"cuda:N"`` gives it torch
    tensors there; ``"cuda"`` on the GPU the scheduler seated the task on; ``"auto"``
    there too when the scheduler seated it, else resolved on the first block
    (:meth:`_resolve`). The result must have the blocks' number of rows,
    ``out_row_shape`` and a dtype that casts to ``out_dtype`` (``same_kind``); otherwise
    ValueError names both shapes or dtypes (the engine adds the block).
    """

    row_independent = True

    fn: Callable[..., Any]
    n_inputs: int
    out_dtype: np.dtype
    out_row_shape: tuple[int, ...]
    _: KW_ONLY
    device: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    name: str = "map_blocks"

    def __post_init__(self) -> None:
        self.out_dtype = np.dtype(self.out_dtype)
        self.out_row_shape = tuple(self.out_row_shape)

    def __repr__(self) -> str:
        where = f" on {self.device}" if self.device else ""
        return f"MapBlocks({self.name}{where})"

    def apply(self, *blocks: Any, out: np.ndarray | None = None) -> np.ndarray:
        """The function's result for these blocks, checked, as a NumPy block; on torch
        tensors on the CPU, from calls on pieces of :func:`batch_rows` rows."""
        device = self.device
        if device in ("cuda", "auto"):
            # The GPU the scheduler seated this task on, when it did (engine.gpu_tier).
            device = current_device() or device
        if device == "auto":
            device = self._resolve(blocks)
        rows = int(blocks[0].shape[0])
        step = batch_rows(blocks) if device == "cpu" else rows
        if step >= rows:
            return self._call(blocks, device, out)
        if out is None:
            out = np.empty((rows, *self.out_row_shape), self.out_dtype)
        for a in range(0, rows, step):
            self._call([b[a : a + step] for b in blocks], device, out[a : a + step])
        return out

    def _call(self, blocks: Sequence[Any], device: str | None, out: np.ndarray | None) -> Any:
        """The function on ``blocks`` as they are, on ``device``: checked, cast, in ``out``
        when given."""
        if device:
            args = [to_device(b, device) for b in blocks]
        else:
            # A memory-mapped block goes to the function as a plain array view of the
            # same pages: np.memmap's indexing runs in Python (2.4 us for block[i]
            # against 0.3 us), which a function looping over rows pays on every row.
            args = [b.view(np.ndarray) if isinstance(b, np.memmap) else b for b in blocks]
        result = self.fn(*args, **self.kwargs)
        result = to_host(result, device)
        if not isinstance(result, np.ndarray):
            result = np.asarray(result)
        self._check(tuple(blocks[0].shape), tuple(result.shape), result.dtype)
        if result.dtype != self.out_dtype:
            if out is not None:
                np.copyto(out, result, casting="same_kind")
                return out
            return result.astype(self.out_dtype)
        if out is not None:
            np.copyto(out, result)
            return out
        return result

    def apply_tensors(self, *tensors: Any) -> Any:
        """The function's result for blocks that are torch tensors on one device, as a
        tensor of ``out_dtype`` there, checked as :meth:`apply` checks: nothing comes
        back to the host (a chain of GPU operators keeps its blocks on the GPU)."""
        import torch

        result = self.fn(*tensors, **self.kwargs)
        if not _is_tensor(result):
            result = torch.as_tensor(np.asarray(result), device=tensors[0].device)
        self._check(tuple(tensors[0].shape), tuple(result.shape), numpy_dtype(result))
        target = torch.from_numpy(np.empty(0, byteorder.native_dtype(self.out_dtype))).dtype
        return result if result.dtype == target else result.to(target)

    def _check(self, block_shape: tuple[int, ...], shape: tuple[int, ...], dtype: np.dtype) -> None:
        """ValueError unless a result of ``shape`` and ``dtype`` fits a block of
        ``block_shape`` (see the class docstring)."""
        rows = block_shape[0]
        if len(shape) == 0 or shape[0] != rows or shape[1:] != self.out_row_shape:
            got = "a scalar" if len(shape) == 0 else f"shape {shape}"
            raise ValueError(
                f"{self.name} returned {got} for a block of shape {block_shape}; it must "
                f"return shape {_shape_text(rows, self.out_row_shape)}: one row per input "
                "row, with the row shape declared (row_shape=) or found on the probe block"
            )
        if dtype != self.out_dtype and not np.can_cast(dtype, self.out_dtype, "same_kind"):
            raise ValueError(
                f"{self.name} returned {dtype}, which does not cast to the "
                f"declared {self.out_dtype} (casting='same_kind'); return "
                f"{self.out_dtype} or pass dtype={dtype}"
            )

    def _resolve(self, blocks: Sequence[Any]) -> str | None:
        """``device="auto"``: the GPU with the most free memory if it has room for the
        blocks and the result (twice over, for the function's own tensors), else the CPU
        (torch tensors there; NumPy blocks, None, in a process without torch). Decided
        on the first block and kept."""
        from ...system import devices

        if not has_torch():
            self.device = None
            return None
        need = 2 * sum(int(np.asarray(b).nbytes) for b in blocks) + 2 * block_bytes(
            blocks[0].shape[0], self.out_row_shape, self.out_dtype
        )
        self.device = devices.best_device(need / (1 << 30))
        return self.device

    def temp_bytes(self, rows: int) -> int:
        """Unknown for a user function: counted as one output block (its own result)."""
        return block_bytes(rows, self.out_row_shape, self.out_dtype)


ALONG_AXIS: dict[str, Callable[..., Any]] = {
    "sort": np.sort,
    "argsort": np.argsort,
    "cumsum": np.cumsum,
    "cumprod": np.cumprod,
    "nancumsum": np.nancumsum,
    "nancumprod": np.nancumprod,
    "diff": np.diff,
}
"""NumPy functions along one axis that lazy arrays run blockwise along a trailing axis."""


class AlongAxis:
    """``np.<name>(block, axis=axis, **kwargs)`` along a trailing axis of the block
    (``axis`` >= 1): every row's result depends on that row alone.

    The result's dtype and row shape are NumPy's, from a probe on one row of zeros, so
    bad keywords fail when the pipeline is built.
    """

    row_independent = True
    n_inputs = 1

    def __init__(
        self,
        name: str,
        in_dtype: Any,
        in_row_shape: tuple[int, ...],
        axis: int,
        kwargs: dict[str, Any],
    ) -> None:
        self.name = name
        self.function = ALONG_AXIS[name]
        self.axis = axis
        self.kwargs = kwargs
        self.in_dtype = np.dtype(in_dtype)
        self.in_row_shape = tuple(in_row_shape)
        probe = np.asarray(
            self.function(np.zeros((1, *in_row_shape), in_dtype), axis=axis, **kwargs)
        )
        self.out_dtype = probe.dtype
        self.out_row_shape = tuple(probe.shape[1:])

    def __repr__(self) -> str:
        return f"AlongAxis({self.name}, axis={self.axis})"

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        result = np.asarray(self.function(blocks[0], axis=self.axis, **self.kwargs))
        if out is not None:
            np.copyto(out, result)
            return out
        return result

    def temp_bytes(self, rows: int) -> int:
        """The result and as much again: a sort's scratch, NumPy's casting buffers."""
        return 2 * block_bytes(rows, self.out_row_shape, self.out_dtype)


class Reshape:
    """``block.reshape(rows, *row_shape)``: a new shape for the trailing axes."""

    row_independent = True
    n_inputs = 1

    def __init__(
        self, in_dtype: Any, in_row_shape: tuple[int, ...], row_shape: tuple[int, ...]
    ) -> None:
        self.in_dtype = np.dtype(in_dtype)
        self.in_row_shape = tuple(in_row_shape)
        self.out_dtype = self.in_dtype
        self.out_row_shape = tuple(row_shape)

    def __repr__(self) -> str:
        return f"Reshape({self.out_row_shape})"

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        result = blocks[0].reshape(blocks[0].shape[0], *self.out_row_shape)
        if out is not None:
            np.copyto(out, result)
            return out
        return result

    def temp_bytes(self, rows: int) -> int:
        return 0


class Stack:
    """``np.concatenate`` / ``np.stack`` of row-aligned blocks along a trailing axis."""

    row_independent = True

    def __init__(
        self,
        function: Callable[..., Any],
        axis: int,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
    ) -> None:
        self.function = function
        self.axis = axis
        self.n_inputs = len(dtypes)
        probe = function(
            [np.zeros((1, *s), d) for d, s in zip(dtypes, row_shapes, strict=False)], axis=axis
        )
        self.out_dtype = probe.dtype
        self.out_row_shape = tuple(probe.shape[1:])

    def __repr__(self) -> str:
        return f"Stack({self.function.__name__}, axis={self.axis})"

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        result = self.function(list(blocks), axis=self.axis)
        if out is not None:
            np.copyto(out, result)
            return out
        return result

    def temp_bytes(self, rows: int) -> int:
        return 0


@dataclass(frozen=True)
class UfuncCall:
    """Output ``index`` of ``ufunc(*operands, **kwargs)``.

    ``template`` lists the operands: None for the next block, a marker for the next of
    the values, anything else a constant; empty when every operand is a block."""

    ufunc: np.ufunc
    index: int
    kwargs: dict[str, Any]
    template: tuple[Any, ...] = ()


class UfuncOutput:
    """Output ``call.index`` of a ufunc with several outputs (``np.divmod``, ``np.modf``),
    on blocks of ``dtypes`` and ``row_shapes``, with ``values`` for the template's markers."""

    row_independent = True

    def __init__(
        self,
        call: UfuncCall,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any] = (),
    ) -> None:
        self.ufunc = call.ufunc
        self.index = call.index
        self.kwargs = call.kwargs
        self.n_inputs = len(dtypes)
        self.template = list(call.template) or [None] * len(dtypes)
        self.values = list(values)
        # Zeros stand in for values: np.divmod(0, 0) must not warn for the real data.
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            probe = self._call(
                [np.zeros((1, *s), d) for d, s in zip(dtypes, row_shapes, strict=False)]
            )
        self.out_dtype = probe.dtype
        self.out_row_shape = tuple(probe.shape[1:])

    def _call(self, blocks: Sequence[np.ndarray]) -> np.ndarray:
        items, values = iter(blocks), iter(self.values)
        args = [
            next(items) if t is None else next(values) if repr(t) == "<value>" else t
            for t in self.template
        ]
        return self.ufunc(*args, **self.kwargs)[self.index]

    def __repr__(self) -> str:
        return f"UfuncOutput({self.ufunc.__name__}[{self.index}])"

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        result = self._call(blocks)
        if out is not None:
            np.copyto(out, result)
            return out
        return result

    def temp_bytes(self, rows: int) -> int:
        return block_bytes(rows, self.out_row_shape, self.out_dtype)


class Head:
    """The first ``n`` rows, as a reduction (for arrays whose block sizes are unknown).

    Not commutative: partials of neighbouring blocks merge left before right, and a
    partial of the first blocks that already holds ``n`` rows is final
    (:meth:`complete`), so later blocks need not be computed.
    """

    row_independent = False
    commutative = False
    n_inputs = 1

    def __init__(self, n: int, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.n = n
        self.out_dtype = dtype
        self.row_shape = row_shape
        self.out_shape = None  # known once computed: min(n, rows)

    def __repr__(self) -> str:
        return f"Head({self.n})"

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        return np.array(blocks[0][: self.n])

    def combine(self, a: Partial, b: Partial) -> Partial:
        return combine_partials(a, b, self._topped_up)

    def _topped_up(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a`` and the first rows of ``b``, up to ``n`` rows."""
        if len(a) >= self.n:
            return a
        return byteorder.join([a, b[: self.n - len(a)]])

    def complete(self, partial: Partial) -> bool:
        """Whether ``partial`` (of a prefix of the blocks) already has the ``n`` rows."""
        return partial is not None and len(partial) >= self.n

    def aggregate(self, partial: Partial) -> Any:
        if partial is None:
            return np.empty((0, *self.row_shape), self.out_dtype)
        return partial

    def temp_bytes(self, rows: int) -> int:
        return self.partial_bytes()

    def partial_bytes(self) -> int:
        return block_bytes(self.n, self.row_shape, self.out_dtype)


class Collect:
    """Every row, as a reduction: the whole (small) array in memory.

    Used where a lazy array must become an in-memory operand (a broadcast constant).
    """

    row_independent = False
    commutative = False
    n_inputs = 1

    def __init__(self, dtype: np.dtype, row_shape: tuple[int, ...], n_rows: int | None) -> None:
        self.out_dtype = dtype
        self.row_shape = row_shape
        self.out_shape = None if n_rows is None else (n_rows, *row_shape)
        self.n_rows = n_rows

    def __repr__(self) -> str:
        return "Collect()"

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        return [np.array(blocks[0])]

    def combine(self, a: Partial, b: Partial) -> Partial:
        return combine_partials(a, b, operator.add)

    def aggregate(self, partial: Partial) -> Any:
        if not partial:
            return np.empty((0, *self.row_shape), self.out_dtype)
        return byteorder.join(partial) if len(partial) > 1 else partial[0]

    def temp_bytes(self, rows: int) -> int:
        return block_bytes(rows, self.row_shape, self.out_dtype)

    def partial_bytes(self) -> int:
        rows = self.n_rows if self.n_rows is not None else 1
        return block_bytes(rows, self.row_shape, self.out_dtype) + 64
