"""What the GPU check scripts share: named checks that print PASS/FAIL, and figures."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable

results: list[tuple[str, bool]] = []  # (check, passed), in the order they ran


def check(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """A decorator: the function becomes a check named ``name`` that prints ``PASS
    name (seconds)`` or ``FAIL name`` with its traceback, and records the outcome."""

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            start = time.perf_counter()
            try:
                fn()
            except Exception:
                print(f"FAIL {name}")
                traceback.print_exc()
                results.append((name, False))
            else:
                print(f"PASS {name} ({time.perf_counter() - start:.1f} s)")
                results.append((name, True))
            sys.stdout.flush()

        return run

    return wrap


def figure(text: str) -> None:
    """Print a measured figure (one ``FIGURE`` line)."""
    print(f"FIGURE {text}")
    sys.stdout.flush()
