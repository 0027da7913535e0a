"""Before/after: run bench_engine.py workloads under several source trees, in one run.

Each tree is a checkout of tierflow (e.g. ``git archive <commit> | tar -x -C /tmp/old``).
The contenders alternate, each in its own process with the tree on ``PYTHONPATH`` and
the file's page cache warm; every tree's best and median of ``--repeat`` runs are
printed, with their ratios to the first tree's::

    python tests/benchmarks/compare_trees.py FILE.npy old=/tmp/old new=. \\
        --kinds tw-sum,tw-chain --repeat 3

``FILE.npy`` is a float32 ``[N, 8]`` file (``--make-rows N`` writes one first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import ensure_warm, make_npy

HERE = Path(__file__).resolve().parent


def run_child(tree: Path, kind: str, path: str, timeout: float) -> float | None:
    """Seconds of one ``bench_engine.py --child`` run under ``tree``; None if it failed.
    A kind that writes a file (``tw-std``) writes a new one beside ``path``, removed
    afterwards."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    script = tree / "tests" / "benchmarks" / "bench_engine.py"
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(path))) as scratch:
        command = [sys.executable, str(script), "--child", kind, path]
        if kind.endswith("-std"):
            command += ["--out", os.path.join(scratch, "out.npy")]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        print(f"{tree} {kind}: failed ({run.returncode}): {run.stderr[-1000:]}", file=sys.stderr)
        return None
    return float(json.loads(lines[-1])["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("trees", nargs="+", help="NAME=FOLDER; the first is the baseline")
    parser.add_argument("--kinds", default="tw-sum,tw-chain", help="bench_engine.py kinds")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--make-rows", type=int, help="write a [N, 8] float32 file first")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.make_rows:
        make_npy(args.path, args.make_rows, 8)
    trees = {name: Path(folder).resolve() for name, folder in (t.split("=", 1) for t in args.trees)}
    kinds = args.kinds.split(",")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeat):
        for kind in kinds:
            for name, tree in trees.items():
                ensure_warm(args.path)
                seconds = run_child(tree, kind, args.path, args.timeout)
                if seconds is not None:
                    times.setdefault((kind, name), []).append(seconds)
    size = os.path.getsize(args.path)
    first = next(iter(trees))
    for kind in kinds:
        base = times.get((kind, first))
        for name in trees:
            found = times.get((kind, name))
            if not found or not base:
                print(f"{kind:10} {name:8} failed")
                continue
            best, median = min(found), statistics.median(found)
            print(
                f"{kind:10} {name:8} best {size / best / 1e9:6.2f} GB/s "
                f"({min(base) / best:.2f}x), median {size / median / 1e9:6.2f} GB/s "
                f"({statistics.median(base) / median:.2f}x), {len(found)} runs"
            )


if __name__ == "__main__":
    main()
