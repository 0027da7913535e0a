"""Distinct values of row blocks: sorted runs merged as a tree, spilled by value range.

What ``np.unique`` and ``tw.value_counts`` reduce with (:class:`.frequencies.UniqueTable`).

Keys
----
A *key* is what is compared: the values themselves (``np.unique(x)``, flattened), or for
unique rows one structured scalar per row, a field per column, which is how
``np.unique(x, axis=0)`` compares rows; so order and equality are NumPy's own (NaN
last; ``-0.0 == 0.0``; every NaN one value in 1-D, as with ``equal_nan=True``, while a
row holding a NaN equals no other row).

Runs and the tree
-----------------
A :class:`Run` holds sorted distinct keys and, as asked, how often each occurs
(``counts``) and where it first occurs (``first``: an index into the flattened array,
or a row). A block's run is ``np.unique`` of its keys. Partials are :class:`Stack`\\ s of
runs by *level*: a block's run is level 0, and two runs of the same level merge into
one of the next level, as a binary counter carries::

    block runs      r0  r1  r2  r3          levels after each combine
    combine r0+r1   [r01]                   1
    combine +r2     [r01, r2]               1, 0
    combine +r3     [r0123]                 2

so every key is merged about ``log2(blocks)`` times, however the engine pairs partials,
and a merge of two runs of ``d`` keys costs ``O(d)`` (a stable sort of two sorted runs
is a merge). The partial holds the distinct keys a few times over at most.

Spilling
--------
When a stack outgrows its ``limit`` (a share of the RAM budget), it spills: ``P``
*partition files* (enough for the rows to come, :class:`Room`) are made in a fresh folder (``tempfile.mkdtemp``) under the process's
spill folder (:func:`tierflow.storage.spill.process_dir`), with ``P - 1`` *splitters*:
keys taken at even quantiles of the distinct keys held then. Partition ``p`` holds the
keys ``k`` with ``splitters[p - 1] <= k < splitters[p]``, so partitions are ranges of
the final order and the result is their results one after the other. Every run
combined into a spilled partial afterwards is cut at the splitters and appended to the
files (records of key, count, first); nothing grows in RAM. Two spilled partials
merge by moving the files of one into the partitions of the other.

The result (:meth:`Spilled.results`) reduces one partition at a time: a file that fits
the limit is read and merged whole; a bigger one (the splitters are a sample of the
keys seen before the spill: sorted input sends every later key to the last partition)
is cut again at splitters sampled evenly from the whole file, and each piece is reduced
in turn (at most :data:`MAX_DEPTH` times; then it is merged in pieces of the limit,
holding its distinct keys). The folder is removed when the result is read, and by
:meth:`Spilled.discard`, which the engine calls when a compute fails or is interrupted
(and a ``weakref.finalize`` when a spilled partial is dropped).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...operators.types import combine_partials
from ...storage import spill

__all__ = [
    "MAX_DEPTH",
    "MAX_PARTITIONS",
    "PARTITIONS",
    "Room",
    "Run",
    "Spilled",
    "Stack",
    "Want",
    "combine",
    "discard",
    "first_change",
    "merge_runs",
    "merge_two",
    "record_dtype",
    "run_of",
    "runs_of",
]

PARTITIONS = 32  # partition files a spilled partial cuts its keys into, by default
MAX_PARTITIONS = 256  # at most (each run combined appends to each of them)
MAX_DEPTH = 3  # times a partition too big for the limit is cut again
_SAMPLE = 1 << 16  # keys sampled from a partition file to cut it again


@dataclass(frozen=True, slots=True)
class Want:
    """What runs carry besides keys: ``counts``, ``first`` (first occurrences), and
    ``tie_order``: merged runs keep rows that sort together but differ (rows with a NaN)
    in order of first occurrence, as NumPy's stable sort keeps them."""

    counts: bool = False
    first: bool = False
    tie_order: bool = False


@dataclass(frozen=True, slots=True)
class Run:
    """Sorted distinct ``keys``, with ``counts`` and ``first`` (int64) where wanted."""

    keys: np.ndarray
    counts: np.ndarray | None = None
    first: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        extra = sum(a.nbytes for a in (self.counts, self.first) if a is not None)
        return int(self.keys.nbytes) + extra


