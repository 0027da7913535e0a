"""The ``tierflow`` command (also ``python -m tierflow``).

::

    tierflow status          # status line, limits, pressure, devices and GPU budgets
    tierflow status --json   # the same as one JSON object, sizes in bytes
    tierflow status --watch  # the status line every second until Ctrl-C (--interval S)
    tierflow demo            # a file 4x the RAM budget, standardised in two streamed passes
    tierflow profile script.py [args]   # run a script, every compute profiled: script.profile.html
    tierflow --version

Exit codes: 0 ok, 1 tierflow failed (the message says why), 2 bad usage: an unknown
command or option, or a malformed ``TIERFLOW_*`` setting.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

from . import __version__
from .config import parse_size
from .errors import ConfigError, TierflowError

__all__ = ["demo", "main", "profile", "status", "watch"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierflow",
        description=(
            "Out-of-core dataflow: RAM while it fits, a memory-mapped spill file on the "
            "SSD when it does not, the GPU with the most free memory when an operator "
            "runs there."
        ),
    )
    parser.add_argument("--version", action="version", version=f"tierflow {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    status_parser = commands.add_parser(
        "status",
        help="show memory, limits, pressure and devices as this process sees them",
        description="Show RAM, budget, swap, SSD, cores, pressure and GPUs.",
    )
    status_parser.add_argument(
        "--json", action="store_true", help="print one JSON object, sizes in bytes"
    )
    status_parser.add_argument(
        "--watch",
        action="store_true",
        help="print the status line again every --interval seconds until Ctrl-C "
        "(with --json: one JSON object of the status per line)",
    )
    status_parser.add_argument(
        "--interval",
        type=_seconds,
        default=1.0,
        help="seconds between lines with --watch (default 1)",
    )
    status_parser.set_defaults(run=status)
    demo_parser = commands.add_parser(
        "demo",
        help="run the demo pipeline on a generated file bigger than the RAM budget",
        description=(
            "Generate a float32 .npy several times bigger than a small RAM budget, compute "
            "per-column mean and std in one pass, write the standardised features with "
            "to_npy, and print throughput, peak RSS and the budget."
        ),
    )
    demo_parser.add_argument(
        "--budget", default="256MB", help="RAM budget for the demo (default 256MB)"
    )
    demo_parser.add_argument(
        "--size", default="1GB", help="size of the generated file (default 1GB)"
    )
    demo_parser.set_defaults(run=demo)
    profile_parser = commands.add_parser(
        "profile",
        help="run a Python script with every compute profiled; write script.profile.html",
        usage="tierflow profile [-h] script [args ...]",
        description=(
            "Run SCRIPT as python would (its arguments after it), recording every compute "
            "it runs on this thread into one profile, and write the report next to it as "
            "SCRIPT.profile.html: task stream by worker, memory by tier, the figures."
        ),
    )
    profile_parser.add_argument("script", help="the Python script to run")
    script_args = profile_parser.add_argument(
        "args", nargs=argparse.REMAINDER, help="its arguments (optional)"
    )
    # argparse counts a REMAINDER positional as required; a script may take none.
    script_args.required = False
    profile_parser.set_defaults(run=profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "run", None) is None:
        parser.print_usage(sys.stderr)
        print("tierflow: error: give a command: status, demo or profile", file=sys.stderr)
        return 2
    try:
        code: int = args.run(args)
    except ConfigError as exc:
        print(f"tierflow: error: {exc}", file=sys.stderr)
        return 2
    except TierflowError as exc:
        print(f"tierflow: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`tierflow status | head`): not an error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not complain again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


def _report() -> dict[str, Any]:
    """Status, limits, pressure and devices, read once each."""
    from .system import devices, pressure
    from .system import status as status_module

    return {
        "status": status_module.status(),
        "limits": status_module.limits(),
        "pressure": pressure.pressure(),
        "devices": devices.devices(),
    }


def _seconds(text: str) -> float:
    """``--interval``: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"give a number of seconds above 0, not {text!r}")
    return value


