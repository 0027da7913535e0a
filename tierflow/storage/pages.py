"""Page release, readahead and residency for arrays backed by a memory-mapped file.

Streaming a file bigger than RAM through a memory map leaves every page it touched
mapped into the process: RSS (and the memory cgroup's charge) grows until the kernel
reclaims under pressure, which is the slowdown tierflow exists to avoid. So once a
block has been used, its pages are given back, and the next block is asked for early.

Release order (:func:`release`), and why it is this order:

1. Write back (``msync`` of the page range, only for a writable shared mapping).
   ``posix_fadvise(FADV_DONTNEED)`` never drops a dirty page, and ``MADV_DONTNEED`` on a
   shared file mapping only moves the dirty bit to the page cache; writing back first is
   what makes the pages droppable at all.
2. ``madvise(MADV_DONTNEED)`` on the mapping's pages: removes this process's page-table
   entries, so RSS falls now. On a shared file mapping this loses nothing: the next read
   faults the page back in from the page cache or the file.
3. ``posix_fadvise(FADV_DONTNEED)`` on the file range: drops the now unmapped, clean
   pages from the page cache. Done before step 2 it would silently skip every page
   still mapped.

``MADV_DONTNEED`` is never applied to anonymous memory (an ordinary NumPy array) or to a
copy-on-write (``mode="c"``) memmap: there it discards data instead of dropping a copy.
:func:`release` refuses both with :class:`ValueError`.

Page alignment: :func:`release` rounds ``x``'s byte range *outward* to whole pages.
Dropping a file page that ``x`` shares with a neighbouring block costs that neighbour at
most one refault of 4 KB; rounding inward would instead leave every page that straddles
a block boundary mapped for good, so a long stream would keep one page per block.
The page cache goes further: it holds files in folios of up to 2 MB, and
``FADV_DONTNEED`` skips a folio that sticks out of its range. So the cache range also
reaches back to the 2 MB boundary below ``x`` (the tail of the block released before
it, in a forward stream) and, when ``x`` reaches the end of the file, to the end. The
folio that ``x``'s end shares with the next block stays cached until that block is
released: in a stream, every block but the last leaves the cache in full.

Residency (:func:`resident_bytes`, :func:`file_resident_bytes`) is measured with
``mincore``. For a file mapping the kernel reports a page as resident when it is in the
page cache, mapped by this process or not; so ``resident_bytes`` falls to zero only
once the page cache has dropped the range too (``drop_cache=True``). For a file this
process could not open for writing, Linux reports every page resident (a guard against
a cache side channel): the figures are meaningful for your own files, such as spill
files.

>>> import os, tempfile, numpy as np
>>> path = os.path.join(tempfile.mkdtemp(), "x.bin")
>>> x = np.memmap(path, dtype="float64", mode="w+", shape=(1 << 16,))
>>> x[:] = 1.0
>>> _ = release(x); resident_bytes(x), float(x.sum())
(0, 65536.0)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import format_bytes

__all__ = [
    "FileRange",
    "file_range",
    "file_resident_bytes",
    "mapped_bytes",
    "readahead",
    "release",
    "release_path",
    "resident_bytes",
]

PAGE = mmap.PAGESIZE
# mincore needs one byte of output per page; windows of this many pages bound that
# buffer (64 KB) however big the range is.
_MINCORE_WINDOW = 1 << 16
RESIDENT_SAMPLES = 16  # pages readahead() looks at to tell a range is in memory
# The largest page-cache folio: PMD size, 512 pages (2 MB with 4 KB pages).
_FOLIO_MAX = 512 * PAGE
# The kernel's own default readahead window (read_ahead_kb = 128), used when the device
# of a file does not say.
_DEFAULT_WINDOW = 128 * 1024


@dataclass(frozen=True)
class FileRange:
    """The bytes of a file that an array's elements span.

    ``offset`` is the file offset of the lowest byte ``x`` spans and ``nbytes`` the
    length from there to the end of its highest element (for a strided view this
    includes the bytes between its elements). ``data_offset`` is where ``x``'s first
    element (index ``(0, ...)``) lies within the range: 0 unless a stride is negative.
    ``writable`` says whether the mapping writes through to the file (a shared,
    writable mapping: ``mode="r+"`` or ``"w+"``); ``copy_on_write`` marks a private
    (``mode="c"``) mapping, whose changes never reach the file.
    """

    path: str
    offset: int
    nbytes: int
    data_offset: int
    writable: bool
    copy_on_write: bool


@dataclass(frozen=True)
class _Span:
    """Where ``x`` lies in memory and in its file, as :func:`_span` finds it."""

    mm: mmap.mmap  # the mapping that backs x; madvise/flush offsets are relative to it
    mm_address: int  # address of mm's first byte (page-aligned)
    mm_file_offset: int  # file offset of mm's first byte
    low: int  # lowest address x spans
    high: int  # one past the highest address x spans
    path: str | None  # None when the file is no longer known (unlinked or unnamed)
    writable: bool
    copy_on_write: bool


# -- public API ------------------------------------------------------------------------


def release(x: np.ndarray, *, drop_cache: bool = True, count: bool = True) -> int:
    """Give back the memory of ``x``'s pages; ``x`` stays valid and reads the same values.

    ``x`` is a ``np.memmap`` of a file, or a view of one (a slice, ``np.asarray``,
    a reshape). Dirty pages are written to the file first (for a writable mapping),
    then the pages of ``x``'s byte range, rounded outward to whole pages, are removed
    from this process (``MADV_DONTNEED``), and with ``drop_cache`` also from the page
    cache (``FADV_DONTNEED``); see the module docstring for why in this order. The next
    access faults them back in from the file. Without ``drop_cache`` the pages leave
    this process's RSS but stay cached (cheap to fault back, reclaimable by the kernel).
    Pages another process maps stay in the page cache, and so may the folio (up to
    2 MB) that ``x``'s end shares with the bytes after it, until they are released.

    With ``drop_cache``, pages of the range that others dirtied (a file just written
    with ``write()`` and mapped read-only) are written back too, since the kernel never
    drops a dirty page; this costs microseconds when nothing is dirty.

    Returns the bytes of ``x``'s range that were resident before the call (mincore),
    i.e. how much of ``x`` was in memory when it was released; 0 with ``count=False``,
    which skips that page-by-page look (it costs as much as the release over a wide
    range of which few pages were touched).

    Raises ``ValueError`` for an array whose memory is not a file mapping (ordinary
    RAM: dropping its pages would discard the data) or a copy-on-write memmap (the
    same: its changes live only in those pages). Blocks for the write-back of dirty
    pages; safe to call from several threads on different arrays.
    """
    span = _span(x, "release")
    if span is None:
        return 0
    if span.copy_on_write:
        raise ValueError(
            f"release() refused: x is a copy-on-write memmap (mode='c') of {span.path}; "
            f"dropping its pages would discard the {format_bytes(span.high - span.low)} "
            "of changes made through it. Use mode='r+' to write through to the file, "
            "or keep the array in memory."
        )
    before = _resident(span.low, span.high) if count else 0
    start, stop = _mm_pages(span)
    if span.writable:
        # msync wants a page-aligned offset and a range inside the mapping.
        span.mm.flush(start, stop - start)
    span.mm.madvise(mmap.MADV_DONTNEED, start, stop - start)
    if drop_cache and span.path is not None:
        with _open_quiet(span.path) as fd:
            if fd is not None:
                offset, length = _cache_range(fd, span, start, stop)
                # Pages dirtied by someone else (write(), another mapping: a .npy just
                # saved and now mapped read-only) would be skipped by FADV_DONTNEED too.
                _write_back(fd, offset, length)
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    return before


def readahead(x: np.ndarray) -> None:
    """Ask the kernel to start reading ``x``'s pages from its file now, without waiting.

    For a ``np.memmap`` or a view of one: ``madvise(MADV_WILLNEED)`` over ``x``'s page
    range, issued in pieces of the file's device readahead window. On a file mapping
    the kernel implements ``MADV_WILLNEED`` as ``posix_fadvise(POSIX_FADV_WILLNEED)`` of
    the same file range (``mm/madvise.c``), so one call covers both; but either reads at
    most one device readahead window per call (``read_ahead_kb`` or the largest request,
    ``max_sectors_kb``), so a block of hundreds of MB is asked for piece by piece.

    Returns once the reads are queued, which can take a while when the device queue
    is full (here: 23 ms for a cold 128 MB block, whose data arrived 190 ms later); the
    pages land in the page cache (``file_resident_bytes`` rises), to be mapped by the
    next access. A no-op for an array in ordinary RAM (nothing to read), for an empty
    array, and for a range whose pages are in memory already, as told by
    :data:`RESIDENT_SAMPLES` pages spread over it (``mincore`` of each: 10 us, where
    the whole range of 32 MB costs 18 us mapped in this process, 0.9 ms when only in
    the page cache, as for the driver of a cluster that reads ahead for its workers;
    asking the kernel for cached pages costs 144 us), which the thread that schedules
    blocks would spend on every block of a scan of a cached file. A range with pages
    out among the sampled ones is asked for.
    """
    if x.size == 0:
        return
    span = _span(x, "readahead", ram_ok=True)
    if span is None:
        return
    if _sampled_resident(span.low, span.high):
        return
    start, stop = _mm_pages(span)
    step = _readahead_window(span.path)
    for offset in range(start, stop, step):
        span.mm.madvise(mmap.MADV_WILLNEED, offset, min(step, stop - offset))


def resident_bytes(x: np.ndarray) -> int:
    """Bytes of ``x``'s range that are in memory now, measured with ``mincore``.

    Works for any array: for ordinary RAM it counts the pages faulted in; for a file
    mapping it counts the pages in memory (mapped, or in the page cache) — what a read
    of ``x`` would find without going to disk. Partial pages at the ends count only
    the bytes inside ``x``'s range, so the result is at most the range's length.
    No side effects; costs one byte of kernel output per page.
    """
    if x.size == 0:
        return 0
    low, high = _address_range(x)
    return _resident(low, high)


def mapped_bytes(x: np.ndarray) -> int:
    """Bytes of ``x``'s pages mapped into this process now: its share of RSS.

    Unlike :func:`resident_bytes`, a file page that is only in the page cache does not
    count; this is what :func:`release` without ``drop_cache`` brings to zero, and what
    a process that received an array by path has before it touches the data. Whole
    pages are counted (a partial page at either end counts fully). Reads the present
    bit of ``/proc/self/pagemap``: 8 bytes per page of the range.
    """
    if x.size == 0:
        return 0
    low, high = _address_range(x)
    first, last = low // PAGE, -(-high // PAGE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first) * 8), dtype=np.uint64)
    return int(np.count_nonzero(entries >> np.uint64(63))) * PAGE


def file_resident_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the file at ``path`` that are in the page cache now.

    Maps the file read-only (touching nothing, so the measurement does not change the
    figure) and asks ``mincore``. Raises ``FileNotFoundError`` for a missing file. For a
    file this process could not open for writing, Linux reports every page resident.
    """
    with _open(path) as fd:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        with _mapped(fd, size) as address:
            return _resident(address, address + size)


