"""Shared machinery of the benchmark suites: child processes, their memory, the data.

Every contender of a benchmark runs in its own child process, so that its peak memory
is its own. The parent starts the child with :func:`run_sampled`, which reads the
child's ``/proc/<pid>/status`` every 20 ms (``VmRSS``: all resident pages; ``RssAnon``:
the anonymous part, i.e. heap and copies, leaving out pages of mapped files, which the
kernel can drop at any time). The child times its measured part with :class:`Measure`
and prints its figures as a JSON line, the last line of its stdout (:func:`emit`);
``Measure`` takes the peak RSS from the child's own ``VmHWM``.

Not ``ru_maxrss``: Linux carries it across ``execve`` from the process image that was
replaced, and Python starts children with ``vfork``, so a child's ``ru_maxrss`` starts
at its parent's peak.

Data files are written with :func:`make_npy` block by block through a memory map whose
pages are written back and dropped from the process as it goes, so generating a file
bigger than RAM holds at most one block; :func:`warm` then reads it into the page cache
without mapping it.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MB = 1 << 20
SAMPLE_S = 0.02
_STATUS_FIELDS = ("VmRSS", "RssAnon", "VmHWM")


class Sample(NamedTuple):
    """One reading of a child's memory: ``t`` seconds since it started (monotonic clock),
    ``rss`` and ``anon`` (``VmRSS`` and ``RssAnon``) in bytes."""

    t: float
    rss: int
    anon: int


# -- child side ---------------------------------------------------------------------------


def status(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS``, ``RssAnon`` and ``VmHWM`` of a process, in bytes, from
    ``/proc/<pid>/status``. Raises ``OSError`` when the process is gone."""
    figures: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in _STATUS_FIELDS:
                figures[name] = int(value.split()[0]) * 1024
    return figures


def peak_rss() -> int:
    """This process's peak RSS in bytes (``VmHWM``; see the module docstring for why
    not ``ru_maxrss``)."""
    return status().get("VmHWM", 0)


@dataclass
class Measure:
    """The child's timing of its measured part.

    ``start()`` and ``stop()`` take the monotonic time (``started_at`` / ``stopped_at``,
    comparable with the parent's clock, so the parent can pick the samples taken in
    between), the RSS when the part starts (``baseline_rss``: interpreter and imports)
    and the peak RSS at its end. ``stop(**extra)`` records further figures.
    """

    figures: dict[str, Any] = field(default_factory=dict)
    _t0: float = 0.0

    def start(self) -> None:
        """Start the clock; also prints the start as a JSON line at once, so that the
        parent can place the samples of a child that is killed before it finishes."""
        self.figures["started_at"] = time.monotonic()
        self.figures["baseline_rss"] = status().get("VmRSS", 0)
        emit(dict(self.figures))
        self._t0 = time.perf_counter()

    def lap(self, name: str) -> float:
        """Seconds since ``start()``, recorded under ``name``."""
        seconds = time.perf_counter() - self._t0
        self.figures[name] = seconds
        return seconds

    def stop(self, **extra: Any) -> None:
        self.figures["seconds"] = time.perf_counter() - self._t0
        self.figures["stopped_at"] = time.monotonic()
        self.figures["peak_rss"] = peak_rss()
        self.figures.update(extra)


def emit(figures: dict[str, Any]) -> None:
    """Print the child's figures as the one JSON line the parent reads."""
    print(json.dumps(figures, default=_plain), flush=True)


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


# -- parent side --------------------------------------------------------------------------


