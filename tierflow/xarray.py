"""tierflow under xarray: the ``"tierflow"`` chunk manager.

xarray hands chunked work to a chunk manager (``ChunkManagerEntrypoint``); installing
tierflow registers this one under the ``xarray.chunkmanagers`` entry point, so::

    ds = xr.open_zarr(path, chunked_array_type="tierflow", chunks={"time": 1000})
    ds = xr.open_dataset(path, chunked_array_type="tierflow", chunks={})
    ds = ds.chunk({"time": 1000}, chunked_array_type="tierflow")

give datasets whose variables are lazy tierflow arrays, and ``.compute()``,
``.load()``, ``.to_zarr()`` run them in one tierflow compute within the memory budget.

**Blocks along the first axis only.** tierflow cuts arrays into row blocks; trailing
axes are whole in every block. :meth:`TierflowManager.normalize_chunks` keeps the
chunks asked along each variable's first axis and makes every other axis one chunk;
a request to chunk a trailing axis as well as the first is merged, with one warning
that says why. A request that cuts only a trailing axis (``{"time": 100}`` on a
``(lat, time)`` variable) is refused with an error naming the variable and the
transpose to write: merged, the variable would be one block.

See docs/xarray.md for the workflows and what is refused.
"""

from __future__ import annotations

import math
import numbers
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from xarray.namedarray.parallelcompat import ChunkManagerEntrypoint

import tierflow as tw

from .engine.graph import blocksize

__all__ = ["TierflowManager"]

_warned: set[str] = set()  # what the one-time warnings said already


