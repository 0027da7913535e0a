"""Sinks never destroy what they did not write: an existing destination is refused
unless ``overwrite=True``, which replaces only the sink's own kind of output, once the new
one is complete; an output that is also a source is rewritten safely or refused; an
unfinished Zarr array is refused by ``from_zarr`` and finished by the same ``to_zarr``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

import tierflow as tw
from tierflow.engine.io import destination
from tierflow.errors import DestinationExistsError, IncompleteError, TierflowError

ONES = np.ones((10, 2), np.float32)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``, by relative path, with its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def hidden(folder: Path) -> list[str]:
    """Temporary names a sink may leave next to its output (none, when it is done)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def user_project(folder: Path) -> Path:
    """The issue's folder: a README and a source file, no Zarr array."""
    (folder / "proj" / "src").mkdir(parents=True)
    (folder / "proj" / "README").write_text("read me\n")
    (folder / "proj" / "src" / "code.py").write_text("print('mine')\n")
    return folder / "proj"


def fails_on(row: float) -> Callable[[np.ndarray], np.ndarray]:
    def double_or_fail(block: np.ndarray) -> np.ndarray:
        if len(block) and block[0, 0] == row:
            raise RuntimeError(f"the block at {row} fails")
        return block * 2

    return double_or_fail


# -- the data loss, as it was reported -------------------------------------------


@pytest.mark.executors("threads")
@pytest.mark.parametrize("overwrite", [False, True])
def test_to_zarr_never_deletes_a_folder_of_the_users_files(tmp_path: Path, overwrite: bool) -> None:
    proj = user_project(tmp_path)
    before = snapshot(proj)
    with pytest.raises(DestinationExistsError) as caught:
        tw.from_array(ONES).to_zarr(proj, overwrite=overwrite)
    message = str(caught.value)
    assert "'README'" in message and "'src/code.py'" in message
    assert "never anything else, even with overwrite=True" in message
    assert isinstance(caught.value, FileExistsError) and isinstance(caught.value, TierflowError)
    assert snapshot(proj) == before and hidden(tmp_path) == []


@pytest.mark.executors("threads")
@pytest.mark.parametrize("overwrite", [False, True])
def test_to_zarr_never_deletes_a_prefix_of_the_users_objects(
    s3_server: dict[str, Any], tmp_path: Path, overwrite: bool
) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**s3_server)
    root = f"tierflow/{tmp_path.name}/proj"
    fs.pipe({f"{root}/README": b"read me\n", f"{root}/src/code.py": b"print('mine')\n"})
    with pytest.raises(DestinationExistsError, match=r"'README', 'src/code\.py'"):
        tw.from_array(ONES).to_zarr(f"s3://{root}", storage_options=s3_server, overwrite=overwrite)
    assert sorted(fs.find(f"tierflow/{tmp_path.name}")) == [f"{root}/README", f"{root}/src/code.py"]
    assert fs.cat(f"{root}/src/code.py") == b"print('mine')\n"


@pytest.mark.executors("threads")
def test_to_zarr_onto_a_file_says_what_is_there(tmp_path: Path) -> None:
    path = tmp_path / "out.zarr"
    path.write_bytes(b"notes")
    for overwrite in (False, True):
        with pytest.raises(
            DestinationExistsError,
            match=r"out\.zarr is a file; to_zarr writes a folder .* never replaces a file",
        ):
            tw.from_array(ONES).to_zarr(path, overwrite=overwrite)
    assert path.read_bytes() == b"notes"


