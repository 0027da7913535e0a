"""The compiling process: numba compiles kernels here, never in the process that uses them.

numba's type inference runs under ``warnings.catch_warnings(record=True)``, which is one
state for the whole process: a compile on a background thread would catch the warnings
the user's own threads raise meanwhile (NumPy's "invalid value encountered", a
``pytest.warns``), and its exit would put back a state another thread had changed.
So a process that needs a kernel asks this one, started once per process (by
:data:`~tierflow.operators.compiled.kernels.SERVER_COMMAND`, at a lower priority), to
compile it: it reads the path of a kernel's module from each line of its standard input,
imports the module and calls its ``warm()`` (which compiles every signature and writes
numba's cache beside the module), and answers ``ok`` or ``error: <why>`` on one line. The asking process then loads the
machine code from the cache, which compiles nothing. It ends when its input closes,
after the compile under way, if any: the asking process may have ended meanwhile, and
the kernel then waits on disk for the next one.
"""

from __future__ import annotations

import os
import sys

from .kernels import import_kernel

__all__ = ["compile_module", "main"]


def compile_module(path: str) -> None:
    """Import the kernel module at ``path`` and compile it (numba caches it on disk)."""
    import_kernel(path).warm()


def main() -> None:
    """Compile the module at each path read from standard input, answering on standard
    output."""
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        try:
            compile_module(path)
        except Exception as exc:  # reported to the asking process, which runs NumPy
            answer = f"error: {type(exc).__name__}: {exc}".replace("\n", " ")
        else:
            answer = "ok"
        try:
            sys.stdout.write(answer + "\n")
            sys.stdout.flush()
        except OSError:  # the asking process is gone (a broken pipe): nothing to say
            os._exit(0)


if __name__ == "__main__":
    main()