def first_change(aux: np.ndarray) -> np.ndarray:
    """Where each group of equal keys starts in sorted keys ``aux`` (a boolean mask),
    NaN being one value in 1-D as in NumPy's ``np.unique(equal_nan=True)``."""
    mask = np.empty(aux.shape, dtype=bool)
    mask[:1] = True
    if aux.size and aux.dtype.kind in "fc" and np.isnan(aux[-1]):
        nan_at = int(np.searchsorted(aux, aux[-1], side="left"))
        if nan_at > 0:
            mask[1:nan_at] = aux[1:nan_at] != aux[: nan_at - 1]
        mask[nan_at] = True
        mask[nan_at + 1 :] = False
    else:
        mask[1:] = aux[1:] != aux[:-1]
    return mask


def run_of(keys: np.ndarray, offset: int, want: Want) -> Run:
    """The run of the keys of one block (``keys[i]`` is at index ``offset + i``)."""
    if not want.counts and not want.first:
        return Run(np.unique(keys))
    out: Any = np.unique(keys, return_index=want.first, return_counts=want.counts)  # type: ignore[call-overload]
    found = iter(out[1:])
    first = next(found).astype(np.int64) + offset if want.first else None
    counts = next(found).astype(np.int64) if want.counts else None
    return Run(out[0], counts, first)


def merge_runs(runs: Sequence[Run], want: Want) -> Run:
    """One run of the keys of ``runs``; they need not be sorted nor distinct (records
    read back from a partition file are neither)."""
    if len(runs) == 1 and len(runs[0]) <= 1:
        return runs[0]
    keys = np.concatenate([r.keys for r in runs])
    if not want.counts and not want.first:
        return Run(np.unique(keys))
    first = np.concatenate([r.first for r in runs]) if want.first else None
    counts = np.concatenate([r.counts for r in runs]) if want.counts else None
    if want.tie_order and first is not None:
        by_first = np.argsort(first, kind="stable")
        keys, first = keys[by_first], first[by_first]
        counts = counts[by_first] if counts is not None else None
    perm = np.argsort(keys, kind="stable")  # runs are sorted: this is a merge
    aux = keys[perm]
    starts = np.flatnonzero(first_change(aux))
    if not len(starts):
        return Run(aux, counts, first)
    return Run(
        aux[starts],
        np.add.reduceat(counts[perm], starts) if counts is not None else None,
        np.minimum.reduceat(first[perm], starts) if first is not None else None,
    )


def merge_two(a: Run, b: Run, want: Want) -> Run:
    """The union of two sorted runs of distinct keys.

    A stable sort of the two together is a merge (timsort finds the two runs); each key
    then occurs once or twice, side by side, so counts add and first indices take the
    smaller pairwise, without :func:`merge_runs`' ``reduceat`` (measured on two runs of
    3M float32 keys: 0.25 s against 0.5 s; looking ``b``'s keys up in ``a`` with
    ``np.searchsorted`` took 1 s). Rows with a NaN (``want.tie_order``) take
    :func:`merge_runs`."""
    if want.tie_order or not len(a) or not len(b):
        return merge_runs([a, b], want) if len(a) and len(b) else (a if len(a) else b)
    keys = np.concatenate([a.keys, b.keys])
    if not want.counts and not want.first:
        merged = np.sort(keys, kind="stable")
        return Run(merged[first_change(merged)])
    order = np.argsort(keys, kind="stable")
    aux = keys[order]
    starts = first_change(aux)
    second = ~starts[1:]  # aux[i + 1] repeats aux[i]
    counts = first = None
    if want.counts:
        c = np.concatenate([a.counts, b.counts])[order]
        c[:-1][second] += c[1:][second]
        counts = c[starts]
    if want.first:
        f = np.concatenate([a.first, b.first])[order]
        head = f[:-1]
        head[second] = np.minimum(head[second], f[1:][second])
        first = f[starts]
    return Run(aux[starts], counts, first)


def record_dtype(key_dtype: np.dtype, want: Want) -> np.dtype:
    """The dtype of a partition file's records: key, then count and first as wanted."""
    fields: list[tuple[str, Any]] = [("key", key_dtype)]
    if want.counts:
        fields.append(("count", np.int64))
    if want.first:
        fields.append(("first", np.int64))
    return np.dtype(fields)


def _records(run: Run, dtype: np.dtype) -> np.ndarray:
    out = np.empty(len(run), dtype)
    out["key"] = run.keys
    if run.counts is not None:
        out["count"] = run.counts
    if run.first is not None:
        out["first"] = run.first
    return out


def _run_of_records(records: np.ndarray) -> Run:
    names = records.dtype.names or ()
    return Run(
        np.ascontiguousarray(records["key"]),
        np.ascontiguousarray(records["count"]) if "count" in names else None,
        np.ascontiguousarray(records["first"]) if "first" in names else None,
    )


