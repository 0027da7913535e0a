"""Settings: one table of defaults, ``TIERFLOW_*`` environment variables, ``config.set``.

Sizes are binary: ``1 GB`` here is 2**30 bytes, as ``free -g`` and ``memory.report()``
count. A size may be given as a number of bytes (``536870912``) or a string with a unit
(``"512MB"``, ``"12GB"``, ``"1.5 GiB"``, ``"64k"``).

Environment variables are read once, on first use of a setting, and a malformed value
raises :class:`~tierflow.errors.ConfigError` naming the variable and an example.
``config.set`` overrides both the defaults and the environment for this process and
doubles as a context manager that restores the previous values:

>>> from tierflow import config
>>> with config.set(ram_budget="2GB"):
...     config.get("ram_budget")
2147483648
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from .errors import ConfigError

__all__ = [
    "DEFAULTS",
    "ENVIRONMENT",
    "format_bytes",
    "get",
    "on_change",
    "parse_size",
    "reset",
    "set",
]

KB = 1 << 10
MB = 1 << 20
GB = 1 << 30
TB = 1 << 40

# name:           default               # unit / meaning
DEFAULTS: dict[str, Any] = {
    "ram_budget": None,  # bytes; None = budget_fraction of free usable RAM, fixed at first use
    "budget_fraction": 0.7,  # share of free usable RAM the default budget takes
    "spill_dir": "~/.tierflow/spill",  # folder of memory-mapped spill files
    "store_dir": "~/.tierflow/store",  # folder under which named stores live
    "cache": None,  # store (name or path) every compute caches in; None = none; "1" = "cache"
    "proc_root": "/",  # root under which /proc and /sys/fs/cgroup are read (tests fake it)
    "shared_dir": None,  # folder every cluster worker sees, or an fsspec URL; None = the spill folder on one host
    "shared_options": None,  # fsspec storage_options of a shared_dir URL (endpoint, credentials)
    "gpu_margin": None,  # bytes left free on each GPU; None = max(256 MB, 10 % of its total)
    "gpu_slots": 2,  # device tasks that run at once on each GPU (one CUDA stream each)
    "device": "cpu",  # where fused operators and reductions run: cpu, auto, cuda, cuda:N
    "copy_bandwidth": 12 * GB,  # bytes/s host-to-GPU copies reach (device="auto" weighs it)
    "jit": True,  # compile fused reductions with numba: True, False, "eager" (wait for it)
    "jit_min_bytes": 256 * MB,  # input bytes from which a compute asks for a compile
    "kernel_dir": None,  # folder of compiled kernels; None = <store_dir>/.kernels
}

ENVIRONMENT: dict[str, str] = {
    "ram_budget": "TIERFLOW_RAM_BUDGET",
    "spill_dir": "TIERFLOW_SPILL_DIR",
    "store_dir": "TIERFLOW_STORE_DIR",
    "cache": "TIERFLOW_CACHE",
    "shared_dir": "TIERFLOW_SHARED_DIR",
    "shared_options": "TIERFLOW_SHARED_OPTIONS",
    "gpu_margin": "TIERFLOW_GPU_MARGIN",
    "gpu_slots": "TIERFLOW_GPU_SLOTS",
    "device": "TIERFLOW_DEVICE",
    "jit": "TIERFLOW_JIT",
    "kernel_dir": "TIERFLOW_KERNEL_DIR",
}

_EXAMPLES = {
    "ram_budget": "12GB, 512MB or a number of bytes",
    "budget_fraction": "0.7",
    "gpu_margin": "512MB, 0 or a number of bytes",
    "gpu_slots": "2",
    "jit": "1, 0 or eager",
    "shared_options": '{"endpoint_url": "http://127.0.0.1:9000"} (JSON)',
}

_UNITS = {
    "": 1, "b": 1,
    "k": KB, "kb": KB, "kib": KB,
    "m": MB, "mb": MB, "mib": MB,
    "g": GB, "gb": GB, "gib": GB,
    "t": TB, "tb": TB, "tib": TB,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

_lock = threading.Lock()
_overrides: dict[str, Any] = {}
_from_env: dict[str, Any] | None = None


def parse_size(value: int | float | str, what: str = "size") -> int:
    """Turn ``12GB``, ``"512 MB"``, ``1.5e9`` or ``4096`` into a number of bytes.

    ``what`` names the setting or variable in the error message.

    >>> parse_size("1.5GB")
    1610612736
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size such as 12GB, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{what}={value!r} is not a size; write it like 12GB, 512MB or 1073741824"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ConfigError(f"{what}: expected a size such as 12GB, got {type(value).__name__}")
    size = number * _UNITS[unit]
    if not size > 0 or size != size or size == float("inf"):
        raise ConfigError(f"{what}={value!r} must be a positive size, such as 12GB")
    return int(size)


def format_bytes(n: float, digits: int = 1) -> str:
    """Format a byte count in binary units, the way tierflow prints sizes.

    >>> format_bytes(6_400_000_000, 3)
    '5.960 GB'
    """
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TB", TB), ("GB", GB), ("MB", MB), ("KB", KB)):
        if n >= size:
            return f"{sign}{n / size:.{digits}f} {unit}"
    return f"{sign}{int(n)} B"