def release_path(path: str | os.PathLike[str]) -> int:
    """Drop a whole file's pages from the page cache (``posix_fadvise(FADV_DONTNEED)``).

    For a file this process no longer maps, such as an input file that has been read
    with ``open().read()`` or an output written with ``write()``. Dirty pages are
    written to the file first (``sync_file_range``: the data only, no journal commit),
    since the kernel never drops a dirty page. Returns the bytes that were in the page
    cache before the call.

    Raises ``ValueError`` while this process still maps the file (checked in
    ``/proc/self/maps``): the kernel keeps every page a mapping uses, so by path this
    would free nothing of the mapping's pages; release the mapped array with
    :func:`release` instead, or close it first. Raises ``FileNotFoundError`` for a
    missing file.
    """
    path = os.fspath(path)
    with _open(path) as fd:
        st = os.fstat(fd)
        mappings = _mappings_of(path, st)
        if mappings:
            raise ValueError(
                f"release_path() refused: this process still maps {path} "
                f"({len(mappings)} mapping{'s' if len(mappings) != 1 else ''}, "
                f"{format_bytes(sum(end - start for start, end in mappings))}); the kernel "
                "keeps every page a mapping uses, so dropping the file's cache by path "
                "would free nothing of them. Release the mapped array instead "
                "(memory.release(x)), or delete it first and then release by path."
            )
        before = 0
        if st.st_size > 0:
            with _mapped(fd, st.st_size) as address:
                before = _resident(address, address + st.st_size)
        _write_back(fd, 0, 0)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return before