@dataclass
class ChildRun:
    """A finished child: exit status (negative: killed by that signal), its output, the
    samples, and the monotonic time it was started at."""

    returncode: int
    stdout: str
    stderr: str
    samples: list[Sample]
    started_at: float
    wall_s: float
    timed_out: bool = False

    def figures(self) -> dict[str, Any]:
        """The child's last JSON line: its figures, or only the start of its measured part
        (``Measure.start``) when it was killed before the end; ``{}`` without either."""
        for line in reversed(self.stdout.strip().splitlines()):
            with contextlib.suppress(ValueError):
                value = json.loads(line)
                if isinstance(value, dict):
                    return value
        return {}

    def window(self, start: float | None, stop: float | None) -> list[Sample]:
        """The samples taken between two monotonic times (the child's measured part);
        all samples where a bound is missing."""
        lo = -1e300 if start is None else start - self.started_at
        hi = 1e300 if stop is None else stop - self.started_at
        return [s for s in self.samples if lo <= s.t <= hi]


def run_sampled(
    cmd: Sequence[str],
    *,
    timeout: float,
    wrap: Callable[[Sequence[str]], list[str]] | None = None,
    env: dict[str, str] | None = None,
) -> ChildRun:
    """Run ``cmd`` (through ``wrap``, e.g. a cgroup's) and sample its memory every 20 ms.

    A child still running after ``timeout`` seconds is killed and reported with
    ``timed_out`` (its return code is then the kill's, -9). The pid of a wrapped
    command must be the command's own (the wrapper ``exec``s it), or the samples
    would be the wrapper's.
    """
    full = wrap(cmd) if wrap is not None else list(cmd)
    samples: list[Sample] = []
    started_at = time.monotonic()
    proc = subprocess.Popen(
        full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                s = status(proc.pid)
            except OSError:
                return  # the child has exited
            if "VmRSS" in s:  # a zombie has none
                samples.append(
                    Sample(time.monotonic() - started_at, s["VmRSS"], s.get("RssAnon", 0))
                )
            done.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        out, err = proc.communicate()
    finally:
        done.set()
        sampler.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return ChildRun(
        returncode=proc.returncode,
        stdout=out,
        stderr=err + (f"\n(killed: still running after {timeout:.0f} s)" if timed_out else ""),
        samples=samples,
        started_at=started_at,
        wall_s=time.monotonic() - started_at,
        timed_out=timed_out,
    )


# -- data ---------------------------------------------------------------------------------


def make_npy(
    path: str | os.PathLike[str],
    rows: int,
    width: int,
    *,
    block_rows: int = 1 << 20,
    seed: int = 0,
) -> Path:
    """Write a float32 ``[rows, width]`` ``.npy`` of uniform values in [0, 1) to ``path``.

    Written through ``np.lib.format.open_memmap`` one block at a time; each block's pages
    are written back and dropped from this process after it is filled (they stay in the
    page cache), so the process never holds more than one block whatever the file size.
    """
    from tierflow.storage import pages

    path = Path(path)
    rng = np.random.default_rng(seed)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, width))
    try:
        for start in range(0, rows, block_rows):
            block = out[start : start + block_rows]
            rng.random(block.shape, dtype=np.float32, out=block)
            pages.release(block, drop_cache=False)
    finally:
        del out  # unmapped here, so the file's cache can be dropped by path later
    return path


def warm(path: str | os.PathLike[str], piece: int = 64 * MB) -> int:
    """Read the whole file through the page cache (without mapping it); returns the
    bytes of the file resident in the page cache afterwards."""
    from tierflow.storage import pages

    buffer = bytearray(piece)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return pages.file_resident_bytes(path)


def ensure_warm(path: str | os.PathLike[str]) -> float:
    """Warm the file unless at least 99 % of it is cached already; returns the cached
    fraction afterwards."""
    from tierflow.storage import pages

    size = os.path.getsize(path)
    if size and pages.file_resident_bytes(path) < 0.99 * size:
        warm(path)
    return pages.file_resident_bytes(path) / size if size else 1.0


def drop_cache(path: str | os.PathLike[str]) -> None:
    """Drop the file's pages from the page cache (its next reader reads the disk, and in
    a memory cgroup those reads are charged to that cgroup)."""
    from tierflow.storage import pages

    pages.release_path(path)


# -- plots --------------------------------------------------------------------------------


