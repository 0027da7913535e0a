"""The Store: mapping API, tiers, eviction, restarts, pressure, integrity, folders."""

from __future__ import annotations

import json
import os
import pickle
import re
import sqlite3
import subprocess
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow import config, memory
from tierflow.config import GB, MB
from tierflow.errors import StoreError
from tierflow.storage.store import Store, StoreWarning
from tierflow.storage.store import tiers as tiers_mod
from tierflow.storage.store.index import Index
from tierflow.storage.store.keys import encode_key, name_of, relative_path
from tierflow.system import pressure, processes
from tierflow.system.types import Level

MakeStore = Callable[..., Store]


def entry_file(st: Store, key: Any) -> Path:
    return st.path / "data" / relative_path(name_of(encode_key(key)))


def data_files(st: Store) -> list[Path]:
    return sorted(p for p in (st.path / "data").rglob("*") if p.is_file())


def disk_bytes(st: Store) -> int:
    return sum(p.stat().st_size for p in data_files(st))


# -- the mapping -------------------------------------------------------------------------


def test_mapping_api(make_store: MakeStore) -> None:
    st = make_store()
    st["a"] = 1
    st.set(("t", 2), [1, 2])
    st[b"\x00"] = "bytes key"
    st[7] = np.arange(3)
    assert st["a"] == 1 and st.get(("t", 2)) == [1, 2] and st[b"\x00"] == "bytes key"
    np.testing.assert_array_equal(st[7], [0, 1, 2])
    assert len(st) == 4 and "a" in st and "b" not in st and 7 in st
    assert sorted(map(repr, st)) == sorted(map(repr, ["a", ("t", 2), b"\x00", 7]))
    assert st.get("missing") is None and st.get("missing", 5) == 5
    with pytest.raises(KeyError, match="missing"):
        st["missing"]
    del st["a"]
    assert "a" not in st and len(st) == 3
    with pytest.raises(KeyError):
        del st["a"]
    assert st.delete(7) and not st.delete(7)
    assert st.clear() == 2 and len(st) == 0 and data_files(st) == []


def test_mapping_helpers_come_from_mutable_mapping(make_store: MakeStore) -> None:
    st = make_store()
    st.update({"a": 1, "b": 2})
    assert st.pop("a") == 1 and st.setdefault("c", 3) == 3
    assert dict(st.items()) == {"b": 2, "c": 3}
    assert st == st and st != make_store("other")  # identity, not a read of every value
    assert hash(st) == hash(st)


@pytest.mark.parametrize("key", [1.5, None, [1], True, ("a", [1])])
def test_bad_keys_are_type_errors_everywhere(make_store: MakeStore, key: Any) -> None:
    st = make_store()
    with pytest.raises(TypeError, match="store keys are str, bytes, int or tuples"):
        st[key] = 1
    with pytest.raises(TypeError, match="store keys are"):
        st.get(key)
    with pytest.raises(TypeError, match="store keys are"):
        _ = key in st
    with pytest.raises(TypeError, match="store keys are"):
        st.delete(key)


def test_keys_never_leave_the_data_folder(make_store: MakeStore) -> None:
    st = make_store()
    for key in ["../../escape", "/etc/passwd", "a/../../b", ".."]:
        st[key] = key
        assert st[key] == key
    assert all(re.fullmatch(r"[0-9a-f]{32}", p.name) for p in data_files(st))
    assert {p.name for p in st.path.parent.iterdir()} == {"s"}


