"""The SQLite index: rows, running totals, LRU order, damage."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierflow.storage.store.index import Index, IndexDamaged, Row, is_damage


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    idx = Index(tmp_path / "index.sqlite")
    yield idx
    idx.close()


def put(idx: Index, name: str, size: int, atime: float, tag: str | None = None) -> None:
    with idx.write():
        idx.put(Row(name, name.encode(), tag, "pickle", size, atime))


def test_a_new_file_gets_the_schema_in_wal_mode(tmp_path: Path, index: Index) -> None:
    assert index.created
    assert index._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again = Index(tmp_path / "index.sqlite")
    assert not again.created
    again.close()


def test_totals_follow_inserts_replacements_and_deletes(index: Index) -> None:
    put(index, "a", 100, 1.0)
    put(index, "b", 50, 2.0)
    assert index.totals() == (2, 150)
    put(index, "a", 10, 3.0)  # replaced: counted once, with its new size
    assert index.totals() == (2, 60)
    with index.write():
        index.remove(["b", "missing"])
    assert index.totals() == (1, 10)
    with index.write():
        index.remove_all()
    assert index.totals() == (0, 0)


def test_oldest_walks_in_access_order_skipping_one(index: Index) -> None:
    for i, name in enumerate(["c", "a", "d", "b"]):
        put(index, name, i + 1, float(10 - i))
    assert [n for n, _ in index.oldest(exclude="d")] == ["b", "a", "c"]
    assert list(index.oldest(exclude="x", batch=1)) == [("b", 4), ("d", 3), ("a", 2), ("c", 1)]


def test_equal_access_times_do_not_stall_the_walk(index: Index) -> None:
    for name in "abcde":
        put(index, name, 1, 5.0)
    assert [n for n, _ in index.oldest(exclude="", batch=2)] == list("abcde")


def test_touch_only_moves_times_forward(index: Index) -> None:
    put(index, "a", 1, 5.0)
    put(index, "b", 1, 6.0)
    with index.write():
        index.touch([(9.0, "a"), (1.0, "b"), (3.0, "gone")])
    assert [n for n, _ in index.oldest(exclude="")] == ["b", "a"]


def test_tags_count_and_clear_separately(index: Index) -> None:
    put(index, "a", 1, 1.0, tag="f")
    put(index, "b", 2, 2.0, tag="f")
    put(index, "c", 4, 3.0, tag="g")
    put(index, "d", 8, 4.0)
    assert (index.count("f"), index.count("g"), index.count()) == (2, 1, 4)
    assert sorted(index.names("f")) == ["a", "b"]
    with index.write():
        index.remove_all("f")
    assert index.totals() == (2, 12)
    assert index.keys() == [b"c", b"d"]


def test_put_within_refuses_rows_that_would_pass_the_limit(index: Index) -> None:
    put(index, "a", 60, 1.0)
    index.limit(100)
    assert not index.put_within(Row("b", b"b", None, "pickle", 41, 2.0))
    assert index.totals() == (1, 60) and not index.has("b")  # nothing written
    assert index.put_within(Row("b", b"b", None, "pickle", 40, 2.0))
    assert index.totals() == (2, 100)
    # A replacement counts the row it replaces: 100 - 60 + 61 is over, + 60 is not.
    assert not index.put_within(Row("a", b"a", None, "pickle", 61, 3.0))
    assert index.size_of("a") == 60
    assert index.put_within(Row("a", b"a", None, "pickle", 60, 3.0))
    assert index.totals() == (2, 100)


def test_the_limit_belongs_to_one_connection_and_can_be_lifted(
    tmp_path: Path, index: Index
) -> None:
    index.limit(10)
    other = Index(tmp_path / "index.sqlite")
    try:
        assert other.put_within(Row("big", b"big", None, "pickle", 50, 1.0))  # no limit there
    finally:
        other.close()
    with pytest.raises(sqlite3.IntegrityError, match="over the size limit"):
        index.put(Row("more", b"more", None, "pickle", 1, 2.0))
    index.limit(None)
    index.put(Row("more", b"more", None, "pickle", 1, 2.0))
    assert index.totals() == (2, 51)
    assert index.size_of("more") == 1 and index.size_of("missing") is None


def test_a_failed_transaction_changes_nothing(index: Index) -> None:
    put(index, "a", 1, 1.0)
    with pytest.raises(RuntimeError), index.write():
        index.put(Row("b", b"b", None, "pickle", 5, 2.0))
        raise RuntimeError
    assert index.totals() == (1, 1) and not index.has("b")


def test_garbage_is_not_an_index(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    path.write_bytes(b"\x13garbage" * 1000)
    with pytest.raises(IndexDamaged, match="not a database"):
        Index(path)


def test_another_schema_is_not_an_index(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE other (x)")
    db.commit()
    db.close()
    with pytest.raises(IndexDamaged, match=r"schema version 0 with tables \['other'\]"):
        Index(path)


def test_a_busy_index_is_not_damaged(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    Index(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process in the middle of a write
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            Index(path, timeout=0.05)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_damage_is_told_apart_from_other_errors(tmp_path: Path) -> None:
    path = tmp_path / "x"
    path.write_bytes(b"garbage" * 1000)
    db = sqlite3.connect(path)
    with pytest.raises(sqlite3.DatabaseError) as info:
        db.execute("SELECT 1 FROM sqlite_master")
    assert is_damage(info.value)
    assert not is_damage(sqlite3.OperationalError("database is locked"))
