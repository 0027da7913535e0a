"""The index of a store: one SQLite row per entry, and the running totals.

Why SQLite (the standard library's ``sqlite3``) in WAL mode:

- the size of the SSD tier is a running total kept by triggers in the same database
  as the rows, so it can never drift from them, and ``set`` checks one row instead of
  listing folders: its cost does not grow with the number of entries (B-tree lookups
  are logarithmic; a level more at 100,000 entries is not measurable);
- one writer at a time across processes, and the total checked in the statement that
  adds a row (:meth:`Index.put_within`), keep "total <= limit" true when two processes
  fill one store; readers never wait for the writer in WAL mode;
- least-recently-used order is an index on the access time, so eviction reads the
  oldest rows without sorting anything, and the order survives a restart;
- with ``synchronous=NORMAL`` a commit is an append to the WAL file without an fsync:
  tens of microseconds. A power loss may lose the last commits, never consistency
  (``durable=True`` stores use ``synchronous=FULL``).

The index only describes the files; each file carries its own key, kind and tag in a
signed trailer, so a lost or corrupted index is rebuilt from the files
(:meth:`tierflow.storage.store.tiers.Store.rebuild`).

Locking: an :class:`Index` is one connection; callers serialise its use (the store's
lock). A single statement is its own transaction; several that must commit together
go inside :meth:`Index.write`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

__all__ = ["SCHEMA_VERSION", "Index", "IndexDamaged"]

SCHEMA_VERSION = 1

# name: the entry's file name (hex digest of the key); key: the encoded key; tag: a
# label for groups of entries (@cached puts the function's identity there); size: file
# bytes; atime: last access, seconds since the epoch.
_SCHEMA = """
CREATE TABLE entries (
    name  TEXT PRIMARY KEY,
    key   BLOB NOT NULL,
    tag   TEXT,
    kind  TEXT NOT NULL,
    size  INTEGER NOT NULL,
    atime REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX entries_by_atime ON entries (atime);
CREATE INDEX entries_by_tag ON entries (tag) WHERE tag IS NOT NULL;
CREATE TABLE totals (
    id    INTEGER PRIMARY KEY CHECK (id = 0),
    count INTEGER NOT NULL,
    size  INTEGER NOT NULL
);
INSERT INTO totals VALUES (0, 0, 0);
CREATE TRIGGER entries_insert AFTER INSERT ON entries BEGIN
    UPDATE totals SET count = count + 1, size = size + new.size WHERE id = 0;
END;
CREATE TRIGGER entries_delete AFTER DELETE ON entries BEGIN
    UPDATE totals SET count = count - 1, size = size - old.size WHERE id = 0;
END;
CREATE TRIGGER entries_resize AFTER UPDATE OF size ON entries BEGIN
    UPDATE totals SET size = size - old.size + new.size WHERE id = 0;
END;
"""

_CACHE_KB = 16 * 1024  # SQLite page cache per connection, KiB
_WAL_LIMIT = 64 << 20  # bytes the WAL file is truncated to after a checkpoint

# SQLite's primary result codes for a damaged database and for a file that is not one.
_CORRUPT_CODES = (11, 26)

_UPSERT = (
    "INSERT INTO entries (name, key, tag, kind, size, atime) VALUES (?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (name) DO UPDATE SET key = excluded.key, tag = excluded.tag, "
    "kind = excluded.kind, size = excluded.size, atime = excluded.atime"
)

# The limit guard: a TEMP trigger, so it belongs to this connection only (each process
# enforces the limit it opened the store with) and never reaches the file. It runs
# before the row is written, when the totals are still those before the statement;
# under UPSERT a BEFORE INSERT trigger fires for replacements too, hence the old size.
_OVER_LIMIT = "tierflow: entry over the size limit"
_GUARD = """
CREATE TEMP TRIGGER entries_within_limit BEFORE INSERT ON main.entries
WHEN (SELECT size FROM main.totals WHERE id = 0) + new.size
     - coalesce((SELECT size FROM main.entries WHERE name = new.name), 0) > {limit}
BEGIN SELECT RAISE(ABORT, '{message}'); END
"""


class Row(NamedTuple):
    """One entry's row: its file name, encoded key, tag, kind, file size and access time."""

    name: str
    key: bytes
    tag: str | None
    kind: str
    size: int
    atime: float


class IndexDamaged(Exception):
    """The index file is not a readable SQLite database of this schema."""


def is_damage(exc: sqlite3.Error) -> bool:
    """Whether a SQLite error means the database file itself is damaged."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in _CORRUPT_CODES


class Index:
    """One connection to a store's index at ``path``.

    Opening creates the schema if the file is new (``created`` is then True, and the
    caller fills it from the files). Raises :class:`IndexDamaged` for a file that is
    not a database, or one with another schema version, and ``sqlite3.Error`` for other
    failures (busy, unwritable). ``timeout`` is how long (s) a write waits for another
    process's write before ``sqlite3.OperationalError``.
    """

    def __init__(self, path: Path, *, durable: bool = False, timeout: float = 60.0) -> None:
        self.path = path
        self.created = False
        self._db = sqlite3.connect(
            path, timeout=timeout, isolation_level=None, check_same_thread=False
        )
        try:
            self._setup(durable)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            # Only a damaged file is rebuilt; a busy or unwritable one is the caller's error
            # (rebuilding an index another process is using would lose its entries).
            if is_damage(exc):
                raise IndexDamaged(f"{exc}") from exc
            raise
        except BaseException:
            self._db.close()
            raise

    def _setup(self, durable: bool) -> None:
        db = self._db
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        db.execute("PRAGMA temp_store=MEMORY")
        # A set changes a leaf page picked by a hash: with SQLite's default 2 MB page cache,
        # most of them are read again from the file once a store has tens of thousands of
        # entries. 16 MB keeps the pages of ~100,000 entries (memory is used as pages are).
        db.execute(f"PRAGMA cache_size=-{_CACHE_KB}")
        # The WAL is reused after each checkpoint but never shrinks on its own; a reader
        # holding an old snapshot can make it grow. Truncate it back past this size.
        db.execute(f"PRAGMA journal_size_limit={_WAL_LIMIT}")
        with self.write():
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
            if version == 0 and not tables:
                for statement in _split(_SCHEMA):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                self.created = True
            elif version != SCHEMA_VERSION or "entries" not in tables or "totals" not in tables:
                raise IndexDamaged(
                    f"schema version {version} with tables {sorted(tables)}, expected "
                    f"version {SCHEMA_VERSION}"
                )
        db.execute("SELECT count, size FROM totals WHERE id = 0").fetchone()

    @contextmanager
    def write(self) -> Iterator[None]:
        """A write transaction (``BEGIN IMMEDIATE``): waits for other writers, commits
        on success, rolls back on any exception."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def limit(self, size: int | None) -> None:
        """Refuse, from now on, any insert or replacement through this connection that
        would take the total over ``size`` bytes (``None``: no limit). See
        :meth:`put_within`; :meth:`put` and :meth:`put_many` then raise
        ``sqlite3.IntegrityError`` for such rows."""
        self._db.execute("DROP TRIGGER IF EXISTS temp.entries_within_limit")
        if size is not None:
            self._db.execute(_GUARD.format(limit=int(size), message=_OVER_LIMIT))

    def put(self, row: Row) -> None:
        """Insert or replace the row of ``row.name``; the triggers update the totals."""
        self._db.execute(_UPSERT, row)

    def put_within(self, row: Row) -> bool:
        """Like :meth:`put`, unless the total would exceed the :meth:`limit`: then
        nothing is written and the answer is False. One statement: outside
        :meth:`write` it is a transaction of its own, checked and committed at once."""
        try:
            self._db.execute(_UPSERT, row)
        except sqlite3.IntegrityError as exc:
            if str(exc) == _OVER_LIMIT:
                return False
            raise
        return True

    def put_many(self, rows: Iterable[Row]) -> None:
        """Insert rows, replacing existing ones."""
        self._db.executemany(_UPSERT, rows)

    def size_of(self, name: str) -> int | None:
        """The recorded file size of ``name``, None if it has no row."""
        row = self._db.execute("SELECT size FROM entries WHERE name = ?", (name,)).fetchone()
        return None if row is None else int(row[0])

    def has(self, name: str) -> bool:
        return (
            self._db.execute("SELECT 1 FROM entries WHERE name = ?", (name,)).fetchone() is not None
        )

    def totals(self) -> tuple[int, int]:
        """(number of entries, bytes of their files)."""
        count, size = self._db.execute("SELECT count, size FROM totals WHERE id = 0").fetchone()
        return int(count), int(size)

    def oldest(self, exclude: str, batch: int = 256) -> Iterator[tuple[str, int]]:
        """(name, size) of entries from the least recently used on, skipping ``exclude``."""
        after: tuple[float, str] | None = None
        while True:
            if after is None:
                rows = self._db.execute(
                    "SELECT atime, name, size FROM entries ORDER BY atime, name LIMIT ?", (batch,)
                ).fetchall()
            else:
                rows = self._db.execute(
                    "SELECT atime, name, size FROM entries WHERE (atime, name) > (?, ?) "
                    "ORDER BY atime, name LIMIT ?",
                    (*after, batch),
                ).fetchall()
            for _atime, name, size in rows:
                if name != exclude:
                    yield name, int(size)
            if len(rows) < batch:
                return
            after = (rows[-1][0], rows[-1][1])

    def remove(self, names: Iterable[str]) -> None:
        self._db.executemany("DELETE FROM entries WHERE name = ?", ((n,) for n in names))

    def remove_all(self, tag: str | None = None) -> None:
        if tag is None:
            self._db.execute("DELETE FROM entries")
        else:
            self._db.execute("DELETE FROM entries WHERE tag = ?", (tag,))

    def touch(self, times: Iterable[tuple[float, str]]) -> None:
        """Record access times (atime, name); an access never moves a time backwards."""
        self._db.executemany("UPDATE entries SET atime = ?1 WHERE name = ?2 AND atime < ?1", times)

    def names(self, tag: str | None = None) -> list[str]:
        if tag is None:
            return [r[0] for r in self._db.execute("SELECT name FROM entries")]
        return [r[0] for r in self._db.execute("SELECT name FROM entries WHERE tag = ?", (tag,))]

    def keys(self) -> list[bytes]:
        """Encoded keys of every entry, least recently used first."""
        return [bytes(r[0]) for r in self._db.execute("SELECT key FROM entries ORDER BY atime")]

    def count(self, tag: str | None = None) -> int:
        if tag is None:
            return self.totals()[0]
        (n,) = self._db.execute("SELECT count(*) FROM entries WHERE tag = ?", (tag,)).fetchone()
        return int(n)

    def close(self) -> None:
        self._db.close()


def _split(script: str) -> list[str]:
    """The statements of :data:`_SCHEMA` (``executescript`` would commit our transaction)."""
    statements, current = [], []
    for line in script.strip().splitlines():
        current.append(line)
        joined = "\n".join(current)
        if line.rstrip().endswith(";") and sqlite3.complete_statement(joined):
            statements.append(joined)
            current = []
    return statements
