"""Keep the results of an expensive function across runs with ``@memory.cached``.

Run it twice: the first run computes three spectra (about a second each), the second
finds every result in the store and returns it in about a millisecond, memory-mapped
from the SSD::

    python examples/cached_across_runs.py            # computes: 3 misses
    python examples/cached_across_runs.py            # 3 hits
    python examples/cached_across_runs.py --clear    # forget this function's results

Edit the body of ``spectrum`` (or a function it calls) and run again: the function's
code, the helpers it calls and the globals it reads are part of the key, so the edited
function misses instead of returning stale results.

The store and its signing key live under a temporary folder; ``--dir`` picks another.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from tierflow import config, memory

# How long the "expensive" part takes (s). A global the function reads is part of its
# key, like its code: a run with another --seconds has entries of its own.
WORK_SECONDS = 1.0


@memory.cached(store="example-spectra", ram_mb=64, disk_gb=1)
def spectrum(seed: int, n: int = 1_000_000) -> np.ndarray:
    """The magnitude spectrum of ``n`` samples of seeded noise (slow on purpose)."""
    time.sleep(WORK_SECONDS)
    samples = np.random.default_rng(seed).standard_normal(n)
    return np.abs(np.fft.rfft(samples))


def main() -> None:
    global WORK_SECONDS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir",
        default=os.path.join(tempfile.gettempdir(), "tierflow-example-cached"),
        help="folder for the store and its signing key (default: %(default)s)",
    )
    parser.add_argument("--seconds", type=float, default=WORK_SECONDS, help="work per call (s)")
    parser.add_argument("--clear", action="store_true", help="remove the cached results")
    args = parser.parse_args()
    WORK_SECONDS = args.seconds
    # Stores named by a word live under store_dir, and the signing key next to it.
    config.set(store_dir=os.path.join(args.dir, "store"))

    if args.clear:
        spectrum.cache_clear()
        print(f"cleared; {spectrum.store!r}")
        return

    for seed in (1, 2, 3):
        before = spectrum.cache_info().hits
        start = time.perf_counter()
        result = spectrum(seed)
        elapsed = time.perf_counter() - start
        how = "hit " if spectrum.cache_info().hits > before else "miss"
        print(
            f"spectrum({seed}): {how} in {elapsed * 1000:8.1f} ms, "
            f"{result.nbytes / 2**20:.1f} MB, {type(result).__name__}"
        )

    info = spectrum.cache_info()
    print(f"cache_info: hits={info.hits}, misses={info.misses}, entries={info.entries}")
    print(spectrum.store)


if __name__ == "__main__":
    main()
