"""Sinks of the public API: ``tw.compute``, ``Array.compute``, ``to_npy``, ``persist``.

Each opens the compute's cache session (:mod:`tierflow.engine.io.cache`: which nodes are
kept in which store, and the cached values that need no computing), builds a plan
(:mod:`tierflow.engine.planning.plan`), runs it on an executor (:mod:`tierflow.engine.runtime.executors`)
through the scheduler (:mod:`tierflow.engine.runtime.scheduler`), and on any error or interrupt
aborts its sinks: outputs freed, temporary files removed. Blocks already written to the
cache stay there, which is what lets a compute that was stopped resume.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
from typing import Any

import numpy as np

from .. import graph
from ..gpu.offload import check
from ..graph import Chunked, blocksize
from ..io.destination import check_npy, install_file, local_path, sweep_temps, temp_file
from ..io.indexed import RegionSink, place, places_read
from ..io.memory import ArrayReader, ArraySink
from ..io.npy import NpySink
from ..io.zarr import ZarrSink
from ..planning.plan import Target
from ..runtime.run import RunOptions, run
from ..types import Executor
from . import build
from .creation import from_array

__all__ = ["compute", "persist", "store", "to_npy", "to_zarr"]

log = logging.getLogger("tierflow.engine")


def compute(  # noqa: PLR0913 -- keyword-only options, one per aspect of a run
    *arrays: Any,
    progress: bool | None = None,
    executor: str | Executor | None = None,
    workers: int | None = None,
    callbacks: Any = None,
    cache: Any = None,
    device: str | None = None,
    profile: Any = None,
    jit: bool | str | None = None,
) -> tuple[Any, ...]:
    """Compute several results in one run; inputs they share are read once per stage.

    ``tw.compute(x.mean(axis=0), x.std(axis=0))`` reads ``x`` once. Returns a tuple of
    NumPy arrays (chunked results, allocated with ``memory.array``: RAM or a spill
    file) and NumPy scalars or small arrays (reductions), in the order given.

    ``progress``: None shows a tqdm bar for computes longer than about a second, True
    from the start, False never. ``executor``: ``"threads"`` (default), ``"serial"``,
    ``"raise"`` or an executor object; ``workers``: threads (default: usable cores).
    ``callbacks``: objects with ``start`` / ``task_done`` / ``finish`` methods
    (:class:`~tierflow.engine.types.Callback`).

    ``cache``: keep the results, and the values they depend on, in a two-tier store,
    block by block as they are computed, and read from it what is already there:
    ``True`` (the store of the ``cache`` setting, else the store named ``"cache"``), a
    store name or path, or a store from ``memory.store``; ``None`` (default) follows the
    ``cache`` setting (``TIERFLOW_CACHE``); ``False`` caches nothing, not even nodes
    marked with ``x.cache()``. See :mod:`tierflow.engine.io.cache`. A cache that cannot be
    written is a :class:`~tierflow.engine.io.cache.CacheWarning`, never an error.

    ``device``: where fused elementwise operators and row reductions run: ``"cpu"``,
    ``"cuda"`` (the GPU with the most free memory), ``"cuda:N"``, or ``"auto"`` (a GPU
    where copying a block costs less than computing it on the CPU); None (default)
    follows a ``map_blocks(device="cuda")`` in the same pass, else the ``device``
    setting. Results come back as NumPy arrays either way. See
    :mod:`tierflow.engine.gpu.offload` and docs/engine.md.

    ``jit``: compile fused reductions to one loop with numba, on a background thread
    while the first blocks run on the NumPy path (:mod:`tierflow.engine.planning.jit`);
    None (default) follows the ``jit`` setting (``TIERFLOW_JIT``), False keeps every
    block on the NumPy path, ``"eager"`` waits for the kernels before the first block.

    ``profile``: record the compute's tasks, memory samples and plan
    (:mod:`tierflow.engine.observe.profile`): True (into the enclosing ``with tw.profile()``
    block's profile, else a new one that ``tw.last_profile()`` returns), a
    :class:`~tierflow.engine.observe.profile.Profile` to record into, False (not even inside a
    ``with tw.profile()`` block), or None (default: the enclosing block's, if any).

    Raises what a task raised (the first error; operators' errors as NumPy raises them,
    user functions' as :class:`~tierflow.errors.BlockError` naming the block),
    :class:`~tierflow.errors.SourceError` for a source file changed since the array was
    built, :class:`~tierflow.errors.OutOfMemoryError` when an operator does not fit even
    on one row. On any error or KeyboardInterrupt the workers are stopped and nothing
    is left behind (outputs freed, spill files deleted).
    """
    items = [from_array(a) for a in arrays]
    requests = [
        Target(a._node, ArraySink(a._node) if isinstance(a._node, Chunked) else None) for a in items
    ]
    options = RunOptions(
        progress,
        executor,
        workers,
        callbacks,
        cache,
        None if device is None else check(device),
        profile,
        jit,
    )
    outputs, _ = run(requests, options)
    return tuple(outputs)


def _check_options(function: str, options: dict[str, Any], *also: str) -> None:
    """Refuse an option that :func:`compute` does not take, naming the public
    ``function`` the caller called (not the internal one that would refuse it)."""
    known = [
        p.name for p in inspect.signature(compute).parameters.values() if p.kind is p.KEYWORD_ONLY
    ]
    for name in options:
        if name not in known:
            raise TypeError(
                f"{function}() got an unexpected keyword argument {name!r}; its options are "
                f"{', '.join([*known, *also])}"
            )


def persist(array: Any, *, device: str | None = None, **options: Any) -> Any:
    """Compute ``array`` now and return an Array over the result (in RAM or on the SSD)
    with the same key; options as :func:`compute`. ``device`` (``"cuda"``, ``"cuda:N"``,
    ``"auto"``) also computes there, as :func:`compute` does, and keeps the result's
    blocks on that GPU while they fit its budget (:mod:`tierflow.engine.io.persisted`)."""
    _check_options("persist", options)
    node = array._node
    (result,) = compute(array, device=device, **options)
    if isinstance(node, Chunked):
        reader: Any = ArrayReader(result)
        if node.bounds is not None:
            bounds = node.bounds
        else:
            bounds = blocksize.bounds(result.shape[0], None, reader.row_nbytes)
        if device not in (None, "cpu"):
            from ..io import persisted

            token = f"persisted({node.key})"
            placed = persisted.place(result, tuple(bounds), str(device), token)
            if placed is not None:
                reader = placed
        return build.wrap(graph.Source(reader, bounds, key=node.key))
    const = graph.Const(result)
    const._key = node.key
    return build.wrap(const)


def to_npy(
    array: Any,
    path: str | os.PathLike[str],
    *,
    fsync: bool = False,
    overwrite: bool = False,
    **options: Any,
) -> None:
    """Write ``array`` to the ``.npy`` file ``path``, streaming (see ``Array.to_npy``)."""
    _check_options("to_npy", options, "fsync", "overwrite")
    node = array._node
    if not isinstance(node, Chunked):
        target = local_path(path)
        check_npy(target, overwrite)
        (value,) = compute(array, **options)
        _save_atomic(np.asarray(value), target, fsync=fsync, overwrite=overwrite)
        return
    if options.get("device") is not None:
        options["device"] = check(options["device"])
    sink = NpySink(node, path, fsync=fsync, overwrite=overwrite)
    sink.claim()
    run([Target(node, sink)], RunOptions(**options))


def to_zarr(  # noqa: PLR0913 -- public: the array's layout and the store's options
    array: Any,
    path_or_url: str | os.PathLike[str],
    *,
    chunks: Any = None,
    shards: Any = None,
    compressors: Any = "auto",
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    **options: Any,
) -> None:
    """Write ``array`` to a Zarr array at ``path_or_url`` (see ``Array.to_zarr``)."""
    _check_options(
        "to_zarr", options, "chunks", "shards", "compressors", "storage_options", "overwrite"
    )
    node = array._node
    if not isinstance(node, Chunked):
        raise TypeError(
            "to_zarr writes chunked arrays (row blocks); this is a reduction's result: "
            "compute() it and save it with np.save or zarr"
        )
    if options.get("device") is not None:
        options["device"] = check(options["device"])
    sink = ZarrSink(
        node,
        path_or_url,
        chunks=chunks,
        shards=shards,
        compressors=compressors,
        storage_options=storage_options,
        overwrite=overwrite,
    )
    sink.claim()
    run([Target(node, sink)], RunOptions(**options))


def _save_atomic(value: np.ndarray, path: str, *, fsync: bool, overwrite: bool) -> None:
    """``np.save`` to ``path`` by way of a temporary file, renamed into place as the
    destination rules allow (:func:`~tierflow.engine.io.destination.install_file`)."""
    sweep_temps(os.path.dirname(path))
    fd, tmp = temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, value, allow_pickle=False)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        install_file(tmp, path, overwrite)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def store(
    sources: Any,
    targets: Any,
    regions: Any = None,
    *,
    lock: Any = None,
    compute: bool = True,
    **options: Any,
) -> None:
    """Write lazy arrays into objects that take rows by slice assignment, as
    ``dask.array.store``: ``targets[i][regions[i]] = sources[i]``, one compute for all.

    ``sources``: an Array or a list of them; ``targets``: as many objects with a
    ``shape`` that take ``target[slices] = block`` (a Zarr, h5py or memory-mapped
    array); ``regions``: for each target, None (the whole target) or a tuple of slices
    saying where the source goes (step 1; the source's shape). Each block is written by
    the task that computes it, in the workers (a target is pickled into a worker
    process: a Zarr array or an ``np.memmap`` is; an open h5py file is not, use
    threads). The blocks are cut on the target's chunks (shards), counted from the
    region's first row, so no two tasks write parts of one stored chunk. ``lock``, when
    given, is held around each write (a netCDF target's). Nothing outside the regions
    is written; a failed compute leaves the rows written so far. ``compute=False`` is
    refused (there is no delayed result to hand back), and so is a source that reads
    its own target (the same Zarr array, HDF5 dataset or memory-mapped file: written in
    place, a block could read rows another block replaced). Options as
    :func:`compute`."""
    _check_options("store", options)
    if not compute:
        raise ValueError(
            "store(compute=False) is not supported: tierflow writes when called; call store "
            "when the write should happen"
        )
    many = isinstance(sources, (list, tuple))
    source_list = list(sources) if many else [sources]
    target_list = list(targets) if isinstance(targets, (list, tuple)) else [targets]
    one_region = regions is None or (
        isinstance(regions, tuple) and all(isinstance(r, slice) for r in regions)
    )  # None or one tuple of slices: for every source, as dask takes it
    region_list = [regions] * len(source_list) if one_region else list(regions)
    if not (len(source_list) == len(target_list) == len(region_list)):
        raise ValueError(
            f"store: {len(source_list)} sources, {len(target_list)} targets and "
            f"{len(region_list)} regions: give one target (and region) per source"
        )
    if options.get("device") is not None:
        options["device"] = check(options["device"])
    found = []
    for source, target, region in zip(source_list, target_list, region_list, strict=True):
        node = from_array(source)._node
        if not isinstance(node, Chunked):
            value = np.asarray(from_array(source).compute())
            target[region if region is not None else ...] = value
            continue
        if node.n_rows is None:
            raise ValueError(
                "store: the source's rows are unknown until counted (after a mask), so its "
                "place in the target is too; write it with to_zarr or to_npy (which append), "
                "or count it first: x = x.rechunk('auto'); len(x)"
            )
        row0, trailing = _region(node, target, region)
        _refuse_reading_the_target(node, target)
        align = _stored_rows(target)
        node = _cut_on(node, row0, align)
        found.append(Target(node, RegionSink(node, target, row0, trailing, align, lock)))
    if found:
        run(found, RunOptions(**options))


def _refuse_reading_the_target(node: Chunked, target: Any) -> None:
    """Refuse a source that reads the array ``store`` writes: its blocks are written in
    place while others still read (a shift, a window over neighbouring rows, a retry
    after a block was written would read rows already replaced), so the answer could
    be wrong."""
    where = place(target)
    if where is None:
        return
    for leaf in graph.walk([node]):
        reader = getattr(leaf, "reader", None)
        if reader is None:
            continue
        for read in places_read(reader):
            if (
                read == where
                or read.startswith((where + "/", where + "::"))
                or where.startswith((read + "/", read + "::"))
            ):
                raise ValueError(
                    f"store: the source reads {read}, which holds the target it would write "
                    f"({where}); rows written in place could be read again by another block, "
                    "giving a wrong answer. Write to a new array and swap it in, or compute "
                    "the source first where it fits in memory (np.asarray)"
                )


def _region(node: Chunked, target: Any, region: Any) -> tuple[int, tuple[slice, ...]]:
    """The first row of ``region`` in ``target`` and its trailing slices, checked
    against ``node``'s shape."""
    shape = tuple(int(n) for n in target.shape)
    if region is None:
        region = ()
    if not isinstance(region, tuple):
        region = (region,)
    if len(region) > len(shape):
        raise ValueError(f"store: region {region} has more axes than the target's {shape}")
    full = (*region, *(slice(None),) * (len(shape) - len(region)))
    spans = []
    for axis, (r, n) in enumerate(zip(full, shape, strict=True)):
        if not isinstance(r, slice):
            raise TypeError(f"store: region {region}: axis {axis} must be a slice, got {r!r}")
        start, stop, step = r.indices(n)
        if step != 1:
            raise ValueError(f"store: region {region}: axis {axis} has step {step}; use step 1")
        spans.append((start, max(start, stop)))
    want = tuple(b - a for a, b in spans)
    have = (node.n_rows, *node.row_shape)
    if want != have:
        raise ValueError(
            f"store: the source has shape {have} but its region {full} of the target of shape "
            f"{shape} has shape {want}"
        )
    return spans[0][0], tuple(slice(a, b) for a, b in spans[1:])


def _stored_rows(target: Any) -> int:
    """Rows of the target's stored objects along its first axis (a Zarr shard or
    chunk, an HDF5 chunk); 1 for a target that stores rows separately."""
    for name in ("shards", "chunks"):
        found = getattr(target, name, None)
        if isinstance(found, tuple) and found and all(isinstance(n, int) for n in found):
            return max(1, int(found[0]))
    return 1


def _cut_on(node: Chunked, row0: int, align: int) -> Chunked:
    """``node`` with its blocks cut on the target's stored objects: every block but the
    first starts at a row where (``row0`` + row) is a multiple of ``align``."""
    bounds = node.bounds
    assert bounds is not None and node.n_rows is not None
    if align <= 1 or all((row0 + b) % align == 0 for b in bounds[1:-1]):
        return node
    pairs = node.block_pairs()
    typical = max((b - a for a, b in pairs), default=1)
    step = max(align, typical // align * align)
    first = (align - row0 % align) % align  # rows to the region's first chunk edge
    cuts = [0, *range(first or step, node.n_rows, step), node.n_rows]
    sizes = [b - a for a, b in itertools.pairwise(cuts) if b > a]
    rechunked = build.wrap(node).rechunk(tuple(sizes))._node
    assert isinstance(rechunked, Chunked)
    return rechunked
