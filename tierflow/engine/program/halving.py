"""Out-of-memory halving: retry an operator on the halves of its block.

The policy (stated with the scheduler's, :mod:`tierflow.engine.runtime.scheduler`):

* Every operator call goes through :func:`call` (a block operator) or
  :func:`call_chunk` (a reduction's chunk). Each tries the call once, directly, and
  only when it raises an out-of-memory error — ``MemoryError``, torch's or cupy's
  (:func:`tierflow.storage.oom.is_oom`) — retries it on rows ``[0, n/2)`` and
  ``[n/2, n)`` of its input blocks, down to one row. Before a retry the failed
  attempt's memory is reclaimed by :func:`tierflow.storage.oom.recover` (the one
  recovery sequence, shared with ``memory.fit_batch``): frames cleared, garbage
  collected, the caches of torch and cupy emptied where they are imported
  (:func:`tierflow.storage.oom.empty_gpu_caches`).
* Each failure remembers half its rows as the operator's size (by the node's key, for
  the rest of the process; only ever lowered), and every call — the rest of the block
  being halved as much as the next blocks — is first cut into pieces of the size
  remembered then. So only the first failing piece of each size is tried, and the
  sizes that fail are found in about ``log2(block rows / rows that fit)`` attempts.
  A function that fails above 1,000 rows on 20,000-row blocks fails on 20,000,
  10,000, 5,000, 2,500 and 1,250 rows, once each; then every piece, in this block
  and the next, has 625::

      block 0: 20000 x -> 10000 x -> 5000 x -> 2500 x -> 1250 x -> 625 ok, 625 ok,
               then the other 1250, 2500, 5000 and 10000 rows: 625 at a time
      block 1: 625 at a time from the start

* The pieces are stitched: a block operator writes each piece into its rows of the
  output block (no second copy when the output is given), a reduction combines the
  pieces' partials left to right (a piece's first row is the block's first row plus
  its start, so ``argmin`` indices stay global).
* Only operators that map rows to rows can be split this way (every block operator and
  reduction chunk). One row that still does not fit raises
  :class:`~tierflow.errors.OutOfMemoryError` with the sizes tried and a diagnosis
  (:func:`tierflow.storage.oom.explain_oom`: the RAM or GPU figures and which case it
  is — too big for the device, fragmented, or memory held outside the allocator — and
  the remedy).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import OutOfMemoryError
from ...operators import byteorder
from ...storage import oom
from ...system import tally

__all__ = ["Site", "call", "call_chunk", "cap", "forget", "remembered", "retries"]

log = logging.getLogger("tierflow.engine")

_lock = threading.Lock()
_sizes: dict[str, int] = {}  # node key -> rows per call that last worked; _lock
_retries = 0  # halvings since the process started; _lock


def remembered(key: str) -> int | None:
    """Rows per call remembered for the operator with this node key, if any."""
    return _sizes.get(key)  # one dict read is atomic; writers hold _lock


def forget(key: str | None = None) -> None:
    """Forget the remembered size of one operator (every operator when None)."""
    with _lock:
        if key is None:
            _sizes.clear()
        else:
            _sizes.pop(key, None)


def cap(key: str, rows: int) -> None:
    """Call the operator with this node key on at most ``rows`` rows from now on in
    this process (what another process learnt: a worker that died of memory on a
    bigger block; see :mod:`tierflow.engine.runtime.executors.cluster`). Not counted as a
    retry."""
    rows = max(1, int(rows))
    with _lock:
        known = _sizes.get(key)
        if known is None or rows < known:
            _sizes[key] = rows


def retries() -> int:
    """How many operator calls were split since the process started."""
    with _lock:
        return _retries


def _remember(key: str, rows: int) -> None:
    global _retries
    tally.add("halvings")  # counted in the running task's profile, if any
    with _lock:
        _retries += 1
        known = _sizes.get(key)
        if known is None or rows < known:
            _sizes[key] = rows


def _give_up(
    label: str, where: Any, tried: list[int], exc: BaseException, figures: oom.CudaFigures | None
) -> OutOfMemoryError:
    where = where() if callable(where) else where
    sizes = ", ".join(str(n) for n in tried)
    text = str(exc).split("\n")[0][:300]
    return OutOfMemoryError(
        f"{label} ran out of memory on {where} at every size tried, down to one row "
        f"({sizes} rows): {type(exc).__name__}: {text}. " + oom.explain_oom(exc, figures)
    )


def _retry(label: str, where: Any, rows: int, exc: Exception, tried: Sequence[int]) -> bool:
    """In the ``except`` clause of an attempt on ``rows`` rows (``tried``: the sizes that
    failed before it): whether to retry on halves, after
    :func:`~tierflow.storage.oom.recover` reclaimed the attempt's memory. False for any
    other error, which the caller re-raises. Raises
    :class:`~tierflow.errors.OutOfMemoryError` when one row ran out of memory."""
    give_up = functools.partial(_give_up, label, where, [*tried, rows], exc)
    return oom.recover(exc, last=rows <= 1, give_up=give_up)


def _pieces(rows: int, limit: int | None) -> list[tuple[int, int]]:
    if limit is None or rows <= limit:
        return [(0, rows)]
    return [(i, min(i + limit, rows)) for i in range(0, rows, limit)]


@dataclass(frozen=True)
class Site:
    """Where halving runs: an operator's node ``key`` (what a working size is
    remembered by) and its ``label`` (named in the final error). A step makes its own
    once, when it is built."""

    key: str
    label: str


@dataclass(frozen=True)
class _Operator:
    """The operator being halved: its node ``key`` (sizes are remembered by it), and its
    ``label`` and ``where`` (the block, or a callable giving it) for the final error."""

    key: str
    label: str
    where: Any


def _rows(blocks: Sequence[np.ndarray]) -> int:
    return blocks[0].shape[0] if blocks else 0


def call(
    site: Site,
    where: Any,
    fn: Callable[..., np.ndarray],
    blocks: Sequence[np.ndarray],
    out: np.ndarray | None,
) -> np.ndarray:
    """``fn(*blocks, out=out)`` with out-of-memory halving (see the module docstring).

    ``site`` names the operator (:class:`Site`), ``where`` the block (a string, or a
    callable that gives one) in the final error. The pieces write into their rows of
    ``out`` when it is given, else their results are concatenated.
    """
    if site.key not in _sizes:
        # The common case: one call, nothing remembered, nothing to split.
        try:
            return fn(*blocks, out=out)
        except Exception as exc:
            if not _retry(site.label, where, _rows(blocks), exc, ()):
                raise
        return _halves(_Operator(site.key, site.label, where), fn, blocks, out, [_rows(blocks)])
    return _block(_Operator(site.key, site.label, where), fn, blocks, out, [])


def _block(
    op: _Operator,
    fn: Callable[..., np.ndarray],
    blocks: Sequence[np.ndarray],
    out: np.ndarray | None,
    tried: list[int],
) -> np.ndarray:
    """``fn`` on these rows: in pieces of the remembered size when they are more (the
    size may have shrunk since the caller cut them), else in one call, halved if it
    runs out of memory. ``tried``: the sizes that failed on the way to these rows."""
    pieces = _pieces(_rows(blocks), remembered(op.key))
    if len(pieces) > 1:
        results = [
            _block(op, fn, [x[a:b] for x in blocks], None if out is None else out[a:b], tried)
            for a, b in pieces
        ]
        return out if out is not None else byteorder.join(results)
    try:
        return fn(*blocks, out=out)
    except Exception as exc:
        if not _retry(op.label, op.where, _rows(blocks), exc, tried):
            raise
    return _halves(op, fn, blocks, out, [*tried, _rows(blocks)])


def _halves(
    op: _Operator,
    fn: Callable[..., np.ndarray],
    blocks: Sequence[np.ndarray],
    out: np.ndarray | None,
    tried: list[int],
) -> np.ndarray:
    """After ``fn`` ran out of memory on these rows: remember half their number and
    run them again through :func:`_block`, which cuts them at the remembered size."""
    rows = _rows(blocks)
    _remember(op.key, (rows + 1) // 2)
    log.info("%s ran out of memory on %d rows; retrying on halves", op.label, rows)
    return _block(op, fn, blocks, out, tried)


def call_chunk(
    site: Site, where: Any, op: Any, blocks: Sequence[np.ndarray], row_offset: int
) -> Any:
    """``op.chunk(*blocks, row_offset=row_offset)`` with out-of-memory halving; the
    pieces' partials are combined left to right (``op.combine``). The arguments are
    :func:`call`'s."""
    if site.key not in _sizes:
        # The common case: one call, nothing remembered, nothing to split.
        try:
            return op.chunk(*blocks, row_offset=row_offset)
        except Exception as exc:
            if not _retry(site.label, where, _rows(blocks), exc, ()):
                raise
        who = _Operator(site.key, site.label, where)
        return _chunk_halves(who, op, blocks, row_offset, [_rows(blocks)])
    return _chunk(_Operator(site.key, site.label, where), op, blocks, row_offset, [])


def _chunk(
    who: _Operator, op: Any, blocks: Sequence[np.ndarray], row_offset: int, tried: list[int]
) -> Any:
    """:func:`_block` for a reduction's chunk: the pieces' partials are combined."""
    pieces = _pieces(_rows(blocks), remembered(who.key))
    if len(pieces) > 1:
        partial: Any = None
        for a, b in pieces:
            piece = _chunk(who, op, [x[a:b] for x in blocks], row_offset + a, tried)
            partial = piece if a == 0 else op.combine(partial, piece)
        return partial
    try:
        return op.chunk(*blocks, row_offset=row_offset)
    except Exception as exc:
        if not _retry(who.label, who.where, _rows(blocks), exc, tried):
            raise
    return _chunk_halves(who, op, blocks, row_offset, [*tried, _rows(blocks)])


def _chunk_halves(
    who: _Operator, op: Any, blocks: Sequence[np.ndarray], row_offset: int, tried: list[int]
) -> Any:
    """:func:`_halves` for a reduction's chunk."""
    rows = _rows(blocks)
    _remember(who.key, (rows + 1) // 2)
    log.info("%s ran out of memory on %d rows; retrying on halves", who.label, rows)
    return _chunk(who, op, blocks, row_offset, tried)