Series = tuple[str, Sequence[Sample]]


def plot_rss(
    panels: Sequence[tuple[str, Sequence[Series]]],
    png: str | os.PathLike[str],
    *,
    title: str = "",
    xlabel: str = "seconds since the child started",
) -> None:
    """Write RSS-over-time panels (one per benchmark) to ``png``: per series, ``VmRSS``
    as a solid line and ``RssAnon`` as a dashed one of the same colour, in MB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.8 * len(panels)), squeeze=False)
    for ax, (name, series) in zip(axes[:, 0], panels, strict=True):
        for k, (label, samples) in enumerate(series):
            colour = f"C{k}"
            t = [s.t for s in samples]
            ax.plot(t, [s.rss / MB for s in samples], color=colour, label=f"{label}: RSS")
            ax.plot(
                t,
                [s.anon / MB for s in samples],
                color=colour,
                linestyle="--",
                label=f"{label}: anonymous",
            )
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("MB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def save_figures(report: dict[str, Any], rows: list[Any], path: str | None) -> bool:
    """Write ``report`` with its target ``rows`` (and their verdicts) as JSON to ``path``
    when one is given; whether a target was missed."""
    if path:
        report["targets"] = [{**t.__dict__, "verdict": t.verdict} for t in rows]
        Path(path).write_text(json.dumps(report, indent=1, default=str))
        print(f"figures: {path}")
    return any(t.verdict == "MISS" for t in rows)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and the seconds it took."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def span(values: Sequence[float], unit: str = "x", scale: float = 1.0) -> str:
    """The median of ``values`` (times ``scale``) and their range, in ``unit``:
    ``"1.52x (1.40-1.61)"``; ``"-"`` for none."""
    if not values:
        return "-"
    v = [x * scale for x in values]
    return f"{statistics.median(v):.2f}{unit} ({min(v):.2f}-{max(v):.2f})"


def verdict(value: float | None, target: float | None, at_least: bool = True) -> str:
    """A target row's verdict: PASS when ``value`` reaches ``target`` (at least, or at
    most when ``at_least`` is False), MISS when it does not or was not measured, INFO
    for a figure without a target."""
    if target is None:
        return "INFO"
    if value is None:
        return "MISS"
    ok = value >= target if at_least else value <= target
    return "PASS" if ok else "MISS"


def report_run(
    bench: Callable[[], dict[str, Any]],
    describe: Callable[[dict[str, Any]], list[str]],
    path: str | None,
) -> dict[str, Any]:
    """A suite's run from the command line: ``bench()``, its report in the lines
    ``describe`` gives, the time it all took, and the figures as JSON in ``path`` when
    one is given."""
    started = time.monotonic()
    report = bench()
    print("\n".join(describe(report)))
    print(f"({time.monotonic() - started:.0f} s in all)")
    if path:
        Path(path).write_text(json.dumps(report, indent=1, default=str))
    return report


def in_cgroup(cmd: Sequence[str], limit_mb: int, timeout: float) -> str:
    """Run ``cmd``, a child that prints ``seconds peak_rss_kb``, in a memory cgroup of
    ``limit_mb``; how it went, in words: its time and peak RSS or its failure, the
    cgroup's peak and its OOM kills. Needs ``tests/`` on ``sys.path`` (cgroups.py)."""
    from cgroups import memory_cgroup

    with memory_cgroup(limit_mb << 20) as cg:
        proc = cg.run(list(cmd), timeout=timeout)
        peak = cg.peak_bytes()
        kills = cg.oom_kills()
    if proc.returncode == 0:
        seconds, rss_kb = proc.stdout.split()[:2]
        what = f"completed in {float(seconds):.1f} s, peak RSS {int(rss_kb) >> 10} MB"
    else:
        what = f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    peak_text = "?" if peak is None else f"{peak >> 20} MB"
    return f"{what}; cgroup peak {peak_text}, OOM kills {kills}"