def file_range(x: np.ndarray) -> FileRange | None:
    """The file bytes ``x``'s elements span, or None for an array in ordinary RAM.

    Raises ``ValueError`` when the file is no longer known (unlinked since it was
    mapped, or mapped from an unnamed file).
    """
    span = _span(x, "file_range", ram_ok=True)
    if span is None:
        return None
    if span.path is None or not os.path.exists(span.path):
        raise ValueError(
            "file_range(): x is memory-mapped, but its file has been deleted or has no "
            "name, so no path can be given for it"
        )
    data = _data_address(x)
    return FileRange(
        path=span.path,
        offset=span.mm_file_offset + (span.low - span.mm_address),
        nbytes=span.high - span.low,
        data_offset=data - span.low,
        writable=span.writable,
        copy_on_write=span.copy_on_write,
    )


# -- where x lives ---------------------------------------------------------------------


def _data_address(x: np.ndarray) -> int:
    return int(x.__array_interface__["data"][0])


def _extent(x: np.ndarray) -> tuple[int, int]:
    """Byte offsets, relative to ``x``'s first element, of the lowest byte ``x`` spans
    and one past the highest (negative strides reach below the first element)."""
    low = high = 0
    for n, stride in zip(x.shape, x.strides, strict=True):
        if stride > 0:
            high += (n - 1) * stride
        else:
            low += (n - 1) * stride
    return low, high + x.itemsize