def test_repr_says_what_is_in_each_tier(make_store: MakeStore) -> None:
    st = make_store("embeddings")
    st["a"] = np.zeros(MB // 8)  # 1 MB, held in RAM too
    st["b"] = np.zeros(MB // 8)
    st.relieve()
    st.get("a")  # an array read from the SSD is mapped, not held in RAM
    st["c"] = "x"
    assert re.fullmatch(
        r"<store embeddings: 1 in RAM \(0\.0 MB\), 3 on SSD \(2\.0 MB\)>", repr(st)
    ), repr(st)
    st.close()
    assert repr(st) == "<store embeddings: closed>"


def test_a_closed_store_says_so(make_store: MakeStore) -> None:
    st = make_store()
    st["a"] = 1
    with st:
        pass
    st.close()  # twice is fine
    assert st.closed
    for call in (lambda: st.get("a"), lambda: st.set("a", 1), lambda: len(st), lambda: list(st)):
        with pytest.raises(StoreError, match=r"store 's' at .* is closed; open it again"):
            call()


def test_tags_group_entries(make_store: MakeStore) -> None:
    st = make_store()
    st.set("a", 1, tag="f")
    st.set("b", 2, tag="f")
    st.set("c", 3, tag="g")
    st.set("d", 4)
    assert (st.count("f"), st.count("g"), st.count()) == (2, 1, 4)
    assert st.clear("f") == 2
    assert sorted(st) == ["c", "d"] and st.get("a") is None
    with pytest.raises(TypeError, match="tag must be a string"):
        st.set("e", 5, tag=3)  # type: ignore[arg-type]


def test_an_unpicklable_value_leaves_nothing_behind(make_store: MakeStore) -> None:
    st = make_store()
    st["k"] = "old"
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        st["k"] = lambda: 1
    assert st["k"] == "old"
    assert list((st.path / "tmp").iterdir()) == []


# -- where stores live ---------------------------------------------------------------------


def test_a_name_lives_under_the_store_dir() -> None:
    with memory.store("embeddings", ram_mb=1, disk_gb=1) as st:
        assert st.path == Path(config.get("store_dir")) / "embeddings"
        assert (st.path / ".tierflow-store").is_file()
        assert (st.path.parent.parent / "store.key").is_file()


def test_a_path_is_used_as_it_is(tmp_path: Path) -> None:
    with memory.store(str(tmp_path / "x" / "y")) as st:
        assert st.path == tmp_path / "x" / "y"
    with memory.store(tmp_path / "z") as st:
        assert st.path == tmp_path / "z"


@pytest.mark.parametrize("name", ["", ".", ".."])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="is not a store name"):
        memory.store(name)


def test_limits_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"disk_gb=0 must be > 0"):
        Store(tmp_path / "s", disk_gb=0)
    with pytest.raises(ValueError, match=r"ram_mb=-1 must be >= 0"):
        Store(tmp_path / "s", ram_mb=-1)
    with pytest.raises(TypeError, match="ram_mb must be a number"):
        Store(tmp_path / "s", ram_mb="1GB")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a store is named by a string or a path, not int"):
        memory.store(3)  # type: ignore[arg-type]


def test_a_folder_with_other_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(
        StoreError,
        match=r"mine is not empty \(thesis\.tex\) and is not a tierflow store .* eviction|"
        r"mine is not empty \(thesis\.tex\) and is not a tierflow store",
    ):
        Store(tmp_path / "mine")
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "precious"
    assert sorted(os.listdir(tmp_path / "mine")) == ["thesis.tex"]


def test_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreError, match=r"f is a file; a store needs a folder"):
        Store(tmp_path / "f")