def _fraction(value: Any, origin: str) -> float:
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ConfigError(f"{origin}={value!r} must be a fraction in (0, 1], such as 0.7")
    return fraction


def _margin(value: Any, origin: str) -> int:
    # 0 is a margin (use every free byte), unlike a budget of 0.
    if not isinstance(value, bool) and str(value).strip() in ("0", "0.0", "0B", "0b"):
        return 0
    return parse_size(value, origin)


def _slots(value: Any, origin: str) -> int:
    try:
        slots = int(str(value).strip()) if not isinstance(value, bool) else 0
    except ValueError:
        slots = 0
    if slots < 1 or (isinstance(value, float) and value != slots):
        raise ConfigError(f"{origin}={value!r} must be a whole number of slots >= 1, such as 2")
    return slots


def _device(value: Any, origin: str) -> str:
    text = str(value)
    if text not in ("cpu", "auto", "cuda") and not (
        text.startswith("cuda:") and text[5:].isdigit()
    ):
        raise ConfigError(f"{origin}={value!r}: use 'cpu', 'auto', 'cuda' or 'cuda:N'")
    return text


def _jit(value: Any, origin: str) -> bool | str:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    if text == "eager":
        return "eager"
    raise ConfigError(f"{origin}={value!r} must be 1, 0 or eager")


def _cache(value: Any, origin: str) -> Any:
    return value if value not in ("", "0", "false", "False") else None


def _path(value: Any, origin: str) -> str:
    return os.fspath(value)


def _options(value: Any, origin: str) -> dict[str, Any]:
    """fsspec storage options: a dict, or its JSON text (from the environment)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(
                f"{origin}={value!r} is not JSON; write it like "
                '\'{"endpoint_url": "http://127.0.0.1:9000"}\''
            ) from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{origin}: expected a dict of storage options, got {value!r}")
    return dict(value)


# How each setting's value is checked and converted (the others are taken as given).
_CONVERTERS: dict[str, Callable[[Any, str], Any]] = {
    "ram_budget": parse_size,
    "budget_fraction": _fraction,
    "gpu_margin": _margin,
    "gpu_slots": _slots,
    "spill_dir": _path,
    "store_dir": _path,
    "proc_root": _path,
    "shared_dir": _path,
    "shared_options": _options,
    "cache": _cache,
    "device": _device,
    "copy_bandwidth": parse_size,
    "jit": _jit,
    "jit_min_bytes": parse_size,
    "kernel_dir": _path,
}


def _convert(name: str, value: Any, origin: str) -> Any:
    if value is None:
        return None
    convert = _CONVERTERS.get(name)
    return value if convert is None else convert(value, origin)


def _environment() -> dict[str, Any]:
    global _from_env
    if _from_env is None:
        values = {}
        for name, variable in ENVIRONMENT.items():
            raw = os.environ.get(variable)
            if raw is not None and raw.strip() != "":
                values[name] = _convert(name, raw.strip(), variable)
        _from_env = values
    return _from_env


def get(name: str) -> Any:
    """The value of one setting: ``config.set`` > environment variable > default."""
    if name not in DEFAULTS:
        raise ConfigError(f"unknown setting {name!r}; known: {', '.join(sorted(DEFAULTS))}")
    with _lock:
        if name in _overrides:
            return _overrides[name]
        env = _environment()
        return env.get(name, DEFAULTS[name])


_listeners: list[Callable[[str], None]] = []


def on_change(fn: Callable[[str], None]) -> None:
    """Call ``fn(name)`` whenever a setting changes (layers that cache a setting use it)."""
    _listeners.append(fn)


class _Restore:
    """What ``config.set`` returns: usable as a context manager that undoes the change."""

    def __init__(self, previous: dict[str, Any]) -> None:
        self._previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        with _lock:
            for name, (had, value) in self._previous.items():
                if had:
                    _overrides[name] = value
                else:
                    _overrides.pop(name, None)
        for name in self._previous:
            _notify(name)


def _notify(name: str) -> None:
    for fn in list(_listeners):
        fn(name)


def set(**settings: Any) -> _Restore:
    """Override settings for this process; use as a context manager to undo.

    >>> from tierflow import config
    >>> _ = config.set(spill_dir="/tmp/tierflow-spill")
    """
    converted = {}
    for name, value in settings.items():
        if name not in DEFAULTS:
            raise ConfigError(f"unknown setting {name!r}; known: {', '.join(sorted(DEFAULTS))}")
        converted[name] = _convert(name, value, name)
    with _lock:
        previous = {n: (n in _overrides, _overrides.get(n)) for n in converted}
        _overrides.update(converted)
    for name in converted:
        _notify(name)
    return _Restore(previous)


def reset() -> None:
    """Forget overrides and re-read the environment on next use (tests use this)."""
    global _from_env
    with _lock:
        _overrides.clear()
        _from_env = None
    for name in DEFAULTS:
        _notify(name)
