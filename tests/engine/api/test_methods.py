"""The ndarray methods a NumPy user reaches for on a lazy array, and NumPy's names in
errors (tierflow/engine/api/methods.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.api import dispatch
from tierflow.system import budget


@pytest.fixture
def a() -> np.ndarray:
    return np.random.default_rng(8).normal(size=(50, 4))


@pytest.fixture
def x(a: np.ndarray) -> tw.Array:
    return tw.from_array(a, rows=8)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda x: np.linalg.inv(x), "np.linalg.inv"),
        (lambda x: np.fft.fft(x), "np.fft.fft"),
        (lambda x: np.linalg.eigh(x), "np.linalg.eigh"),
        (lambda x: np.polyfit(x, x, 1), "np.polyfit"),
        (lambda x: np.linalg.det(x), "np.linalg.det"),
    ],
)
def test_unsupported_numpy_functions_are_named_as_written(
    x: tw.Array, call: object, name: str
) -> None:
    with pytest.raises(TypeError) as raised:
        call(x)  # type: ignore[operator]
    message = str(raised.value)
    assert message.startswith(name), message
    assert "is not supported on lazy arrays" in message and "compute() first" in message


def test_function_name_leaves_private_modules_out() -> None:
    assert dispatch.function_name(np.linalg.norm) == "np.linalg.norm"
    assert dispatch.function_name(np.sum) == "np.sum"
    assert dispatch.function_name(np.fft.rfft) == "np.fft.rfft"


def test_copy_is_a_new_handle_on_the_same_graph(a: np.ndarray, x: tw.Array) -> None:
    y = x.copy()
    assert y is not x and y.key == x.key and y.blocks == x.blocks
    np.testing.assert_array_equal(y.compute(), a)
    with pytest.raises(ValueError, match="copied in C order"):
        x.copy(order="F")


def test_tolist_computes_and_refuses_lists_past_the_budget(
    a: np.ndarray, x: tw.Array, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert x.tolist() == a.tolist()
    assert x[3, 1].tolist() == a[3, 1].tolist()
    masked = x[x[:, 0] > 0]
    assert masked.tolist() == a[a[:, 0] > 0].tolist()
    monkeypatch.setattr(budget, "budget_bytes", lambda: 50 * 4 * 32 - 1)
    with pytest.raises(MemoryError, match=r"x\.tolist\(\) of shape \(50, 4\) would build 200"):
        x.tolist()
    assert x[:5].tolist() == a[:5].tolist()
    monkeypatch.setattr(budget, "budget_bytes", lambda: 1)
    with pytest.raises(MemoryError, match=r"would build \d+ Python numbers.*more than the RAM"):
        masked.tolist()  # checked once computed: its row count was unknown


def test_item_gives_one_python_scalar(a: np.ndarray, x: tw.Array) -> None:
    assert x.item(7) == a.item(7)
    assert x.item(3, 2) == a.item(3, 2)
    assert x.item((4, 1)) == a.item((4, 1))
    assert x[2:3, 1:2].item() == a[2, 1]
    with pytest.raises(ValueError, match="can only convert an array of size 1"):
        x.item()


def test_item_out_of_range_is_numpys_index_error(a: np.ndarray, x: tw.Array) -> None:
    with pytest.raises(IndexError, match="index 200 is out of bounds for size 200"):
        x.item(200)
    with pytest.raises(IndexError, match="index 4 is out of bounds for axis 1 with size 4"):
        x.item(3, 4)
    with pytest.raises(IndexError, match="index 0 is out of bounds for size 0"):
        tw.from_array(np.zeros((0, 3)), rows=1).item(0)
    assert x.item(-200) == a.item(-200)


@pytest.mark.parametrize("threshold", [0.0, 100.0, 2.3])
def test_item_after_a_mask_counts_the_rows_first(
    a: np.ndarray, x: tw.Array, threshold: float
) -> None:
    masked, kept = x[x[:, 0] > threshold], a[a[:, 0] > threshold]
    for args in ((0,), (-1,), (5,), (1, 2), ()):
        try:
            expected = kept.item(*args)
        except (IndexError, ValueError) as exc:
            with pytest.raises(type(exc), match=str(exc)):
                masked.item(*args)
        else:
            assert masked.item(*args) == expected


@pytest.mark.parametrize("threshold", [1.8, 0.0, 100.0])
def test_squeeze_after_a_mask_counts_the_rows_first(threshold: float) -> None:
    # The row axis goes where one row is left: a count decides it, as len() does.
    a = np.array([[0.5], [1.9], [-1.0], [0.3]])
    x = tw.from_array(a, rows=1)
    masked, kept = x[x[:, 0] > threshold], a[a[:, 0] > threshold]
    for squeeze in (lambda v: v.squeeze(), lambda v: v.squeeze(axis=-1)):
        got, want = squeeze(masked), squeeze(kept)
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got.compute()), want)
    try:
        want = kept.squeeze(axis=0)
    except ValueError as exc:
        with pytest.raises(ValueError, match=str(exc)):
            masked.squeeze(axis=0)
    else:
        np.testing.assert_array_equal(masked.squeeze(axis=0).compute(), want)


def test_rechunk_cuts_new_blocks_lazily(a: np.ndarray, x: tw.Array, tmp_path: Path) -> None:
    r = x.rechunk(20)
    assert r.blocks == ((0, 20), (20, 40), (40, 50))
    np.testing.assert_array_equal(r.compute(), a)
    y = (x * 2 + 1).rechunk(13)
    assert y.blocks == ((0, 13), (13, 26), (26, 39), (39, 50))
    assert "rechunk(rows=13)" in repr(y)
    np.testing.assert_allclose(y.sum(axis=0).compute(), (a * 2 + 1).sum(axis=0))
    y.to_npy(tmp_path / "y.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), a * 2 + 1)
    assert x.rechunk(8) is x
    np.save(tmp_path / "a.npy", a)
    f = tw.from_npy(tmp_path / "a.npy", rows=10).rechunk(25)
    assert f.blocks == ((0, 25), (25, 50)) and f.key == tw.from_npy(tmp_path / "a.npy").key
    with pytest.raises(ValueError, match="in-memory result"):
        x.sum(axis=0).rechunk(5)
    with pytest.raises(ValueError, match="rows >= 1"):
        x.rechunk(0)


def test_rechunk_takes_dasks_chunks_and_chunks_reads_as_dasks(a: np.ndarray, x: tw.Array) -> None:
    assert x.chunks == ((8, 8, 8, 8, 8, 8, 2), (4,))
    assert x.rechunk(((20, 30), (4,))).chunks == ((20, 30), (4,))
    assert x.rechunk((25, -1)).chunks == ((25, 25), (4,))
    assert x.rechunk({0: 30}).chunks == ((30, 20), (4,))
    assert x.rechunk(((10, 40), None)).chunks == ((10, 40), (4,))
    assert x.rechunk(-1).chunks == ((50,), (4,))
    irregular = (x * 2).rechunk(((5, 45), (4,)))
    assert "rechunk(2 blocks)" in repr(irregular)
    np.testing.assert_array_equal(irregular.compute(), a * 2)
    assert x.sum(axis=0).chunks == ((4,),)
    assert x[x[:, 0] > 0].chunks[0][0] != x[x[:, 0] > 0].chunks[0][0]  # NaN: unknown
    with pytest.raises(ValueError, match=r"axis 1 \(of length 4\) is whole in every block"):
        x.rechunk((10, 2))
    with pytest.raises(ValueError, match="add up to 40, but the array has 50 rows"):
        x.rechunk(((20, 20), (4,)))
    one = tw.from_array(a[:, 0], rows=10)
    assert one.rechunk((10, 15, 25)).chunks == ((10, 15, 25),)  # each block's rows
    assert one.rechunk((25,)).chunks == ((25, 25),)  # one entry per axis


def test_rechunk_after_a_mask_counts_the_rows_first(a: np.ndarray, x: tw.Array) -> None:
    masked = x[x[:, 0] > 0].rechunk(5)
    kept = a[a[:, 0] > 0]
    np.testing.assert_array_equal(masked.compute(), kept)
    assert len(masked) == len(kept) and masked.shape == kept.shape


def test_lazy_methods_follow_numpy(a: np.ndarray, x: tw.Array) -> None:
    c = a[:, :2] + 1j * a[:, 2:]
    z = tw.from_array(c, rows=7)
    cube = tw.from_array(a.reshape(50, 2, 2), rows=9)
    one = tw.from_array(a[:, :1].reshape(50, 1, 1), rows=9)
    cases = [
        (z.conj(), c.conj()),
        (z.conjugate(), c.conjugate()),
        (z.real, c.real),
        (z.imag, c.imag),
        (x.real, a.real),
        (x.imag, a.imag),
        (x.dot(np.ones(4)), a.dot(np.ones(4))),
        (x.take([3, 1, 1], axis=0), a.take([3, 1, 1], axis=0)),
        (x.take([3, 0], axis=1), a.take([3, 0], axis=1)),
        (x[:, 0].take([5, 2]), a[:, 0].take([5, 2])),
        (x.compress(a[:, 0] > 0, axis=0), a.compress(a[:, 0] > 0, axis=0)),
        (x.compress([True, False, True], axis=1), a.compress([True, False, True], axis=1)),
        (x.repeat(2, axis=1), a.repeat(2, axis=1)),
        (cube.swapaxes(1, 2), a.reshape(50, 2, 2).swapaxes(1, 2)),
        (cube.diagonal(axis1=1, axis2=2), a.reshape(50, 2, 2).diagonal(axis1=1, axis2=2)),
        (cube.trace(axis1=1, axis2=2), a.reshape(50, 2, 2).trace(axis1=1, axis2=2)),
        (one.squeeze(), a[:, :1].reshape(50, 1, 1).squeeze()),
        (one.squeeze(axis=2), a[:, :1].reshape(50, 1, 1).squeeze(axis=2)),
        (x[:1].squeeze(), a[:1].squeeze()),
        (x[:, 0].ravel(), a[:, 0].ravel()),
        (x.view(np.int64), a.view(np.int64)),
        (x.view(np.float32), a.view(np.float32)),
    ]
    for lazy, want in cases:
        assert isinstance(lazy, tw.Array)
        got = lazy.compute()
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    assert x.device == "cpu" and x.to_device("cpu") is x


def test_methods_that_would_move_the_rows_say_what_to_do(x: tw.Array) -> None:
    with pytest.raises(ValueError, match=r"x\.ravel\(\) of shape \(50, 4\) would turn each row"):
        x.ravel()
    with pytest.raises(ValueError, match="without an axis picks from the flattened array"):
        x.take([1])
    with pytest.raises(ValueError, match=r"along the rows \(axis 0\) changes the row count"):
        x.repeat(2, axis=0)
    with pytest.raises(ValueError, match="swap trailing axes only"):
        x.swapaxes(0, 1)
    with pytest.raises(ValueError, match="cannot select an axis to squeeze out"):
        x.squeeze(axis=1)
    with pytest.raises(ValueError, match=r"x\.view\(int16\) of a 1-D lazy array"):
        x[:, 0].view(np.int16)
    with pytest.raises(ValueError, match=r"persist\(device='cuda'\)"):
        x.to_device("cuda")


@pytest.mark.parametrize("name", sorted(dispatch.REFUSED))
def test_every_refused_ndarray_name_says_what_to_do(x: tw.Array, name: str) -> None:
    assert hasattr(np.ndarray, name)  # a name NumPy users know
    is_property, guidance = dispatch.REFUSED[name]
    shown = f"x.{name}" if is_property else f"x.{name}()"
    with pytest.raises(
        TypeError,
        match=f"^{shown.replace('(', '[(]').replace(')', '[)]')} is not supported on lazy arrays: ",
    ) as raised:
        getattr(x, name) if is_property else getattr(x, name)()
    assert str(raised.value).endswith(guidance)
    assert any(word in guidance for word in ("use ", "compute() first"))


def test_an_attribute_numpy_does_not_have_stays_an_attribute_error(x: tw.Array) -> None:
    with pytest.raises(AttributeError):
        x.no_such_thing  # noqa: B018


@pytest.mark.parametrize("dtype", ["bool", "uint8", ">i4", "float16"])
def test_the_conjugate_of_real_data_keeps_its_dtype(dtype: str) -> None:
    a = np.array([True, False, True, True]).astype(dtype)
    x = tw.from_array(a, rows=3)
    for got, want in ((x.conj(), a.conj()), (x.conjugate(), a.conjugate())):
        result = got.compute()
        assert result.dtype == want.dtype
        np.testing.assert_array_equal(result, want)


@pytest.mark.parametrize("dtype", ["float64", "float32", "int8"])
def test_dot_with_a_number_multiplies_as_numpys(dtype: str) -> None:
    a = np.array([1.5, -2.0, 4.0]).astype(dtype)
    x = tw.from_array(a, rows=2)
    for got, want in (
        (x.dot(2), a.dot(2)),
        (np.dot(x, 0.5), np.dot(a, 0.5)),
        (np.dot(3, x), np.dot(3, a)),
    ):
        result = got.compute()
        assert result.dtype == want.dtype
        np.testing.assert_array_equal(result, want)