def _address_range(x: np.ndarray) -> tuple[int, int]:
    data = _data_address(x)
    low, high = _extent(x)
    return data + low, data + high


def _owner(x: np.ndarray) -> tuple[mmap.mmap | None, np.memmap | None]:
    """Walk ``x``'s ``.base`` chain to the mmap object that backs it, and the
    ``np.memmap`` holding it, which knows the file's name, mode and offset (None for a
    bare ``mmap.mmap`` under ``np.frombuffer``)."""
    obj: Any = x
    for _ in range(64):  # a base chain is short; bound it against a pathological cycle
        mapping = getattr(obj, "_mmap", None) if isinstance(obj, np.memmap) else None
        if mapping is not None:
            return mapping, obj
        if isinstance(obj, mmap.mmap):
            return obj, None
        if isinstance(obj, memoryview):
            obj = obj.obj
        elif isinstance(obj, np.ndarray):
            obj = obj.base
        else:
            return None, None
    return None, None


def _span(x: np.ndarray, caller: str, *, ram_ok: bool = False) -> _Span | None:
    """Locate ``x`` in its mapping and file; None for an empty array or (``ram_ok``)
    one in ordinary RAM, else ``ValueError`` naming ``caller``."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{caller}() takes a NumPy array, got {type(x).__name__}")
    mm, memmap = _owner(x)
    if mm is None:
        if ram_ok:
            return None
        raise ValueError(
            f"{caller}() refused: x ({format_bytes(x.nbytes)}, {x.dtype}) is an ordinary "
            "in-memory array, not a view of a memory-mapped file; dropping its pages "
            "would discard its data. Only arrays backed by a file (memory.array spilled "
            "to disk, np.memmap, np.load(mmap_mode=...)) can be released."
        )
    if x.size == 0:
        return None
    # The buffer export keeps mm from being closed while its address is in use; x
    # itself already prevents that, so this is only a way to read the address.
    mm_address = int(np.frombuffer(mm, dtype=np.uint8).__array_interface__["data"][0])
    low, high = _address_range(x)
    if memmap is not None and memmap.filename is not None:
        # np.memmap maps from its offset rounded down to the allocation granularity.
        offset = int(memmap.offset)
        return _Span(
            mm=mm,
            mm_address=mm_address,
            mm_file_offset=offset - offset % mmap.ALLOCATIONGRANULARITY,
            low=low,
            high=high,
            path=str(memmap.filename),
            writable=memmap.mode in ("r+", "w+"),
            copy_on_write=memmap.mode == "c",
        )
    # A bare mmap.mmap (np.frombuffer) or an unnamed memmap: the kernel knows the file.
    entry = _maps_entry(mm_address)
    if entry is None:
        raise ValueError(
            f"{caller}(): x is backed by an mmap at {mm_address:#x} that /proc/self/maps "
            "does not list as a file mapping"
        )
    perms, file_offset, path = entry
    return _Span(
        mm=mm,
        mm_address=mm_address,
        mm_file_offset=file_offset,
        low=low,
        high=high,
        path=path,
        writable=perms[1] == "w" and perms[3] == "s",
        copy_on_write=perms[3] == "p" and perms[1] == "w",
    )


def _mm_pages(span: _Span) -> tuple[int, int]:
    """``span``'s range as offsets into its mmap, rounded outward to whole pages and
    kept inside the mapping."""
    start = (span.low - span.mm_address) // PAGE * PAGE
    stop = -(-(span.high - span.mm_address) // PAGE) * PAGE
    return start, min(stop, len(span.mm))


def _cache_range(fd: int, span: _Span, start: int, stop: int) -> tuple[int, int]:
    """The file range to drop from the page cache for mmap pages [start, stop).

    The page cache holds a file in folios of up to :data:`_FOLIO_MAX` bytes, aligned to
    their size, and FADV_DONTNEED skips a folio that sticks out of the range at either
    end. So the range starts at the folio boundary below it: in a forward stream that
    is the tail of the block released before, finished, now dropped in full (a folio
    still mapped anywhere is skipped, so nothing in use is lost; at worst a clean page
    is read again). It runs to the end of the file when it reaches it (length 0), so
    the folio holding the file's end goes too. Its other end is left exact, so the next
    block's readahead stays; that block's release takes the folio they share.
    """
    offset = span.mm_file_offset + start
    end = span.mm_file_offset + stop
    low = offset - offset % _FOLIO_MAX
    if end >= os.fstat(fd).st_size:
        return low, 0
    return low, end - low


# -- /proc/self/maps -------------------------------------------------------------------


def _read_maps() -> Iterator[tuple[int, int, str, int, str, int, str]]:
    """Rows of ``/proc/self/maps``: start, end, perms, offset, device, inode, path."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue
            start, end = (int(v, 16) for v in fields[0].split("-"))
            yield (
                start,
                end,
                fields[1],
                int(fields[2], 16),
                fields[3],
                int(fields[4]),
                (fields[5].rstrip("\n")),
            )