def watch(interval: float, as_json: bool = False) -> int:
    """Print the status line (or its JSON object) every ``interval`` seconds until
    Ctrl-C, which ends it with exit code 0."""
    from .system import status as status_module

    try:
        while True:
            line = status_module.status()
            text = json.dumps(_jsonable(line)) if as_json else str(line)
            print(text, flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


@contextlib.contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """Warnings as ``tierflow: warning: ...`` lines on stderr, each message once (a
    status that cannot spill, every second of ``--watch``)."""

    def show(message: Warning | str, *_: object, **__: object) -> None:
        print(f"tierflow: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("once")
        warnings.showwarning = show
        yield


def status(args: argparse.Namespace) -> int:
    """``tierflow status [--json] [--watch [--interval S]]``: print the machine as
    tierflow sees it; what it warns of (a spill folder it cannot write) on stderr."""
    with _warnings_as_lines():
        return _status(args)


def _status(args: argparse.Namespace) -> int:
    if args.watch:
        return watch(args.interval, args.json)
    report = _report()
    if args.json:
        print(json.dumps({name: _jsonable(value) for name, value in report.items()}, indent=2))
        return 0
    print(report["status"])
    print(f"limits:   {report['limits']}")
    print(f"pressure: {report['pressure']}")
    print("devices:")
    for line in str(report["devices"]).splitlines():
        print(f"  {line}")
    tiers = report["status"].gpu_budgets
    if tiers:
        print("gpu budgets:")
        for tier in tiers:
            print(f"  {tier}")
    return 0


def demo(args: argparse.Namespace) -> int:
    """``tierflow demo``: a file four times bigger than a 256 MB RAM budget, streamed.

    Writes a 1 GB float32 ``.npy`` to a temporary folder, computes per-column mean and
    standard deviation in one pass, writes the standardised features with ``to_npy``,
    and prints the throughput, the peak RSS and the budget (see
    :mod:`tierflow.demo`). The folder is removed at the end.
    """
    from .demo import run_demo
    from .system import status as status_module

    budget = parse_size(args.budget, "--budget")
    size = parse_size(args.size, "--size")
    print(status_module.status())
    print()
    run_demo(budget=budget, file_bytes=size)
    return 0


def profile(args: argparse.Namespace) -> int:
    """``tierflow profile script.py [args]``: run the script as ``__main__`` with
    ``sys.argv`` set to it and its arguments, inside one ``tw.profile()``; write the
    report to ``script.profile.html`` beside it (also when the script fails) and say
    where on stderr. Returns the script's exit status: 1 when it raised, after the
    traceback from the script's own frames down, as python prints it (130 for Ctrl-C)."""
    import runpy

    from .engine.observe.profile import Profile

    script = os.path.abspath(args.script)
    if not os.path.isfile(script):
        print(f"tierflow: error: no script at {script}", file=sys.stderr)
        return 2
    report = os.path.splitext(script)[0] + ".profile.html"
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args.args]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    recorded = Profile()
    try:
        with recorded:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # sys.exit("message"), as python shows it
    except BaseException as exc:  # what python prints for it, from the script down
        traceback.print_exception(type(exc), exc, _from_script(exc.__traceback__, script))
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        with _warnings_as_lines():  # a report without its picture says why
            written = recorded.save(report)
        print(
            f"tierflow: profile of {len(recorded.computes)} compute(s), "
            f"{len(recorded.tasks)} tasks written to {written}",
            file=sys.stderr,
        )
    return code


def _from_script(tb: TracebackType | None, script: str) -> TracebackType | None:
    """``tb`` from the first frame of ``script`` on: the frames of this command and of
    runpy above it are not the user's (all of ``tb`` if the script has none)."""
    frame = tb
    while frame is not None and frame.tb_frame.f_code.co_filename != script:
        frame = frame.tb_next
    return tb if frame is None else frame


def _jsonable(value: Any) -> Any:
    """A report object as JSON: its own ``as_dict()``, or its fields, plus its text."""
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if hasattr(value, "as_dict"):
        return _plain(value.as_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        fields["text"] = str(value)
        return fields
    return _plain(value)


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