@pytest.mark.executors("threads")
def test_a_zarr_group_and_an_array_with_company_are_never_replaced(tmp_path: Path) -> None:
    group = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    group.create_array("inner", shape=(4,), dtype="f4")[:] = 1
    tw.from_array(ONES).to_zarr(tmp_path / "a.zarr")
    (tmp_path / "a.zarr" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(DestinationExistsError, match="holds a Zarr group"):
        tw.from_array(ONES).to_zarr(tmp_path / "g.zarr", overwrite=True)
    with pytest.raises(DestinationExistsError, match=r"a Zarr array and 1 other file\(s\): 'notes"):
        tw.from_array(ONES).to_zarr(tmp_path / "a.zarr", overwrite=True)
    assert snapshot(tmp_path) == before


@pytest.mark.executors("threads")
def test_an_empty_folder_is_written_into(tmp_path: Path) -> None:
    (tmp_path / "empty.zarr").mkdir()
    tw.from_array(ONES).to_zarr(tmp_path / "empty.zarr")
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "empty.zarr"))[:], ONES)


# -- overwrite=True replaces the sink's own output, once the new one is complete ---------


@pytest.mark.executors("threads")
def test_overwrite_replaces_another_outputs_metadata_and_chunks_only_when_complete(
    tmp_path: Path,
) -> None:
    old = np.arange(40.0).reshape(20, 2)
    tw.from_array(old, rows=2).to_zarr(tmp_path / "out.zarr")  # ten chunks
    with pytest.raises(DestinationExistsError, match="already holds a Zarr array written by tier"):
        tw.from_array(ONES, rows=5).to_zarr(tmp_path / "out.zarr")
    before = snapshot(tmp_path)
    failing = tw.from_array(ONES, rows=5).map_blocks(fails_on(1.0), row_shape=(2,))
    with pytest.raises(RuntimeError, match="fails"):
        failing.to_zarr(tmp_path / "out.zarr", overwrite=True)
    assert snapshot(tmp_path) == before and hidden(tmp_path) == []  # the old one, whole
    tw.from_array(ONES, rows=5).to_zarr(tmp_path / "out.zarr", overwrite=True)
    z = zarr.open_array(str(tmp_path / "out.zarr"), mode="r")
    np.testing.assert_array_equal(z[:], ONES)
    assert z.attrs["tierflow"]["complete"] is True
    chunks = sorted(str(p.relative_to(tmp_path / "out.zarr")) for p in tmp_path.rglob("c/*/*"))
    assert chunks == ["c/0/0", "c/1/0"]  # the old array's other eight chunks are gone
    assert hidden(tmp_path) == []


@pytest.mark.executors("threads")
def test_overwrite_replaces_a_format_2_array_left_by_another_writer(tmp_path: Path) -> None:
    z = zarr.create_array(
        store=str(tmp_path / "v2.zarr"), shape=(6, 2), chunks=(2, 2), dtype="f8", zarr_format=2
    )
    z[:] = 7.0
    with pytest.raises(DestinationExistsError, match="already holds a Zarr array;"):
        tw.from_array(ONES).to_zarr(tmp_path / "v2.zarr")
    tw.from_array(ONES).to_zarr(tmp_path / "v2.zarr", overwrite=True)
    assert sorted(os.listdir(tmp_path / "v2.zarr")) == ["c", "zarr.json"]
    np.testing.assert_array_equal(tw.from_zarr(tmp_path / "v2.zarr").compute(), ONES)


@pytest.mark.slow  # an S3 server: a second or two
@pytest.mark.executors("threads")
def test_overwrite_in_object_storage_keeps_the_old_array_until_the_new_one_is_in(
    s3_server: dict[str, Any], tmp_path: Path
) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**s3_server)
    url = f"s3://tierflow/{tmp_path.name}/out.zarr"
    old = np.arange(32.0).reshape(16, 2)  # four chunks
    tw.from_array(old, rows=4).to_zarr(url, storage_options=s3_server)
    keys = sorted(fs.find(url))
    failing = tw.from_array(ONES, rows=5).map_blocks(fails_on(1.0), row_shape=(2,))
    with pytest.raises(RuntimeError, match="fails"):
        failing.to_zarr(url, storage_options=s3_server, overwrite=True)
    assert sorted(fs.find(f"tierflow/{tmp_path.name}")) == keys  # no temporary left
    np.testing.assert_array_equal(zarr.open_array(url, storage_options=s3_server)[:], old)
    tw.from_array(ONES, rows=5).to_zarr(url, storage_options=s3_server, overwrite=True)
    assert sorted(fs.find(f"tierflow/{tmp_path.name}")) == [
        f"tierflow/{tmp_path.name}/out.zarr/{k}" for k in ("c/0/0", "c/1/0", "zarr.json")
    ]
    back = zarr.open_array(url, mode="r", storage_options=s3_server)
    np.testing.assert_array_equal(back[:], ONES)
    assert back.attrs["tierflow"]["complete"] is True