def _warn_once(key: str, text: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(text, UserWarning, stacklevel=4)


class TierflowManager(ChunkManagerEntrypoint[Any]):
    """The chunk manager of tierflow's lazy arrays (see the module docstring)."""

    available = True

    def __init__(self) -> None:
        self.array_cls = tw.Array

    # -- what xarray needs -------------------------------------------------------------

    def is_chunked_array(self, data: Any) -> bool:
        return isinstance(data, tw.Array)

    def chunks(self, data: Any) -> Any:
        return data.chunks

    def normalize_chunks(
        self,
        chunks: Any,
        shape: tuple[int, ...] | None = None,
        limit: int | None = None,
        dtype: Any = None,
        previous_chunks: Any = None,
    ) -> tuple[tuple[int, ...], ...]:
        """Chunks along the first axis as asked (a number of rows, each block's rows,
        ``"auto"``, -1 or None for one block), every other axis whole. A trailing axis
        asked in pieces other than those stored (``previous_chunks``) is merged, with one
        warning, where the first axis is asked in pieces too; where it is not, the
        request is refused (a ValueError naming the variable and its transpose)."""
        if shape is None:
            raise ValueError("normalize_chunks needs the array's shape")
        shape = tuple(int(n) for n in shape)
        if not shape:
            return ()
        if isinstance(chunks, dict):
            chunks = tuple(chunks.get(k, chunks.get(k - len(shape))) for k in range(len(shape)))
        elif not isinstance(chunks, (tuple, list)):
            chunks = (chunks,) * len(shape)
        elif (
            len(shape) == 1
            and len(chunks) > 1
            and all(isinstance(c, numbers.Integral) for c in chunks)
        ):
            chunks = (tuple(chunks),)  # each block's rows of a 1-D array
        if len(chunks) != len(shape):
            raise ValueError(
                f"chunks {chunks!r} give {len(chunks)} axes, the array has {len(shape)}"
            )
        previous = tuple(previous_chunks) if previous_chunks is not None else (None,) * len(shape)
        itemsize = np.dtype(dtype).itemsize if dtype is not None else 8
        row_bytes = itemsize * math.prod(shape[1:])
        rows = _row_sizes(chunks[0], shape[0], row_bytes, previous[0])
        cut = [
            axis
            for axis in range(1, len(shape))
            if not _whole(chunks[axis], shape[axis]) and not _same(chunks[axis], previous[axis])
        ]
        first_cut = chunks[0] == "auto" or not (
            _whole(chunks[0], shape[0]) or _same(chunks[0], previous[0])
        )
        if cut and not first_cut:
            raise ValueError(_not_first(shape, cut[0], chunks[cut[0]]))
        for axis in cut:
            asked = chunks[axis]
            _warn_once(
                f"trailing{axis}",
                f"tierflow cuts arrays into blocks along their first axis only: the chunks "
                f"asked along axis {axis} ({asked!r}) are merged, so each block holds that "
                f"axis whole ({shape[axis]}). Chunk the first axis instead, or transpose "
                "the dimension you want in pieces to the front.",
            )
        return (rows, *((n,) for n in shape[1:]))

    def from_array(self, data: Any, chunks: Any, **kwargs: Any) -> Any:
        """A lazy array over ``data`` (a NumPy array, or xarray's lazily indexed backend
        array, read block by block in the workers) in the blocks of ``chunks``."""
        shape = tuple(int(n) for n in data.shape)
        if not shape:
            return tw.from_array(np.asarray(data))
        normalized = self.normalize_chunks(chunks, shape, dtype=data.dtype)
        if isinstance(data, np.ndarray) or not hasattr(data, "__getitem__"):
            data = np.asarray(data)
        return tw.from_array(data, rows=normalized[0])

    def rechunk(self, data: Any, chunks: Any, **kwargs: Any) -> Any:
        normalized = self.normalize_chunks(chunks, data.shape, dtype=data.dtype)
        return data.rechunk((normalized[0], *normalized[1:])) if normalized else data

    def compute(self, *data: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Every lazy array in one compute (inputs they share read once)."""
        return tuple(tw.compute(*data, **_options(kwargs)))

    def persist(self, *data: Any, **kwargs: Any) -> tuple[Any, ...]:
        return tuple(tw.persist(d, **_options(kwargs)) for d in data)

    @property
    def array_api(self) -> Any:
        """NumPy: its functions take tierflow's lazy arrays (``__array_function__``)."""
        return np

    def get_auto_chunk_size(self) -> int:
        """Bytes of a block when none is asked: tierflow's own rule (budget-based, 1 to
        32 MB)."""
        return int(blocksize.default_rows(1))

    # -- operations ----------------------------------------------------------------------

    def reduction(  # noqa: PLR0913 -- xarray's signature
        self,
        arr: Any,
        func: Callable[..., Any],
        combine_func: Callable[..., Any] | None = None,
        aggregate_func: Callable[..., Any] | None = None,
        axis: int | Sequence[int] | None = None,
        dtype: Any = None,
        keepdims: bool = False,
    ) -> Any:
        """dask's ``reduction`` over the rows: ``func(block, axis=axis, keepdims=True)``
        on each block, ``combine_func`` (``func`` where None) on two partials stacked
        along the reduced axes, ``aggregate_func`` (``combine_func`` where None) at the
        end. Axes without the first are taken block by block."""
        axes = _axes(axis, arr.ndim)
        if 0 not in axes:
            return arr.map_blocks(
                lambda b: func(b, axis=axes, keepdims=keepdims), dtype=dtype or arr.dtype
            )
        combine = combine_func or func
        aggregate = aggregate_func or combine

        def chunk(block: np.ndarray) -> np.ndarray:
            return np.asarray(func(block, axis=axes, keepdims=True))

        def merge(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return np.asarray(combine(np.concatenate([a, b], axis=0), axis=axes, keepdims=True))

        def finish(partial: np.ndarray) -> np.ndarray:
            out = np.asarray(aggregate(partial, axis=axes, keepdims=keepdims))
            return out if dtype is None else out.astype(dtype, copy=False)

        shape = tuple(1 if k in axes else n for k, n in enumerate(arr.shape))
        if not keepdims:
            shape = tuple(n for k, n in enumerate(arr.shape) if k not in axes)
        return arr.reduction(chunk, merge, finish, dtype=dtype or arr.dtype, shape=shape)

    def scan(  # noqa: PLR0913 -- xarray's signature
        self,
        func: Callable[..., Any],
        binop: Callable[..., Any],
        ident: float,
        arr: Any,
        axis: int | None = None,
        dtype: Any = None,
        **kwargs: Any,
    ) -> Any:
        """dask's ``cumreduction`` along the rows: ``func`` on each block, then
        ``binop(carry, block's scan)`` with the carry of the blocks before it (the last
        row of their scans, or ``preop(block, axis=0, keepdims=True)`` when given)."""
        return tw.cumreduction(
            func,
            binop,
            ident,
            arr,
            axis=axis,
            dtype=dtype,
            method=kwargs.get("method", "sequential"),
            preop=kwargs.get("preop"),
        )

    def apply_gufunc(  # noqa: PLR0913 -- xarray's signature
        self,
        func: Callable[..., Any],
        signature: str,
        *args: Any,
        axes: Sequence[tuple[int, ...]] | None = None,
        axis: int | None = None,
        keepdims: bool = False,
        output_dtypes: Sequence[Any] | None = None,
        output_sizes: dict[str, int] | None = None,
        vectorize: bool | None = None,
        allow_rechunk: bool = False,
        meta: Any = None,
        **kwargs: Any,
    ) -> Any:
        """``func`` on row blocks, where the core dimensions are trailing axes: what
        ``xr.apply_ufunc(..., dask="parallelized")`` sends. A core dimension on the
        rows is refused (it would need every row at once)."""
        if axes is not None or axis is not None or keepdims:
            raise ValueError(
                "apply_gufunc: axes=, axis= and keepdims= are not supported; xarray moves "
                "the core dimensions last itself"
            )
        ins, outs = np.lib._function_base_impl._parse_gufunc_signature(signature)  # type: ignore[attr-defined]
        arrays = [a for a in args if isinstance(a, tw.Array)]
        if not arrays:
            return func(*args, **kwargs)
        first = arrays[0]
        core = len(ins[next(k for k, a in enumerate(args) if a is first)])
        if first.ndim - core < 1:
            raise ValueError(
                f"apply_gufunc: {signature}: the core dimensions take every axis of an "
                "input, its rows included; tierflow runs a function on row blocks, so the "
                "first dimension must be a loop dimension (not in input_core_dims). Reduce "
                "the rows with a reduction instead, or chunk another dimension first"
            )
        sizes = dict(output_sizes or {})
        for arg, dims in zip(args, ins, strict=True):
            shape = np.shape(arg)
            for k, name in enumerate(dims):
                sizes.setdefault(name, shape[len(shape) - len(dims) + k])
        loop = tuple(int(n) for n in first.shape[1 : first.ndim - core] if n is not None)
        rows = tuple(int(r) for r in first.chunks[0])
        blocks = [
            a
            if isinstance(a, tw.Array)
            else (
                tw.from_array(np.asarray(a), rows=rows)
                if np.ndim(a) == first.ndim - core + len(d) and np.shape(a)[0] == first.shape[0]
                else a
            )
            for a, d in zip(args, ins, strict=True)
        ]
        lazy = [k for k, a in enumerate(blocks) if isinstance(a, tw.Array)]
        run = np.vectorize(func, signature=signature) if vectorize else func
        dtypes = list(output_dtypes or [])
        results = []
        for j, dims in enumerate(outs):
            missing = [d for d in dims if d not in sizes]
            if missing:
                raise ValueError(f"apply_gufunc: give output_sizes for {missing}")

            def one(*parts: np.ndarray, j: int = j) -> Any:
                given = list(blocks)
                for k, part in zip(lazy, parts, strict=True):
                    given[k] = part
                out = run(*given, **kwargs)
                return out[j] if len(outs) > 1 else out

            row_shape = (*loop, *(int(sizes[d]) for d in dims))
            dtype = dtypes[j] if j < len(dtypes) else None
            source = blocks[lazy[0]]
            others = [blocks[k] for k in lazy[1:]]
            results.append(source.map_blocks(one, *others, dtype=dtype, row_shape=row_shape))
        return tuple(results) if len(outs) > 1 else results[0]

    def map_blocks(
        self,
        func: Callable[..., Any],
        *args: Any,
        dtype: Any = None,
        chunks: tuple[int, ...] | None = None,
        drop_axis: int | Sequence[int] | None = None,
        new_axis: int | Sequence[int] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``func`` on each row block of the arrays in ``args`` (the others passed as
        they are); the result's trailing shape from ``chunks`` when given, else from a
        probe block."""
        for axis in _axes(drop_axis, 99) + _axes(new_axis, 99):
            if axis == 0:
                raise ValueError(
                    "map_blocks: dropping or adding axis 0 would change the rows; tierflow "
                    "maps row blocks to row blocks"
                )
        arrays = [a for a in args if isinstance(a, tw.Array)]
        if not arrays:
            return func(*args, **kwargs)
        first = arrays[0]
        row_shape = None
        if chunks is not None:
            row_shape = tuple(int(c[0]) if isinstance(c, tuple) else int(c) for c in chunks[1:])
        positions = [k for k, a in enumerate(args) if isinstance(a, tw.Array)]

        def call(*blocks: np.ndarray) -> Any:
            given = list(args)
            for k, block in zip(positions, blocks, strict=True):
                given[k] = block
            return func(*given, **kwargs)

        return first.map_blocks(call, *arrays[1:], dtype=dtype, row_shape=row_shape)

    def blockwise(  # noqa: PLR0913 -- xarray's signature
        self,
        func: Callable[..., Any],
        out_ind: Iterable[Any],
        *args: Any,
        name: str | None = None,
        token: Any = None,
        dtype: Any = None,
        adjust_chunks: dict[Any, Callable[..., Any]] | None = None,
        new_axes: dict[Any, int] | None = None,
        align_arrays: bool = True,
        concatenate: bool | None = None,
        meta: Any = None,
        **kwargs: Any,
    ) -> Any:
        """dask's ``blockwise`` where every array's first index is the output's first
        (row blocks to row blocks); other patterns are refused with what to write."""
        out_ind = tuple(out_ind)
        pairs = list(zip(args[::2], args[1::2], strict=False))
        if not out_ind:
            raise ValueError("blockwise: an output without axes reduces the rows; use reduction")
        row = out_ind[0]
        for array, ind in pairs:
            if isinstance(array, tw.Array) and (ind is None or not ind or ind[0] != row):
                raise ValueError(
                    f"blockwise: an array indexed {ind} does not keep the rows ({row!r}) "
                    f"first, as the output {out_ind} does; tierflow maps row blocks to row "
                    "blocks: transpose the row dimension to the front"
                )
        values = [a for a, _ in pairs]
        return self.map_blocks(func, *values, dtype=dtype, **kwargs)

    def unify_chunks(self, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], list[Any]]:
        """The arrays (``args`` alternate array and index) in the first one's row
        blocks, and the chunks by index."""
        pairs = list(zip(args[::2], args[1::2], strict=False))
        arrays = [a for a, _ in pairs]
        lazy = [a for a in arrays if isinstance(a, tw.Array)]
        if not lazy:
            return {}, arrays
        rows = lazy[0].chunks[0]
        unified = [
            a.rechunk((rows, *((n,) for n in a.shape[1:])))
            if isinstance(a, tw.Array) and a.chunks[0] != rows
            else a
            for a in arrays
        ]
        found: dict[str, Any] = {}
        for array, ind in pairs:
            if isinstance(array, tw.Array) and ind:
                for k, name in enumerate(ind):
                    found.setdefault(name, rows if k == 0 else (array.shape[k],))
        return found, unified

    def store(self, sources: Any, targets: Any, **kwargs: Any) -> Any:
        """Each source written into its target's region (``ds.to_zarr``, regions and
        appends included), in one compute; see :func:`tierflow.store`."""
        return tw.store(
            sources,
            targets,
            kwargs.pop("regions", None),
            lock=kwargs.pop("lock", None),
            compute=kwargs.pop("compute", True),
            **_options({k: v for k, v in kwargs.items() if k != "flush"}),
        )


def _options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The compute options among what xarray passes on (``.compute(executor=...)``)."""
    known = ("progress", "executor", "workers", "callbacks", "cache", "device", "profile", "jit")
    unknown = set(kwargs) - set(known)
    if unknown:
        raise TypeError(
            f"tierflow computes take {', '.join(known)}; got {', '.join(sorted(unknown))}"
        )
    return kwargs


def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim)) if ndim != 99 else ()
    if isinstance(axis, (tuple, list)):
        return tuple(int(a) % ndim if ndim != 99 else int(a) for a in axis)
    return (int(axis) % ndim if ndim != 99 else int(axis),)


def _whole(asked: Any, length: int) -> bool:
    if asked in (None, -1, "auto"):
        return True
    if isinstance(asked, (tuple, list)):
        return tuple(int(c) for c in asked) == (length,)
    return isinstance(asked, numbers.Integral) and int(asked) >= length


def _not_first(shape: tuple[int, ...], axis: int, asked: Any) -> str:
    """The refusal of chunks that cut only axis ``axis`` of an array, not its first: it
    names the variable and the transpose to write where xarray's frames above say
    which (the chunk manager is handed neither)."""
    name, dims = _chunking_variable()
    if dims is None or len(dims) != len(shape):
        what, dim, first = f"an array of shape {shape}", f"axis {axis}", "axis 0"
        fix = f"np.moveaxis(data, {axis}, 0) (or xarray's .transpose(dim, ...))"
    else:
        dim, first = repr(dims[axis]), repr(dims[0])
        if isinstance(name, str):  # a DataArray's own chunk passes a placeholder name
            what = f"variable {name!r} {dims}"
            fix = f"ds[{name!r}].transpose({dim}, ...) (or ds.transpose({dim}, ...))"
        else:
            what, fix = f"an array {dims}", f"da.transpose({dim}, ...)"
    return (
        f"{what}: the chunks asked ({asked!r}) cut {dim}, which is not its first axis. "
        f"tierflow cuts blocks along the first axis only ({first}), so it "
        f"would be one block. Transpose first, then chunk: {fix}"
    )


def _chunking_variable() -> tuple[Any, Any]:
    """The name and dimensions of the variable xarray is chunking, read off its
    ``_maybe_chunk``, ``_chunk_ds`` (opening a dataset) or ``chunk`` frame further up
    the stack; (None, None) when none."""
    frame = sys._getframe(1)
    dims = None
    for _ in range(16):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            break
        local = frame.f_locals
        if dims is None and frame.f_code.co_name == "chunk" and hasattr(local.get("self"), "dims"):
            dims = tuple(local["self"].dims)
        if frame.f_code.co_name in ("_maybe_chunk", "_chunk_ds") and "var" in local:
            return local.get("name"), tuple(local["var"].dims)
    return None, dims


def _same(asked: Any, stored: Any) -> bool:
    """Whether ``asked`` is what the store holds (not asked by the user: xarray passes
    the stored chunks for dimensions the user left out)."""
    return stored is not None and asked == stored


def _row_sizes(asked: Any, n: int, row_bytes: int, stored: Any) -> tuple[int, ...]:
    """Each block's rows along the first axis, for ``asked``."""
    if n == 0:
        return (0,)
    if asked in (None, "auto"):
        rows = blocksize.default_rows(row_bytes, n)
        if isinstance(stored, numbers.Integral) and int(stored) > 0:  # whole stored chunks
            rows = max(int(stored), rows // int(stored) * int(stored))
        asked = rows
    if asked == -1:
        return (n,)
    if isinstance(asked, (tuple, list)):
        sizes = tuple(int(c) for c in asked)
        if sum(sizes) != n:
            raise ValueError(f"chunks {sizes} add up to {sum(sizes)}, not the {n} rows")
        return sizes
    step = int(asked)
    if step < 1:
        raise ValueError(f"chunks along the first axis must be at least 1 row, got {step}")
    return tuple(min(step, n - a) for a in range(0, n, step))


# -- the .tierflow accessor: what xarray does not hand to a chunk manager ------------------


class _Accessor:
    """``ds.tierflow`` / ``da.tierflow``: the fills along a dimension, lazily in two
    passes (``tw.ffill`` / ``tw.bfill``), where xarray's own ``ffill`` calls bottleneck
    on the whole array (it hands fills to dask alone)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def ffill(self, dim: str, limit: int | None = None) -> Any:
        """xarray's ``ffill(dim, limit)``: each NaN takes the last value before it
        along ``dim`` (within ``limit`` steps), for variables chunked by tierflow."""
        return self._fill(tw.ffill, "ffill", dim, limit)

    def bfill(self, dim: str, limit: int | None = None) -> Any:
        """xarray's ``bfill(dim, limit)``, as :meth:`ffill` the other way."""
        return self._fill(tw.bfill, "bfill", dim, limit)

    def _fill(self, fill: Callable[..., Any], name: str, dim: str, limit: int | None) -> Any:
        import xarray as xr

        def one(var: Any) -> Any:
            if dim not in var.dims:
                return var
            if not isinstance(var.data, tw.Array):
                return getattr(xr.DataArray(var), name)(dim, limit=limit).variable
            if var.get_axis_num(dim) != 0:
                raise ValueError(
                    f"{name}({dim!r}): tierflow fills along a variable's first dimension, and "
                    f"{dim!r} is not first in {var.dims}; transpose({dim!r}, ...) first"
                )
            return var.copy(data=fill(var.data, limit=limit))

        obj = self._obj
        if isinstance(obj, xr.DataArray):
            return obj.copy(data=one(obj.variable).data)
        return obj.copy(data={k: one(v).data for k, v in obj.data_vars.items()})


def _register_accessors() -> None:
    import xarray as xr

    with warnings.catch_warnings():  # registering twice (a reload) only warns
        warnings.simplefilter("ignore")
        xr.register_dataset_accessor("tierflow")(_Accessor)
        xr.register_dataarray_accessor("tierflow")(_Accessor)


_register_accessors()
