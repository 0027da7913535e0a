"""Errors raised by tierflow.

Every error is a :class:`TierflowError`. Leaves also inherit the built-in exception
they resemble, so ``except OSError`` still catches a spill file that could not be
reserved and ``except MemoryError`` still catches an out-of-memory that tierflow
could not work around. Messages say what happened, with the numbers, and what to do.
"""

from __future__ import annotations

import shlex
from pathlib import Path

__all__ = [
    "BlockError",
    "ConfigError",
    "DependencyError",
    "DestinationExistsError",
    "IncompleteError",
    "OutOfMemoryError",
    "SharedMemoryError",
    "SourceError",
    "SpillError",
    "StoreError",
    "TierflowError",
    "install_command",
    "missing_dependency",
]


class TierflowError(Exception):
    """Base class of every error tierflow raises on purpose."""


class ConfigError(TierflowError, ValueError):
    """A setting or ``TIERFLOW_*`` environment variable has a value tierflow cannot use."""


class DependencyError(TierflowError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""


class SpillError(TierflowError, OSError):
    """A spill file could not be created, reserved or mapped (full disk, bad folder)."""


class SharedMemoryError(TierflowError, OSError):
    """A shared-memory (/dev/shm) allocation would not fit the mount."""


class StoreError(TierflowError, OSError):
    """The two-tier store refused an operation (bad folder, value too big, full disk)."""


class OutOfMemoryError(TierflowError, MemoryError):
    """Memory ran out and retrying with smaller pieces did not help."""

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt by calling the class. tblib's exception pickling, which dask and
        # distributed install in every process that imports them, would otherwise call
        # MemoryError.__new__ on this class, which Python refuses.
        return (type(self), self.args, self.__dict__)


class SourceError(TierflowError, ValueError):
    """A file cannot be read as rows: bad ``.npy`` header, wrong size, unsupported layout."""


class IncompleteError(SourceError):
    """A Zarr array that a ``to_zarr`` left unfinished (marked ``complete: false``): the
    chunks it never wrote would read as the fill value. The message says how many are
    missing and how to finish the array."""


class DestinationExistsError(TierflowError, FileExistsError):
    """A sink's destination holds something it may not replace: anything, without
    ``overwrite=True``; with it, anything that is not that sink's own kind of output
    (a file that is not ``.npy``, a folder holding more than one Zarr array)."""


class PortabilityError(TierflowError, TypeError):
    """A task cannot travel to another process: its program does not pickle."""


class BlockError(TierflowError, RuntimeError):
    """A function applied to one row block failed or returned a block of the wrong shape.

    ``index``, ``start`` and ``stop`` name the block (rows ``start:stop``); the original
    exception, if any, is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, index: int = -1, start: int = 0, stop: int = 0) -> None:
        super().__init__(message)
        self.index = index
        self.start = start
        self.stop = stop

    def __reduce__(self) -> tuple[object, ...]:
        # Keeps the block numbers when the error crosses a process boundary.
        return (type(self), self.args, self.__dict__)


def install_command(extra: str) -> str:
    """The command that adds the optional packages of ``extra`` to this tierflow.

    tierflow is not on the package index: it is installed from a checkout. When this
    package is one (its folder's parent holds ``pyproject.toml``, as with ``pip install
    -e``) the command names that checkout, so it works from any folder::

        pip install -e '/home/ann/tierflow[zarr]'

    Otherwise it says to run ``pip install -e '.[zarr]'`` in a checkout.
    """
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file():
        return f"pip install -e {shlex.quote(f'{root}[{extra}]')}"
    return f"pip install -e '.[{extra}]' in a checkout of tierflow (it is not on the package index)"


def missing_dependency(module: str, extra: str, purpose: str) -> DependencyError:
    """Build the error for an optional import that failed; ``purpose`` is what needs it,
    the subject of the sentence (``"tw.from_zarr"``, ``"a progress bar"``).

    >>> str(missing_dependency("tqdm", "progress", "a progress bar"))  # doctest: +ELLIPSIS
    "a progress bar needs the optional package 'tqdm': pip install -e '...[progress]'..."
    """
    return DependencyError(
        f"{purpose} needs the optional package {module!r}: {install_command(extra)}"
    )
