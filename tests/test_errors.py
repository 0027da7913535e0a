"""Errors: a missing optional package names the command that installs its extra."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import tierflow
import tierflow as tw
from tierflow import errors
from tierflow.errors import DependencyError, install_command, missing_dependency

CHECKOUT = Path(tierflow.__file__).resolve().parent.parent


def _extras() -> set[str]:
    tomllib = pytest.importorskip("tomllib")
    with open(CHECKOUT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


def test_from_a_checkout_the_command_installs_the_extra_from_that_checkout() -> None:
    assert (CHECKOUT / "pyproject.toml").is_file()
    assert install_command("zarr") == f"pip install -e '{CHECKOUT}[zarr]'"


def test_outside_a_checkout_the_command_says_to_run_it_in_one(tmp_path: Path) -> None:
    # The module alone, in a package folder with no pyproject.toml beside it: an
    # installed copy in site-packages.
    folder = tmp_path / "site-packages" / "tierflow"
    folder.mkdir(parents=True)
    shutil.copy(errors.__file__, folder / "errors.py")
    spec = importlib.util.spec_from_file_location("installed_errors", folder / "errors.py")
    assert spec is not None and spec.loader is not None
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    assert installed.install_command("zarr") == (
        "pip install -e '.[zarr]' in a checkout of tierflow (it is not on the package index)"
    )


def test_every_extra_a_missing_package_names_is_declared() -> None:
    named = set()
    for path in (CHECKOUT / "tierflow").rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r"missing_dependency\(\s*\"[^\"]+\",\s*\"([^\"]+)\"", text))
    assert {"zarr", "dask", "ray", "torch", "plot", "progress"} <= named
    assert named <= _extras()


def test_the_message_says_what_needs_which_package_and_the_command() -> None:
    error = missing_dependency("zarr", "zarr", "tw.from_zarr")
    assert isinstance(error, ImportError)
    assert str(error) == (
        f"tw.from_zarr needs the optional package 'zarr': pip install -e '{CHECKOUT}[zarr]'"
    )


def test_from_zarr_without_zarr_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "zarr", None)  # `import zarr` fails
    with pytest.raises(DependencyError) as info:
        tw.from_zarr(str(tmp_path / "a.zarr"))
    assert str(info.value).startswith("tw.from_zarr needs the optional package 'zarr': ")
    assert str(info.value).endswith(install_command("zarr"))


def test_a_progress_bar_without_tqdm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(DependencyError, match=r"^a progress bar needs the optional package"):
        tw.from_array(np.ones((4, 2))).sum().compute(progress=True)


def _every_error_class() -> list[type[BaseException]]:
    import pkgutil

    for module in pkgutil.walk_packages(tierflow.__path__, "tierflow."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    found, todo = [], [errors.TierflowError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return found


@pytest.mark.parametrize("pickling", ["pickle", "tblib"])
def test_every_error_crosses_a_process_boundary_as_itself(pickling: str) -> None:
    # dask and distributed install tblib's exception pickling in every process that
    # imports them (a Dask worker, a worker process that ran a dask graph): it made an
    # OutOfMemoryError (a MemoryError) fail to unpickle, so a worker sent back a
    # RemoteError with the traceback instead of the error.
    import pickle

    if pickling == "tblib":
        pickling_support = pytest.importorskip("tblib.pickling_support")
        pickling_support.install()
    classes = _every_error_class()
    assert len(classes) > 10, classes
    for cls in classes:
        try:
            error = cls("the message")
        except TypeError:
            error = cls("the message", "a detail")
        error.add_note("a note")
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is cls and back.args == error.args, cls
        assert back.__dict__ == error.__dict__, cls