@dataclass(frozen=True, slots=True)
class Stack:
    """Runs by level, highest first (see the module docstring)."""

    runs: tuple[tuple[int, Run], ...]

    @property
    def nbytes(self) -> int:
        """Bytes held by the runs."""
        return sum(r.nbytes for _, r in self.runs)


def _carry(runs: list[tuple[int, Run]], want: Want) -> tuple[tuple[int, Run], ...]:
    """Merge runs of equal level into the next level until every level is single."""
    by_level: dict[int, Run] = {}
    pending = sorted(runs, key=lambda lr: lr[0])
    while pending:
        level, run = pending.pop(0)
        other = by_level.pop(level, None)
        if other is None:
            by_level[level] = run
            continue
        pending.insert(0, (level + 1, merge_two(other, run, want)))
        pending.sort(key=lambda lr: lr[0])
    return tuple(sorted(by_level.items(), key=lambda lr: -lr[0]))


class Spilled:
    """A partial whose runs live in partition files cut at ``splitters`` (see the module
    docstring). It owns its folder: combining it into another partial, reading its
    results or :meth:`discard` removes the folder."""

    def __init__(self, splitters: np.ndarray, records: np.dtype, want: Want, limit: int) -> None:
        self.splitters = splitters
        self.records = records
        self.want = want
        self.limit = limit
        self.folder = tempfile.mkdtemp(prefix="unique-", dir=spill.process_dir())
        self.sizes = [0] * (len(splitters) + 1)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a spilled partial of np.unique names files in this process's spill folder and "
            "cannot travel to another process"
        )

    def __repr__(self) -> str:
        return f"Spilled({len(self.sizes)} partitions, {sum(self.sizes)} bytes in {self.folder})"

    def path(self, p: int) -> str:
        """The file of partition ``p``."""
        return os.path.join(self.folder, f"{p:05d}.bin")

    def add_run(self, run: Run) -> None:
        """Append the keys of a sorted run to the partitions they fall in."""
        if not len(run):
            return
        cuts = np.searchsorted(run.keys, self.splitters, side="left")
        bounds = np.asarray([0, *cuts.tolist(), len(run)])
        self._append_slices(_records(run, self.records), bounds)

    def add_records(self, records: np.ndarray) -> None:
        """Append records in any order to the partitions their keys fall in."""
        if not len(records):
            return
        where = np.searchsorted(self.splitters, records["key"], side="right")
        order = np.argsort(where, kind="stable")
        bounds = np.searchsorted(where[order], np.arange(len(self.sizes) + 1), side="left")
        self._append_slices(records[order], bounds)

    def _append_slices(self, records: np.ndarray, bounds: np.ndarray) -> None:
        """Append ``records[bounds[p]:bounds[p + 1]]`` to partition ``p``, for the
        partitions that get any (a loop over all of them, thousands, cost more than the
        appends when a few records arrive at a time)."""
        for p in np.flatnonzero(np.diff(bounds) > 0).tolist():
            self._append(p, records[int(bounds[p]) : int(bounds[p + 1])])

    def _append(self, p: int, records: np.ndarray) -> None:
        with open(self.path(p), "ab") as f:
            records.tofile(f)
        self.sizes[p] += records.nbytes

    def absorb(self, other: Spilled) -> None:
        """Move the records of ``other`` into these partitions; ``other`` is discarded."""
        try:
            for p, size in enumerate(other.sizes):
                if size:
                    for records in _read(other.path(p), other.records, self.limit):
                        self.add_records(records)
        finally:
            other.discard()

    def results(self) -> Iterator[Run]:
        """The merged run of each partition, in key order; the folder is removed at the
        end (or on an error)."""
        try:
            for p, size in enumerate(self.sizes):
                if size:
                    yield from self._reduce_file(self.path(p), size)
        finally:
            self.discard()

    def _reduce_file(self, path: str, size: int, depth: int = 0) -> Iterator[Run]:
        """The merged runs of one partition file, in key order (see the module docstring)."""
        dtype, want, limit = self.records, self.want, self.limit
        if size <= limit or depth >= MAX_DEPTH:
            merged: Run | None = None
            for records in _read(path, dtype, limit):
                piece = _run_of_records(records)
                merged = merge_runs([piece] if merged is None else [merged, piece], want)
            if merged is not None and len(merged):
                yield merged
            return
        keys = np.memmap(path, dtype=dtype, mode="r")["key"]
        step = max(1, len(keys) // _SAMPLE)
        sample = np.unique(np.array(keys[::step]))
        del keys
        parts = min(len(sample), max(2, math.ceil(2 * size / limit)))
        splitters = _splitters(sample, parts)
        if not len(splitters):  # one key repeated: the records merge into one
            yield from self._reduce_file(path, size, MAX_DEPTH)
            return
        inner = Spilled(splitters, dtype, want, limit)
        try:
            for records in _read(path, dtype, limit):
                inner.add_records(records)
            os.unlink(path)
            for p, part in enumerate(inner.sizes):
                if part:
                    yield from inner._reduce_file(inner.path(p), part, depth + 1)
        finally:
            inner.discard()

    def discard(self) -> None:
        """Remove the folder and its files (idempotent)."""
        self._finalizer()


def _read(path: str, dtype: np.dtype, limit: int) -> Iterator[np.ndarray]:
    """The records of a partition file in pieces of about ``limit // 4`` bytes."""
    count = max(1, (limit // 4) // dtype.itemsize)
    with open(path, "rb") as f:
        while True:
            records = np.fromfile(f, dtype=dtype, count=count)
            if not len(records):
                return
            yield records


def _splitters(keys: np.ndarray, parts: int) -> np.ndarray:
    """``parts - 1`` keys at even quantiles of sorted distinct ``keys`` (fewer when
    there are fewer distinct keys)."""
    if parts < 2 or len(keys) < 2:
        return keys[:0]
    at = np.unique(np.linspace(0, len(keys), parts, endpoint=False)[1:].astype(np.intp))
    return np.ascontiguousarray(keys[at[at > 0]])


Partial = Stack | Spilled | None


@dataclass(frozen=True, slots=True)
class Room:
    """How much a partial may hold: ``limit`` bytes of runs in RAM (past it, it spills),
    and ``expected``, the bytes of records every block together could write (their
    keys, each with its count and first index), when the row count is known: a spill
    makes enough partitions for each to hold about half the limit, so that none needs
    cutting again (:data:`PARTITIONS` without it, at most :data:`MAX_PARTITIONS`)."""

    limit: int
    expected: int | None = None

    def partitions(self) -> int:
        """Partition files a spill makes."""
        if self.expected is None:
            return PARTITIONS
        return min(MAX_PARTITIONS, max(2, math.ceil(2 * self.expected / self.limit)))


def combine(a: Partial, b: Partial, want: Want, room: Room) -> Partial:
    """Merge two partials (see the module docstring); a :class:`Spilled` argument is
    consumed (its files move into the result)."""
    return combine_partials(a, b, lambda a, b: _merged(a, b, want, room))


def _merged(a: Stack | Spilled, b: Stack | Spilled, want: Want, room: Room) -> Stack | Spilled:
    if isinstance(a, Spilled) and isinstance(b, Spilled):
        big, small = (a, b) if sum(a.sizes) >= sum(b.sizes) else (b, a)
        big.absorb(small)
        return big
    if isinstance(b, Spilled):
        a, b = b, a
    if isinstance(a, Spilled):
        assert isinstance(b, Stack)
        for _, run in b.runs:
            a.add_run(run)
        return a
    assert isinstance(b, Stack)
    stack = Stack(_carry([*a.runs, *b.runs], want))
    if stack.nbytes <= room.limit:
        return stack
    return _spill(stack, want, room)


def _spill(stack: Stack, want: Want, room: Room) -> Spilled:
    runs = [r for _, r in stack.runs]
    biggest = max(runs, key=len)
    dtype = record_dtype(biggest.keys.dtype, want)
    splitters = _splitters(biggest.keys, room.partitions())
    spilled = Spilled(splitters, dtype, want, room.limit)
    try:
        for run in runs:
            spilled.add_run(run)
    except BaseException:
        spilled.discard()
        raise
    return spilled


def runs_of(partial: Partial, want: Want) -> Iterator[Run]:
    """The result's runs in key order: one for a partial in memory, one per partition
    of a spilled one."""
    if partial is None:
        return
    if isinstance(partial, Spilled):
        yield from partial.results()
        return
    runs = [r for _, r in partial.runs]
    merged = runs[0]
    for run in runs[1:]:
        merged = merge_two(merged, run, want)
    yield merged


def discard(partial: Partial) -> None:
    """Remove the files of a spilled partial (nothing for one in memory)."""
    if isinstance(partial, Spilled):
        with contextlib.suppress(OSError):
            partial.discard()