def _maps_entry(address: int) -> tuple[str, int, str | None] | None:
    """Permissions, file offset of ``address`` and path of the mapping that holds it."""
    for start, end, perms, offset, _dev, inode, path in _read_maps():
        if start <= address < end:
            if inode == 0:
                return None  # anonymous memory, never a file
            deleted = path.endswith(" (deleted)")
            return perms, offset + (address - start), None if deleted else path
    return None


def _mappings_of(path: str, st: os.stat_result) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of the file ``st`` describes.

    Matched by device and inode (a symlink or a relative path names the same file),
    and by path as well, since an overlay filesystem may report its lower file's inode.
    """
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    real = os.path.realpath(path)
    return [
        (start, end)
        for start, end, _perms, _offset, dev, inode, mapped in _read_maps()
        if (inode == st.st_ino and dev == device) or mapped == real
    ]


# -- mincore, files, readahead window --------------------------------------------------


_SYNC_FILE_RANGE_ALL = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.mincore.restype = ctypes.c_int
    if hasattr(libc, "sync_file_range"):
        libc.sync_file_range.argtypes = [
            ctypes.c_int,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_uint,
        ]
        libc.sync_file_range.restype = ctypes.c_int
    return libc


def _write_back(fd: int, offset: int, length: int) -> None:
    """Write the dirty pages of a file range to disk and wait (``length`` 0: to the end).

    ``sync_file_range`` moves only the data, which is all that dropping pages needs; an
    ``fdatasync`` would also commit the journal (half a second on a clean 256 MB file
    here, against 20 microseconds)."""
    libc = _libc()
    if not hasattr(libc, "sync_file_range"):
        os.fdatasync(fd)
        return
    if libc.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_ALL) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sync_file_range: {os.strerror(errno)}")


def _sampled_resident(low: int, high: int) -> bool:
    """Whether the pages of [low, high) are in memory, by :data:`RESIDENT_SAMPLES` of
    them spread evenly over it (the first and the last among them)."""
    first = low // PAGE
    pages = -(-high // PAGE) - first
    count = min(pages, RESIDENT_SAMPLES)
    vec = np.zeros(1, dtype=np.uint8)
    out, mincore, step = vec.ctypes.data, _libc().mincore, max(1, count - 1)
    for k in range(count):
        page = first + (k * (pages - 1)) // step
        if mincore(page * PAGE, PAGE, out) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"mincore over one page: {os.strerror(errno)}")
        if not vec[0] & 1:
            return False
    return True


def _resident(low: int, high: int) -> int:
    """Bytes of [low, high) in memory: resident pages, with partial end pages counted
    only for their part inside the range."""
    if high <= low:
        return 0
    first = low // PAGE * PAGE
    last = -(-high // PAGE) * PAGE
    pages = (last - first) // PAGE
    vec = np.empty(min(pages, _MINCORE_WINDOW), dtype=np.uint8)
    mincore = _libc().mincore
    total = 0
    head = tail = False
    for index in range(0, pages, _MINCORE_WINDOW):
        count = min(_MINCORE_WINDOW, pages - index)
        if mincore(first + index * PAGE, count * PAGE, vec.ctypes.data) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"mincore over {count * PAGE} bytes: {os.strerror(errno)}")
        bits = vec[:count] & 1
        total += int(bits.sum())
        if index == 0:
            head = bool(bits[0])
        if index + count == pages:
            tail = bool(bits[count - 1])
    resident = total * PAGE
    if head:
        resident -= low - first
    if tail:
        resident -= last - high
    return resident


@contextlib.contextmanager
def _open(path: str | os.PathLike[str]) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _open_quiet(path: str) -> Iterator[int | None]:
    """An O_RDONLY descriptor of ``path``, or None if the file has gone meanwhile (a
    spill file freed while a view of it is released: nothing left to drop by path).

    Opened per call: an open/close costs microseconds next to the megabytes a release
    moves, and a cached descriptor would pin a deleted spill file's disk space."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _mapped(fd: int, size: int) -> Iterator[int]:
    """The address of a fresh read-only shared mapping of ``fd``; nothing is touched."""
    mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    try:
        view = np.frombuffer(mm, dtype=np.uint8)
        yield int(view.__array_interface__["data"][0])
        del view
    finally:
        mm.close()


def _readahead_window(path: str | None) -> int:
    """Bytes one WILLNEED request reads at most for the device holding ``path``."""
    if path is None:
        return _DEFAULT_WINDOW
    try:
        device = os.stat(path).st_dev
    except OSError:
        return _DEFAULT_WINDOW
    return _device_window(device)


@functools.lru_cache(maxsize=64)
def _device_window(device: int) -> int:
    """max(read_ahead_kb, max_sectors_kb) of the block device, rounded to pages; the
    kernel's default window for a device sysfs does not describe (tmpfs, overlay)."""
    base = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):  # a disk, or a partition's disk
        sizes = []
        for name in ("read_ahead_kb", "max_sectors_kb"):
            try:
                with open(f"{queue}/{name}") as f:
                    sizes.append(int(f.read()) * 1024)
            except (OSError, ValueError):
                continue
        if sizes and max(sizes) > 0:
            return max(PAGE, max(sizes) // PAGE * PAGE)
    return _DEFAULT_WINDOW