@pytest.mark.slow  # an S3 server: a second or two
@pytest.mark.executors("threads")
def test_an_object_storage_swap_cut_short_leaves_an_incomplete_array_the_same_run_finishes(
    s3_server: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    url = f"s3://tierflow/{tmp_path.name}/out.zarr"
    tw.from_array(np.arange(32.0).reshape(16, 2), rows=4).to_zarr(url, storage_options=s3_server)
    new = tw.from_npy(_npy(tmp_path, np.arange(20.0).reshape(10, 2) + 0.5).path, rows=5)

    async def copy_fails(self: Any, path1: str, path2: str, **kwargs: Any) -> None:
        raise OSError("the connection dropped")

    with monkeypatch.context() as patched:
        patched.setattr(s3fs.S3FileSystem, "_cp_file", copy_fails)
        with pytest.raises(OSError, match="the connection dropped"):
            new.to_zarr(url, storage_options=s3_server, overwrite=True)
    with pytest.raises(IncompleteError, match="Run the same to_zarr again"):
        tw.from_zarr(url, storage_options=s3_server)  # never the old array, nor a mix
    new.to_zarr(url, storage_options=s3_server)  # its own: no overwrite=True needed
    back = zarr.open_array(url, mode="r", storage_options=s3_server)
    np.testing.assert_array_equal(back[:], np.arange(20.0).reshape(10, 2) + 0.5)
    fs = s3fs.S3FileSystem(**s3_server)
    assert sorted(k.rsplit("/out.zarr/", 1)[1] for k in fs.find(url)) == [
        "c/0/0",
        "c/1/0",
        "zarr.json",
    ]


@pytest.mark.executors("threads")
def test_a_folder_that_gains_other_files_during_the_write_is_not_swapped(tmp_path: Path) -> None:
    target = tmp_path / "out.zarr"
    tw.from_array(ONES).to_zarr(target)
    before = snapshot(target)

    def someone_adds_notes(block: np.ndarray) -> np.ndarray:
        (target / "notes.txt").write_text("mine")
        return block

    x = tw.from_array(ONES * 2, rows=5).map_blocks(
        someone_adds_notes, dtype=np.float32, row_shape=(2,)
    )
    with pytest.raises(DestinationExistsError, match="appeared while the new array was being"):
        x.to_zarr(target, overwrite=True)
    assert snapshot(target) == {**before, "notes.txt": b"mine"} and hidden(tmp_path) == []


# -- an output that is also a source of the same compute -----------------------------


@dataclass(frozen=True)
class Made:
    """A source written in a test's folder: the array over it, the path a sink given
    the same path would write, and the data it holds."""

    array: tw.Array
    path: Path
    data: np.ndarray


def _npy(folder: Path, data: np.ndarray) -> Made:
    np.save(folder / "a.npy", data)
    return Made(tw.from_npy(folder / "a.npy", rows=4), folder / "a.npy", data)


def _raw(folder: Path, data: np.ndarray) -> Made:
    data.tofile(folder / "a.raw")
    return Made(tw.from_raw(folder / "a.raw", data.dtype, (-1, 2), rows=4), folder / "a.raw", data)


def _zarr(folder: Path, data: np.ndarray) -> Made:
    z = zarr.create_array(store=str(folder / "a.zarr"), shape=data.shape, chunks=(4, 2), dtype="f8")
    z[:] = data
    return Made(tw.from_zarr(folder / "a.zarr"), folder / "a.zarr", data)


def _hdf5(folder: Path, data: np.ndarray) -> Made:
    with h5py.File(folder / "a.h5", "w") as f:
        f.create_dataset("x", data=data)
    return Made(tw.from_hdf5(folder / "a.h5", "x", rows=4), folder / "a.h5", data)


def _parquet(folder: Path, data: np.ndarray) -> Made:
    table = pa.table({"a": data[:, 0], "b": data[:, 1]})
    pq.write_table(table, folder / "a.parquet", row_group_size=4)
    return Made(tw.from_parquet(folder / "a.parquet", dtype="float64"), folder / "a.parquet", data)


def _parquet_folder(folder: Path, data: np.ndarray) -> Made:
    (folder / "table").mkdir()
    for i in range(2):
        part = data[i * 6 : (i + 1) * 6]
        pq.write_table(pa.table({"a": part[:, 0], "b": part[:, 1]}), folder / f"table/{i}.parquet")
    x = tw.from_parquet(str(folder / "table" / "*.parquet"), dtype="float64")
    return Made(x, folder / "table", data)


def _files(folder: Path, data: np.ndarray) -> Made:
    (folder / "rows").mkdir()
    paths = [folder / "rows" / f"{i:02}.npy" for i in range(len(data))]
    for p, row in zip(paths, data, strict=True):
        np.save(p, row)
    x = tw.from_files([str(p) for p in paths], np.load, rows=4, dtype="float64", row_shape=(2,))
    return Made(x, paths[0], data)


def _files_folder(folder: Path, data: np.ndarray) -> Made:
    made = _files(folder, data)
    return Made(made.array, folder / "rows", data)


SOURCES: dict[str, Callable[[Path, np.ndarray], Made]] = {
    "npy": _npy,
    "raw": _raw,
    "zarr": _zarr,
    "hdf5": _hdf5,
    "parquet": _parquet,
    "parquet folder": _parquet_folder,
    "files": _files,
    "files folder": _files_folder,
}
# The pairs a sink writes correctly over its own source with overwrite=True: its own kind
# of output is there. Every other pair is refused before anything is written.
REWRITTEN = {("npy", "to_npy"), ("files", "to_npy"), ("zarr", "to_zarr")}


@pytest.mark.executors("threads", "processes")
@pytest.mark.parametrize("sink", ["to_npy", "to_zarr"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_an_output_over_its_own_source_is_rewritten_whole_or_refused_untouched(
    tmp_path: Path, source: str, sink: str
) -> None:
    data = np.arange(24.0).reshape(12, 2)
    made = SOURCES[source](tmp_path, data)
    doubled = made.array * 2
    before = snapshot(tmp_path)
    with pytest.raises(DestinationExistsError):
        getattr(doubled, sink)(made.path)  # no overwrite=True: refused, whatever is there
    assert snapshot(tmp_path) == before
    if (source, sink) not in REWRITTEN:
        with pytest.raises(DestinationExistsError, match="even with overwrite=True"):
            getattr(doubled, sink)(made.path, overwrite=True)
        assert snapshot(tmp_path) == before and hidden(tmp_path) == []
        return
    getattr(doubled, sink)(made.path, overwrite=True)
    back = np.load(made.path) if sink == "to_npy" else tw.from_zarr(made.path).compute()
    np.testing.assert_array_equal(back, data * 2)
    assert hidden(tmp_path) == [] and hidden(made.path.parent) == []


@pytest.mark.slow  # an S3 server: a second or two
@pytest.mark.executors("threads")
def test_a_zarr_output_over_its_own_source_in_object_storage_is_rewritten_whole(
    s3_server: dict[str, Any], tmp_path: Path
) -> None:
    url = f"s3://tierflow/{tmp_path.name}/a.zarr"
    data = np.arange(24.0).reshape(12, 2)
    tw.from_array(data, rows=4).to_zarr(url, storage_options=s3_server)
    x = tw.from_zarr(url, storage_options=s3_server)
    with pytest.raises(DestinationExistsError):
        (x * 2).to_zarr(url, storage_options=s3_server)
    (x * 2).to_zarr(url, storage_options=s3_server, overwrite=True)
    np.testing.assert_array_equal(tw.from_zarr(url, storage_options=s3_server).compute(), data * 2)


# -- to_npy --------------------------------------------------------------------------


@pytest.mark.executors("threads")
def test_to_npy_refuses_an_existing_file_unless_told_and_never_a_folder(tmp_path: Path) -> None:
    target = tmp_path / "out.npy"
    tw.from_array(ONES).to_npy(target)
    with pytest.raises(DestinationExistsError, match=r"out\.npy exists \(a \.npy file of \d+ b"):
        tw.from_array(ONES * 3).to_npy(target)
    with pytest.raises(DestinationExistsError, match="exists"):
        tw.from_array(ONES * 3).sum(axis=0).to_npy(target)  # a reduction's value, too
    np.testing.assert_array_equal(np.load(target), ONES)
    tw.from_array(ONES * 3).to_npy(target, overwrite=True)
    np.testing.assert_array_equal(np.load(target), ONES * 3)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DestinationExistsError, match=r"is a folder; to_npy replaces only a \.npy"):
        tw.from_array(ONES).to_npy(tmp_path / "folder", overwrite=True)


@pytest.mark.executors("threads")
def test_a_file_that_appears_during_a_to_npy_is_not_replaced(tmp_path: Path) -> None:
    target = tmp_path / "out.npy"

    def someone_else_writes(block: np.ndarray) -> np.ndarray:
        if not target.exists():
            target.write_bytes(b"theirs")
        return block

    x = tw.from_array(ONES, rows=5).map_blocks(
        someone_else_writes, dtype=np.float32, row_shape=(2,)
    )
    with pytest.raises(DestinationExistsError, match="appeared while the file was being written"):
        x.to_npy(target)
    assert target.read_bytes() == b"theirs" and hidden(tmp_path) == []


@pytest.mark.executors("threads")
def test_a_link_at_the_destination_is_written_through_and_stays_a_link(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    tw.from_array(ONES).to_npy(tmp_path / "data" / "a.npy")
    tw.from_array(ONES).to_zarr(tmp_path / "data" / "a.zarr")
    for name in ("a.npy", "a.zarr"):
        (tmp_path / name).symlink_to(tmp_path / "data" / name)
    tw.from_array(ONES * 5).to_npy(tmp_path / "a.npy", overwrite=True)
    tw.from_array(ONES * 5).to_zarr(tmp_path / "a.zarr", overwrite=True)
    assert (tmp_path / "a.npy").is_symlink() and (tmp_path / "a.zarr").is_symlink()
    np.testing.assert_array_equal(np.load(tmp_path / "data" / "a.npy"), ONES * 5)
    np.testing.assert_array_equal(tw.from_zarr(tmp_path / "data" / "a.zarr").compute(), ONES * 5)
    assert hidden(tmp_path) == [] and hidden(tmp_path / "data") == []


@pytest.mark.executors("threads")
def test_without_renameat2_the_same_rules_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(destination, "_renameat2", None)  # an older kernel or libc
    tw.from_array(ONES).to_zarr(tmp_path / "a.zarr")
    tw.from_array(ONES * 2).to_zarr(tmp_path / "a.zarr", overwrite=True)  # two renames
    np.testing.assert_array_equal(tw.from_zarr(tmp_path / "a.zarr").compute(), ONES * 2)
    tw.from_array(ONES).to_npy(tmp_path / "a.npy")
    with pytest.raises(DestinationExistsError):
        tw.from_array(ONES).to_npy(tmp_path / "a.npy")
    target = tmp_path / "b.npy"

    def someone_else_writes(block: np.ndarray) -> np.ndarray:
        target.write_bytes(b"theirs")
        return block

    x = tw.from_array(ONES).map_blocks(someone_else_writes, dtype=np.float32, row_shape=(2,))
    with pytest.raises(DestinationExistsError, match="appeared while"):
        x.to_npy(target)  # a hard link refuses it, as renameat2 would
    assert target.read_bytes() == b"theirs" and hidden(tmp_path) == []


# -- unfinished Zarr arrays: refused on read, finished by the same to_zarr -------------


@pytest.mark.executors("serial")
def test_an_incomplete_array_is_refused_with_the_count_and_the_way_to_finish_it(
    tmp_path: Path,
) -> None:
    data = np.arange(40.0).reshape(20, 2)
    state = {"fail": True}

    def double(block: np.ndarray) -> np.ndarray:
        if state["fail"] and block[0, 0] >= 20.0:
            raise RuntimeError("stopped")
        return block * 2

    y = tw.from_array(data, rows=2).map_blocks(double, row_shape=(2,))
    with pytest.raises(RuntimeError, match="stopped"):
        y.to_zarr(tmp_path / "r.zarr")
    with pytest.raises(
        IncompleteError,
        match=r"r\.zarr is marked incomplete .* left it with 5 of its 10 chunks stored, so 5 "
        r"are missing .* Run the same to_zarr again to finish it",
    ) as caught:
        tw.from_zarr(tmp_path / "r.zarr")
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, TierflowError)
    partial = tw.from_zarr(tmp_path / "r.zarr", allow_incomplete=True).compute()
    np.testing.assert_array_equal(partial[:10], data[:10] * 2)
    assert not partial[10:].any()  # what was never written reads as the fill value
    with pytest.raises(DestinationExistsError, match="an incomplete Zarr array that a to_zarr of"):
        tw.from_array(ONES).to_zarr(tmp_path / "r.zarr")  # another compute's
    state["fail"] = False
    y.to_zarr(tmp_path / "r.zarr")  # as the message says: no overwrite=True for its own
    np.testing.assert_array_equal(tw.from_zarr(tmp_path / "r.zarr").compute(), data * 2)
    assert hidden(tmp_path) == []


@pytest.mark.executors("threads")
def test_a_sharded_incomplete_array_counts_its_shards(tmp_path: Path) -> None:
    z = zarr.create_array(
        store=str(tmp_path / "s.zarr"), shape=(16, 2), chunks=(2, 2), shards=(4, 2), dtype="f4",
        attributes={"tierflow": {"complete": False}},
    )  # fmt: skip
    z[:4] = 1
    with pytest.raises(IncompleteError, match=r"with 1 of its 4 shards stored, so 3 are missing"):
        tw.from_zarr(tmp_path / "s.zarr")


@pytest.mark.slow
@pytest.mark.executors("serial")  # the script chooses its own
def test_a_killed_to_zarr_is_refused_then_finished_by_running_it_again(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        import numpy as np
        import tierflow as tw

        def double(block):
            if sys.argv[1] == "kill" and block[0, 0] >= 20.0:
                os.kill(os.getpid(), signal.SIGKILL)
            return block * 2

        x = tw.from_npy({str(tmp_path / "src.npy")!r}, rows=2)
        x.map_blocks(double, row_shape=(2,)).to_zarr(
            {str(tmp_path / "out.zarr")!r}, executor="serial", progress=False
        )
        """
    )
    np.save(tmp_path / "src.npy", np.arange(40.0).reshape(20, 2))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", script, "kill"], env=env, check=False)
    assert killed.returncode == -signal.SIGKILL
    meta = json.loads((tmp_path / "out.zarr" / "zarr.json").read_text())
    assert meta["attributes"]["tierflow"]["complete"] is False
    with pytest.raises(IncompleteError, match="5 of its 10 chunks stored"):
        tw.from_zarr(tmp_path / "out.zarr")
    subprocess.run([sys.executable, "-c", script, "finish"], env=env, check=True)
    back = tw.from_zarr(tmp_path / "out.zarr").compute()
    np.testing.assert_array_equal(back, np.arange(40.0).reshape(20, 2) * 2)


# -- what a new user throws at a sink --------------------------------------------------


@pytest.mark.parametrize("sink", ["to_npy", "to_zarr"])
@pytest.mark.parametrize(
    "case", ["zero rows", "a mask that empties some blocks", "a mask that empties every block"]
)
def test_empty_blocks_and_zero_rows_are_written_as_numpy_has_them(
    tmp_path: Path, case: str, sink: str
) -> None:
    data = np.arange(40.0).reshape(20, 2)
    if case == "zero rows":
        x, want = tw.from_array(data[:0]), data[:0]
    elif case == "a mask that empties some blocks":
        x = tw.from_array(data, rows=4)
        x, want = x[(x[:, 0] < 8) | (x[:, 0] >= 32)], data[(data[:, 0] < 8) | (data[:, 0] >= 32)]
    else:
        x = tw.from_array(data, rows=4)
        x, want = x[x[:, 0] < 0], data[data[:, 0] < 0]
    out = tmp_path / ("out.npy" if sink == "to_npy" else "out.zarr")
    getattr(x, sink)(out)
    back = np.load(out) if sink == "to_npy" else zarr.open_array(str(out), mode="r")[:]
    assert back.shape == want.shape and back.dtype == want.dtype
    np.testing.assert_array_equal(back, want)


@pytest.mark.executors("threads", "processes")
@pytest.mark.parametrize("sink", ["to_npy", "to_zarr"])
def test_big_endian_input_is_written_with_its_values(tmp_path: Path, sink: str) -> None:
    data = np.array([[3, 1], [2, 256], [70000, -5], [7, 8], [9, 10]], ">i4")
    out = tmp_path / ("out.npy" if sink == "to_npy" else "out.zarr")
    getattr(tw.from_array(data, rows=2), sink)(out)
    back = np.load(out) if sink == "to_npy" else zarr.open_array(str(out), mode="r")[:]
    np.testing.assert_array_equal(back, data)
    reread = tw.from_npy(out) if sink == "to_npy" else tw.from_zarr(out)
    np.testing.assert_array_equal(reread.compute(), data)


@pytest.mark.executors("threads")
def test_a_tierflow_store_is_never_a_sinks_to_replace(tmp_path: Path) -> None:
    with tw.memory.store(tmp_path / "store") as store:
        store["a"] = np.arange(3)
    before = snapshot(tmp_path)
    with pytest.raises(DestinationExistsError, match="file"):
        tw.from_array(ONES).to_zarr(tmp_path / "store", overwrite=True)
    with pytest.raises(DestinationExistsError, match="is a folder"):
        tw.from_array(ONES).to_npy(tmp_path / "store", overwrite=True)
    assert snapshot(tmp_path) == before


# -- what a sink leaves when its writer is gone ----------------------------------------


@pytest.mark.executors("threads")
def test_the_temporary_folder_of_a_writer_that_is_gone_is_swept(tmp_path: Path) -> None:
    gone = tmp_path / ".out.zarr.tf999999999-1-abcd.tmp"
    tw.from_array(ONES).to_zarr(gone)  # a Zarr array's keys only, as a killed writer left
    kept = tmp_path / ".other.zarr.tf999999999-1-abcd.tmp"
    kept.mkdir()
    (kept / "notes.txt").write_text("not a Zarr array's")
    tw.from_array(ONES).to_zarr(tmp_path / "new.zarr")
    assert not gone.exists() and (kept / "notes.txt").exists()


@pytest.mark.executors("threads")
@pytest.mark.parametrize(
    ("key", "own"),
    [
        ("zarr.json", True),
        ("c/0/1", True),
        ("c.3.0", True),
        ("0.1", True),
        ("c/0/1.0123456789abcdef0123456789abcdef.partial", True),
        ("zarr.0123456789abcdef0123456789abcdef.partial", True),
        ("README", False),
        ("src/code.py", False),
        ("inner/zarr.json", False),
        ("c/x", False),
    ],
)
def test_a_zarr_arrays_own_keys_are_its_metadata_and_chunks(key: str, own: bool) -> None:
    assert destination.own_key(key) is own