def test_an_empty_folder_becomes_a_store(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with Store(tmp_path / "empty") as st:
        st["a"] = 1
    marker = json.loads((tmp_path / "empty" / ".tierflow-store").read_text())
    assert marker["format"] == 1 and len(marker["key_id"]) == 16


def test_a_store_of_a_newer_format_is_refused(make_store: MakeStore, tmp_path: Path) -> None:
    make_store().close()
    (tmp_path / "s" / ".tierflow-store").write_text('{"format": 2, "key_id": "x"}')
    with pytest.raises(StoreError, match=r"a store of format 2, written by a newer tierflow"):
        Store(tmp_path / "s")


def test_a_store_signed_with_another_key_is_refused(tmp_path: Path) -> None:
    Store(tmp_path / "s").close()
    with pytest.raises(StoreError, match=r"created with another signing key .* Restore the key"):
        Store(tmp_path / "s", key_file=tmp_path / "other.key")


def test_an_unreadable_marker_is_refused(make_store: MakeStore, tmp_path: Path) -> None:
    make_store().close()
    (tmp_path / "s" / ".tierflow-store").write_text("{")
    with pytest.raises(StoreError, match=r"store marker .* is unreadable"):
        Store(tmp_path / "s")


# -- tiers and eviction --------------------------------------------------------------------


def test_values_are_on_the_ssd_and_in_ram(make_store: MakeStore) -> None:
    st = make_store(ram_mb=1)
    st["a"] = {"x": 1}
    assert entry_file(st, "a").is_file()
    use = st.usage()
    assert (use.ram_entries, use.ssd_entries) == (1, 1)
    assert use.ssd_bytes == entry_file(st, "a").stat().st_size


def test_the_ram_tier_is_bounded_least_recently_used_first(make_store: MakeStore) -> None:
    st = make_store(ram_mb=0.25)  # 262144 bytes: three 80 KB arrays fit, four do not
    for i in range(4):
        st[i] = np.full(10_000, i, dtype=np.float64)
        if i == 2:
            st.get(0)  # 0 becomes more recent than 1
    use = st.usage()
    assert use.ram_bytes <= 262_144 and use.ram_entries == 3 and use.ssd_entries == 4
    held = st._ram
    assert name_of(encode_key(1)) not in held and name_of(encode_key(0)) in held
    np.testing.assert_array_equal(st[1], 1)  # still on the SSD


def test_arrays_come_back_read_only_from_either_tier(make_store: MakeStore) -> None:
    st = make_store()
    arr = np.arange(1000.0)
    st["a"] = arr
    from_ram = st["a"]
    assert not isinstance(from_ram, np.memmap) and not from_ram.flags.writeable
    arr[0] = -1  # the RAM tier kept a copy
    assert from_ram[0] == 0
    st.relieve()
    from_ssd = st["a"]
    assert isinstance(from_ssd, np.memmap) and not from_ssd.flags.writeable
    np.testing.assert_array_equal(from_ssd, np.arange(1000.0))
    with pytest.raises(ValueError, match="read-only"):
        from_ssd[0] = 1


def test_a_mapped_array_outlives_replacement_and_eviction(make_store: MakeStore) -> None:
    st = make_store(ram_mb=0, disk_gb=300_000 / GB)
    st["a"] = np.full(10_000, 1.0)
    mapped = st["a"]
    st["a"] = np.full(10_000, 2.0)
    for i in range(5):
        st[i] = np.zeros(10_000)  # evicts "a"
    assert "a" not in st
    assert mapped.sum() == 10_000.0


def test_the_ssd_tier_evicts_least_recently_used_down_to_90_percent(make_store: MakeStore) -> None:
    limit = 100_000
    st = make_store(ram_mb=1, disk_gb=limit / GB)
    value = b"x" * 9_000  # ~9.3 KB per entry on disk
    for i in range(10):
        st[i] = value
    st.get(0)  # 0 is now recently used: it must survive the eviction
    st.get(1)
    size_before = st.usage().ssd_bytes
    assert size_before <= limit
    st[10] = value
    use = st.usage()
    assert use.ssd_bytes <= 0.9 * limit
    assert use.ssd_bytes == disk_bytes(st)
    survivors = set(st)
    assert {0, 1, 10} <= survivors and 2 not in survivors
    assert 2 not in st and st.get(2) is None
    assert name_of(encode_key(2)) not in st._ram  # gone from RAM too


def test_access_times_reach_the_index_in_batches(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = make_store()
    st["a"] = 1
    writes = []
    original = Index.write

    def counting(self: Index) -> Any:
        writes.append(1)
        return original(self)

    monkeypatch.setattr(Index, "write", counting)
    for _ in range(100):
        assert st["a"] == 1
    assert writes == []  # RAM hits write nothing
    st.flush()
    assert writes == [1]


def test_a_set_that_fits_is_one_statement_and_one_that_does_not_one_transaction(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = make_store(disk_gb=40_000 / GB)
    writes = []
    original = Index.write

    def counting(self: Index) -> Any:
        writes.append(1)
        return original(self)

    monkeypatch.setattr(Index, "write", counting)
    for i in range(4):
        st[i] = b"x" * 9_000  # ~9.3 KB each: four fit
    assert writes == [] and st.usage().ssd_entries == 4
    st[4] = b"x" * 9_000
    assert writes == [1]  # the eviction, the access times and the row, committed together
    assert st.usage().ssd_bytes == disk_bytes(st) <= 0.9 * 40_000
    assert sorted(st) == [2, 3, 4]


def test_a_replacement_that_grows_past_the_limit_evicts_others(make_store: MakeStore) -> None:
    st = make_store(disk_gb=40_000 / GB)
    for i in range(4):
        st[i] = b"x" * 9_000
    before = st.usage().ssd_bytes
    st[3] = b"y" * 13_000  # its old 9.3 KB leave with it; 4 KB more would not fit
    assert before + 4_000 > 40_000
    assert st[3] == b"y" * 13_000
    assert st.usage().ssd_bytes == disk_bytes(st) <= 0.9 * 40_000
    assert 3 in set(st) and 0 not in set(st)


def test_a_value_larger_than_the_ssd_tier_is_refused(make_store: MakeStore) -> None:
    st = make_store(disk_gb=50_000 / GB)
    for i in range(4):
        st[i] = b"x" * 9_000
    before = sorted(st)
    with pytest.raises(
        StoreError,
        match=r"takes 78\.5 KB on disk, more than the whole SSD tier of store 's' \(48\.8 KB, "
        r"disk_gb=4\.65661e-05\); nothing was evicted",
    ):
        st["big"] = np.zeros(10_000)
    assert sorted(st) == before and "big" not in st
    assert list((st.path / "tmp").iterdir()) == []


def test_threads_share_a_store(make_store: MakeStore) -> None:
    st = make_store(ram_mb=0.05, disk_gb=200_000 / GB)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(60):
                key = (t, i % 15)
                st[key] = np.full(500, t * 1000 + i)
                got = st.get(key)
                if got is not None:
                    assert got[0] % 1000 <= i and got[0] // 1000 == t
                st.get((t - 1, i % 15))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    use = st.usage()
    assert use.ssd_bytes <= 200_000 and use.ssd_bytes == disk_bytes(st)
    assert use.ssd_entries == len(data_files(st))


# -- two handles on one folder (as two processes would be) ---------------------------------


def test_a_ram_hit_notices_a_value_replaced_elsewhere(make_store: MakeStore) -> None:
    a = make_store()
    b = make_store()
    a["k"] = "first"
    assert a["k"] == "first"
    b["k"] = "second"
    assert a["k"] == "second"
    b.delete("k")
    assert a.get("k") is None and "k" not in a


def test_two_handles_keep_the_total_within_the_limit(make_store: MakeStore) -> None:
    limit = 60_000
    a = make_store(disk_gb=limit / GB)
    b = make_store(disk_gb=limit / GB)
    for i in range(30):
        (a if i % 2 else b)[i] = b"y" * 5_000
    assert a.usage().ssd_bytes == b.usage().ssd_bytes == disk_bytes(a) <= limit


# -- restarts -----------------------------------------------------------------------------


def test_a_reopened_store_finds_its_values(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as st:
        st["a"] = np.arange(5)
        st[("b", 1)] = {"x": [1, 2]}
        st.set("c", "tagged", tag="t")
    with Store(tmp_path / "s") as st:
        np.testing.assert_array_equal(st["a"], np.arange(5))
        assert st[("b", 1)] == {"x": [1, 2]} and st["c"] == "tagged"
        assert len(st) == 3 and st.count("t") == 1


def test_the_lru_order_survives_a_restart(tmp_path: Path) -> None:
    limit = 45_000  # four 9.2 KB entries fit, five do not
    with Store(tmp_path / "s", disk_gb=limit / GB) as st:
        for key in "abcd":
            st[key] = b"z" * 9_000
        assert st["a"]  # a hit in RAM: recorded on close
    with Store(tmp_path / "s", disk_gb=limit / GB, ram_mb=0) as st:
        st["e"] = b"z" * 9_000  # over the limit: b, the least recently used, leaves
        assert sorted(st) == ["a", "c", "d", "e"]


def test_a_process_fork_gets_its_own_connection(make_store: MakeStore) -> None:
    st = make_store()
    st["parent"] = 1
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            st["child"] = st["parent"] + 1
            code = 0 if st._h.generation == tiers_mod._fork_generation else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert st["child"] == 2 and st["parent"] == 1 and len(st) == 2


# -- pressure -----------------------------------------------------------------------------


def test_pressure_halves_empties_and_restores_the_ram_tier(make_store: MakeStore) -> None:
    st = make_store(ram_mb=1)
    for i in range(8):
        st[i] = np.full(100_000 // 8, i, dtype=np.float64)  # 100 KB each
    assert st.usage().ram_entries == 8
    pressure.notify(Level.HIGH)
    assert st.usage().ram_limit == MB // 2 and st.usage().ram_bytes <= MB // 2
    pressure.notify(Level.CRITICAL)
    assert st.usage().ram_entries == 0 and st.usage().ram_limit == 0
    assert st.usage().ssd_entries == 8
    st[99] = np.zeros(10)  # not held while critical
    assert st.usage().ram_entries == 0
    pressure.notify(Level.MODERATE)
    assert st.usage().ram_limit == 0
    pressure.notify(Level.OK)
    assert st.usage().ram_limit == MB
    st[0] = np.full(12_500, 0.0)
    assert st.usage().ram_entries == 1
    np.testing.assert_array_equal(st[7], 7)


def test_relieve_empties_the_ram_tier_and_reports_bytes(make_store: MakeStore) -> None:
    st = make_store()
    st["a"] = np.zeros(1000)
    st["b"] = np.zeros(500)
    assert memory.relieve() == 12_000
    assert st.usage().ram_entries == 0 and st.usage().ram_limit == st.ram_limit
    assert st.relieve() == 0
    np.testing.assert_array_equal(st["a"], np.zeros(1000))


def test_a_closed_or_dropped_store_leaves_the_registry(tmp_path: Path) -> None:
    st = Store(tmp_path / "s")
    assert st in pressure.subscribers()
    st.close()
    assert st not in pressure.subscribers()
    other = Store(tmp_path / "t")
    del other
    import gc

    gc.collect()
    assert pressure.subscribers() == []


# -- integrity ----------------------------------------------------------------------------


class Payload:
    """Unpickling this runs open(marker, "w"): code execution, the attack to stop."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_the_payload_would_run_if_unpickled(tmp_path: Path) -> None:
    pickle.loads(pickle.dumps(Payload(tmp_path / "proof"))).close()
    assert (tmp_path / "proof").exists()


@pytest.mark.parametrize("keep_trailer", [False, True])
def test_a_replaced_pickle_is_never_unpickled(
    make_store: MakeStore, tmp_path: Path, keep_trailer: bool
) -> None:
    st = make_store()
    st["k"] = {"safe": True}
    st["other"] = 1
    path = entry_file(st, "k")
    original = path.read_bytes()
    body = pickle.dumps(Payload(tmp_path / "marker"))
    if keep_trailer:  # the signed trailer of the real value, after the attacker's pickle
        body += original[len(pickle.dumps({"safe": True}, protocol=5)) :]
    path.write_bytes(body)
    st.relieve()
    with pytest.warns(
        StoreWarning, match=r"store 's': dropped the entry in .*\. It was not loaded"
    ):
        assert st.get("k", "miss") == "miss"
    assert not (tmp_path / "marker").exists()
    assert not path.exists()
    assert sorted(st, key=repr) == ["other"] and len(st) == 1


def test_a_file_changed_while_its_value_is_in_ram_is_noticed(
    make_store: MakeStore, tmp_path: Path
) -> None:
    st = make_store()
    st["k"] = [1, 2, 3]
    entry_file(st, "k").write_bytes(pickle.dumps(Payload(tmp_path / "marker")))
    with pytest.warns(StoreWarning, match="no tierflow trailer"):
        assert st.get("k") is None
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("damage", ["truncate", "header", "garbage"])
def test_a_damaged_array_is_a_miss_not_a_crash(make_store: MakeStore, damage: str) -> None:
    st = make_store(ram_mb=0)
    st["a"] = np.arange(100_000.0)
    path = entry_file(st, "a")
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "header":
        path.write_bytes(data.replace(b"(100000,)", b"(900000,)"))
    else:
        path.write_bytes(os.urandom(len(data)))
    with pytest.warns(StoreWarning, match="dropped the entry"):
        assert st.get("a") is None
    assert not path.exists() and len(st) == 0


def test_a_vanished_file_is_a_quiet_miss(make_store: MakeStore) -> None:
    st = make_store(ram_mb=0)
    st["a"] = 1
    entry_file(st, "a").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert st.get("a") is None
    assert len(st) == 0  # the row went with the file


# -- the index: lost, damaged ---------------------------------------------------------------


def fill(st: Store) -> None:
    st["arr"] = np.arange(10.0)
    st[("tuple", 1)] = {"v": 1}
    st.set("tagged", "x", tag="fn@1")
    st.set(b"bytes", b"y", tag="fn@1")


def check_filled(st: Store) -> None:
    np.testing.assert_array_equal(st["arr"], np.arange(10.0))
    assert st[("tuple", 1)] == {"v": 1} and st["tagged"] == "x" and st[b"bytes"] == b"y"
    assert sorted(map(repr, st)) == sorted(map(repr, ["arr", ("tuple", 1), "tagged", b"bytes"]))
    assert st.count("fn@1") == 2
    assert st.usage().ssd_bytes == disk_bytes(st)


@pytest.mark.parametrize("how", ["garbage", "deleted", "empty"])
def test_a_lost_index_is_rebuilt_from_the_files(tmp_path: Path, how: str) -> None:
    with Store(tmp_path / "s") as st:
        fill(st)
    index = tmp_path / "s" / "index.sqlite"
    for suffix in ("-wal", "-shm"):
        Path(str(index) + suffix).unlink(missing_ok=True)
    if how == "garbage":
        index.write_bytes(os.urandom(64 * 1024))
    elif how == "deleted":
        index.unlink()
    else:
        index.write_bytes(b"")
    expected = "unreadable" if how == "garbage" else "missing"
    with pytest.warns(
        StoreWarning,
        match=rf"rebuilt from the entry files because it was {expected}.*: 4 entries found",
    ):
        st = Store(tmp_path / "s")
    with st:
        check_filled(st)


def test_a_rebuild_removes_files_that_fail_their_checks(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as st:
        fill(st)
        bad = entry_file(st, "tagged")
    bad.write_bytes(b"forged")
    (tmp_path / "s" / "index.sqlite").unlink()
    with pytest.warns(StoreWarning, match="3 entries found, 1 damaged files removed"):
        st = Store(tmp_path / "s")
    with st:
        assert len(st) == 3 and not bad.exists()


def test_damage_found_in_use_is_rebuilt_at_the_next_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = Store(tmp_path / "s")
    fill(st)
    damaged = sqlite3.DatabaseError("database disk image is malformed")
    damaged.sqlite_errorcode = 11  # type: ignore[attr-defined]

    def broken(*args: Any, **kwargs: Any) -> None:
        raise damaged

    monkeypatch.setattr(Index, "put_within", broken)
    with pytest.raises(
        StoreError, match=r"index of store .* is damaged .* open it again to rebuild"
    ):
        st["new"] = 1
    assert list((tmp_path / "s" / "tmp").iterdir()) == []  # the written file is gone too
    assert st["tagged"] == "x"  # reads still work
    st.close()
    monkeypatch.undo()
    with pytest.warns(StoreWarning, match="because it was found damaged while in use"):
        st = Store(tmp_path / "s")
    with st:
        check_filled(st)
    assert not (tmp_path / "s" / "index.damaged").exists()


def test_rebuild_on_demand_finds_files_the_index_lost(make_store: MakeStore) -> None:
    st = make_store()
    fill(st)
    with st._h.index.write():
        st._h.index.remove_all()
    assert len(st) == 0
    assert st.rebuild() == 4
    check_filled(st)


def test_a_rebuild_counts_files_over_the_limit_and_the_next_set_evicts(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as st:
        for i in range(10):
            st[i] = b"x" * 9_000
    with Store(tmp_path / "s", disk_gb=50_000 / GB) as st:  # opened with a smaller limit
        assert st.rebuild() == 10
        assert st.usage().ssd_bytes == disk_bytes(st) > 50_000
        st["new"] = 1
        assert st.usage().ssd_bytes == disk_bytes(st) <= 0.9 * 50_000
        assert st["new"] == 1


# -- atomicity ------------------------------------------------------------------------------


def test_leftover_temp_files_of_dead_processes_are_removed_on_open(tmp_path: Path) -> None:
    Store(tmp_path / "s").close()
    proc = subprocess.run(["true"], check=True)
    assert proc.returncode == 0
    dead = tmp_path / "s" / "tmp" / "999999999-12345-0.tmp"
    dead.write_bytes(b"torn")
    live = tmp_path / "s" / "tmp" / f"{processes.token()}-7.tmp"
    live.write_bytes(b"being written")
    foreign = tmp_path / "s" / "tmp" / "notes.txt"
    foreign.write_bytes(b"not ours")
    Store(tmp_path / "s").close()
    assert not dead.exists() and live.exists() and foreign.exists()


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs mounted at a temporary folder (needs root and mount rights)."""
    where = tmp_path / "tiny"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_keeps_the_old_value(tiny_disk: Path) -> None:
    st = Store(tiny_disk / "s", disk_gb=1)
    try:
        st["k"] = np.arange(1000.0)
        with pytest.raises(
            StoreError,
            match=r"no space left to store the value for key 'k' in .*"
            r"the previous value of the key is unchanged",
        ):
            st["k"] = np.zeros(3 * MB // 8)  # 3 MB into 2 MB
        assert list((st.path / "tmp").iterdir()) == []
        np.testing.assert_array_equal(st["k"], np.arange(1000.0))
        st.relieve()
        np.testing.assert_array_equal(st["k"], np.arange(1000.0))  # from the file
        st["small"] = 1  # the store still works
    finally:
        st.close()


def test_durable_stores_fsync(make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    st = make_store(durable=True)
    monkeypatch.setattr(os, "fsync", counting)
    st["a"] = 1
    assert len(calls) == 2  # the file, then its folder
    assert st["a"] == 1
    assert st._h.index._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
