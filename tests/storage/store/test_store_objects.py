"""A store in object storage (the local S3 server): entries committed whole, checked
before anything is unpickled or mapped, signed with a key that travels with the store,
and a prefix that is not a store's left alone."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow import config
from tierflow.errors import StoreError
from tierflow.storage.store import StoreWarning, objects
from tierflow.storage.store.objects import ObjectStore

pytest.importorskip("s3fs")


@pytest.fixture
def url(s3_server: dict[str, Any], request: pytest.FixtureRequest) -> str:
    config.set(shared_options=s3_server)
    return f"s3://tierflow/stores/{request.node.name}"


def _fs(options: dict[str, Any]) -> Any:
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.invalidate_cache()
    return fs


def _objects(options: dict[str, Any], url: str) -> list[str]:
    fs = _fs(options)
    prefix = url.removeprefix("s3://")
    return sorted(p.rsplit("/", 1)[-1] for p in fs.find(prefix))


def test_values_and_arrays_come_back_as_written(url: str, s3_server: dict[str, Any]) -> None:
    st = ObjectStore(url)
    big_endian = np.arange(12, dtype=">i4").reshape(4, 3)
    empty = np.zeros((0, 5), dtype=np.float32)
    st.set(("a", 1), big_endian, tag="t")
    st.set(("a", 2), empty, tag="t")
    st.set("value", {"mean": 2.5, "n": [1, 2]}, tag="t")
    got = st.get(("a", 1))
    assert got.dtype == np.dtype(">i4") and not got.flags.writeable
    np.testing.assert_array_equal(got, big_endian)
    zero = st.get(("a", 2))
    assert zero.shape == (0, 5) and zero.dtype == np.float32
    assert st.get("value") == {"mean": 2.5, "n": [1, 2]}
    assert st.get("absent", "none") == "none"
    assert ("a", 1) in st and ("a", 3) not in st
    assert st.count() == 3
    use = st.usage()
    assert use.ssd_entries == 3 and use.ssd_bytes > big_endian.nbytes and use.ssd_limit == 0
    st.set(("a", 1), np.ones(2))  # replaced
    np.testing.assert_array_equal(st.get(("a", 1)), np.ones(2))
    assert st.count() == 3
    # only the record of the key's id and the entries: no temporary key is left
    assert [n for n in _objects(s3_server, url) if ".tmp-" in n] == []


def test_clear_removes_the_entries_and_nothing_else(url: str, s3_server: dict[str, Any]) -> None:
    st = ObjectStore(url)
    st.set(1, np.ones(3))
    st.set(2, "two")
    fs = _fs(s3_server)
    prefix = url.removeprefix("s3://")
    fs.pipe_file(f"{prefix}/notes.txt", b"the user's")  # written there after the store
    fs.pipe_file(f"{prefix}/{'0' * 32}.tfe.tmp-{'f' * 32}", b"a write that died")
    assert st.clear() == 2
    assert st.count() == 0 and st.get(1) is None
    assert _objects(s3_server, url) == [".tierflow-store", "notes.txt"]


def test_a_prefix_that_holds_other_objects_is_not_taken_over(
    url: str, s3_server: dict[str, Any]
) -> None:
    fs = _fs(s3_server)
    prefix = url.removeprefix("s3://")
    fs.pipe_file(f"{prefix}/data.csv", b"a,b\n1,2\n")
    with pytest.raises(StoreError, match=r"holds other objects \(data.csv\).*not a tierflow"):
        ObjectStore(url)
    assert _objects(s3_server, url) == ["data.csv"]


def test_a_record_changed_outside_is_refused(url: str, s3_server: dict[str, Any]) -> None:
    ObjectStore(url).set(1, "one")
    fs = _fs(s3_server)
    record = f"{url.removeprefix('s3://')}/.tierflow-store"
    for garbled in (b"[1, 2]", b"not json"):
        fs.pipe_file(record, garbled)
        with pytest.raises(StoreError, match="is not a tierflow store record"):
            ObjectStore(url)
    assert len(_objects(s3_server, url)) == 2  # the entry and the record: nothing removed


def test_a_store_signed_with_another_key_is_refused(url: str, tmp_path: Path) -> None:
    ObjectStore(url).set(1, "one")
    config.set(store_dir=str(tmp_path / "other" / "stores"))  # another key file
    with pytest.raises(StoreError, match=r"signed with key id .* same key file"):
        ObjectStore(url)


def test_the_key_travels_with_the_store(url: str, tmp_path: Path) -> None:
    here = ObjectStore(url)
    sent = pickle.dumps(here)
    config.set(store_dir=str(tmp_path / "worker" / "stores"))  # a worker with its own key
    there = pickle.loads(sent)
    assert pickle.loads(sent) is there  # opened once per process, not once per task
    there.set("from the worker", np.arange(4.0))
    np.testing.assert_array_equal(here.get("from the worker"), np.arange(4.0))


def test_an_object_changed_outside_is_a_miss_never_unpickled(
    url: str, s3_server: dict[str, Any]
) -> None:
    st = ObjectStore(url)
    st.set("k", {"safe": True})
    st.set("other", {"other": True})
    fs = _fs(s3_server)
    names = [n for n in _objects(s3_server, url) if n.endswith(".tfe")]
    _, path_k = st._object("k")
    _, path_other = st._object("other")
    body = bytearray(fs.cat_file(path_k))
    body[5] ^= 0xFF  # one changed byte of the pickle
    fs.pipe_file(path_k, bytes(body))
    with pytest.warns(StoreWarning, match="failed its checks"):
        assert st.get("k", "missing") == "missing"
    # a whole, signed entry moved under another key's name is not that key's value
    fs.copy(path_other, path_k)
    with pytest.warns(StoreWarning, match="another key"):
        assert st.get("k", "missing") == "missing"
    evil = pickle.dumps(ValueError("never built"))
    fs.pipe_file(path_k, evil)
    with pytest.warns(StoreWarning, match="failed its checks"):
        assert st.get("k", "missing") == "missing"
    assert len(names) == 2


def test_membership_comes_from_a_listing_not_a_request_per_key(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = ObjectStore(url)
    here.set("a", 1)
    other = pickle.loads(pickle.dumps(here))  # as a worker opens it
    assert "a" in here and "b" not in here  # one listing
    asked: list[str] = []
    monkeypatch.setattr(here._fs, "exists", lambda path: asked.append(path) or True)
    assert all(k not in here for k in range(100)) and asked == []
    here.set("b", 2)  # its own write is known at once
    assert "b" in here
    other.set("c", 3)  # another's, once the listing is renewed
    assert "c" not in here
    monkeypatch.setattr(objects, "LISTING_SECONDS", 0.0)
    assert "c" in here
    assert here.get("c") == 3  # get never waits for a listing
    here.clear()
    assert "a" not in here


def test_a_failed_write_leaves_nothing(url: str, s3_server: dict[str, Any]) -> None:
    st = ObjectStore(url)
    with pytest.raises((TypeError, pickle.PicklingError, AttributeError)):
        st.set("lambda", lambda: 1)
    assert _objects(s3_server, url) == [".tierflow-store"]
    assert "lambda" not in st
