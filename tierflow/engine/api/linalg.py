"""Linear algebra of lazy arrays: ``np.linalg.norm`` (:func:`norm`, through the
registry), and the tall-skinny factorisations of ``(N, k)`` arrays, as ``tw.linalg``:
:func:`qr`, :func:`svd` and :func:`pca`, by TSQR over the row blocks.

How they run::

    pass 1 (now)   R = TSQR(x)             each block's R (LAPACK, float64), merged pairwise
    in memory      Rinv = R^-1, svd(R)     k x k work: R, S and Vh are computed NumPy arrays
    pass 2 (lazy)  Q = x @ Rinv            a block map: Q and U are lazy arrays
                   U = x @ (Rinv @ Ur)

Memory: one block and a few ``k x k`` float64 matrices per worker. ``Q = x R^-1`` loses
orthogonality in proportion to the condition number of ``x`` (about ``1e-16 * cond``),
so it is used only where that is below ``SAFE_CONDITION``. A worse-conditioned ``x`` gets
one more round (CholeskyQR2 with TSQR): ``Q1 = x R^-1`` is persisted (RAM or the SSD),
factored again (``Q1 = Q R1``), and ``Q = Q1 R1^-1``, ``R = R1 R``: orthogonal to
working precision. A rank-deficient ``x`` (condition above ``1 / (1000 eps)``) has no
``Q`` determined by ``R``: asking for Q or U raises LinAlgError; R, S and Vh are given.

Signs follow the usual conventions: ``R``'s diagonal is non-negative (Q's columns
follow), and each row of ``Vh`` has its largest-magnitude entry positive, with U's
columns flipped to match (scikit-learn's ``svd_flip(u_based_decision=False)``, which its
PCA uses). NumPy's own factors may differ from these by signs only.

Each function runs its passes now, with ``options`` as :func:`tierflow.compute` takes
them (``progress=False``, ``executor=``...).

Dtypes: float32 (and float16) data give float32 results, as NumPy gives for float32;
everything else gives float64. Complex data is refused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ...operators import tsqr
from .. import graph
from ..graph import Chunked, Value, specs
from ..graph.specs import Dtypes, Shapes, Values
from . import blockwise, build, dispatch
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = ["PCA", "pca", "qr", "svd"]  # norm: np.linalg.norm, through the registry

SAFE_CONDITION = 1e6  # cond(x) up to which Q = x R^-1 is orthogonal to ~1e-10
SINGULAR_CONDITION = 1.0 / (1000 * np.finfo(np.float64).eps)  # above: rank-deficient


@dataclass(frozen=True)
class TallQRSpec(specs.ReduceSpec):
    """The R factor of a tall-skinny QR (of ``[1 | x]`` when ``with_ones``)."""

    with_ones: bool

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        return tsqr.TallQR(dtypes[0], row_shapes[0], with_ones=self.with_ones)

    def label(self) -> str:
        return "tsqr([1 | x])" if self.with_ones else "tsqr"


def _tall(x: Any, name: str) -> Array:
    array = from_array(x)
    if array.ndim != 2:
        raise ValueError(
            f"{name} takes a 2-D array (N, k); got shape {build.describe_shape(array.shape)}"
        )
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{name} of {array.dtype} data is not supported; compute() first")
    return array


def _result_dtype(dtype: np.dtype) -> np.dtype:
    return (
        np.dtype(np.float32) if dtype.kind == "f" and dtype.itemsize <= 4 else np.dtype(np.float64)
    )


def _r_factor(array: Array, options: dict[str, Any], with_ones: bool = False) -> np.ndarray:
    node = array._node
    if not isinstance(node, Chunked):
        node = from_array(array.compute(**options))._node
    assert isinstance(node, Chunked)
    return np.asarray(build.wrap(graph.Reduce(TallQRSpec(with_ones), (node,))).compute(**options))


def _times(array: Array, w: np.ndarray) -> Array:
    """``array @ w`` in float64: the cast first, so the product is one BLAS call per
    sub-block (NumPy's matmul of float32 by float64 casts in small buffers, without BLAS)."""
    return _cast(array, np.dtype(np.float64)) @ w


def _cast(array: Array, dtype: np.dtype) -> Array:
    return array if array.dtype == dtype else array.astype(dtype)


def _rank_deficient(condition: float, what: str) -> NoReturn:
    raise np.linalg.LinAlgError(
        f"{what}: x is rank-deficient (the condition number of its R factor is "
        f"{condition:.3g}, above {SINGULAR_CONDITION:.3g}), so {what.split('(')[0]}'s "
        "orthonormal factor is not determined by R; R (and S, Vh with compute_uv=False) "
        "are; compute() first for NumPy's factors"
    )


@dataclass(frozen=True)
class _Basis:
    """``Q = rows @ inverse`` with ``R`` the factor: how the orthonormal factor is made."""

    rows: Array
    inverse: np.ndarray
    r: np.ndarray


def _basis(array: Array, r: np.ndarray, what: str, options: dict[str, Any]) -> _Basis:
    """The lazy orthonormal factor of ``array = Q r`` (see the module docstring)."""
    condition = float(np.linalg.cond(r)) if r.size else 1.0
    if not np.isfinite(condition) or condition > SINGULAR_CONDITION:
        _rank_deficient(condition, what)
    inverse = np.linalg.inv(r)
    if condition <= SAFE_CONDITION:
        return _Basis(array, inverse, r)
    first = _times(array, inverse).persist(**options)
    r1 = _r_factor(first, options)
    return _Basis(first, np.linalg.inv(r1), r1 @ r)


def _small(array: Array) -> bool:
    rows, columns = array.shape
    return rows is not None and columns is not None and rows < columns


def _qr_in_memory(array: Array, mode: str, dtype: np.dtype, options: dict[str, Any]) -> Any:
    """NumPy's QR of a short array (fewer rows than columns), signs as :func:`qr`'s."""
    q, r = np.linalg.qr(np.asarray(array.compute(**options), np.float64))
    signs = np.where(np.diagonal(r) < 0, -1.0, 1.0)
    r = (r * signs[:, None]).astype(dtype)
    return r if mode == "r" else (from_array((q * signs).astype(dtype)), r)


def _svd_in_memory(array: Array, compute_uv: bool, dtype: np.dtype, options: dict[str, Any]) -> Any:
    """NumPy's SVD of a short array, signs as :func:`svd`'s."""
    values = np.asarray(array.compute(**options), np.float64)
    if not compute_uv:
        return np.linalg.svd(values, compute_uv=False).astype(dtype)
    u, s, vh = np.linalg.svd(values, full_matrices=False)
    u, vh = _flip(u, vh)
    return from_array(u.astype(dtype)), s.astype(dtype), vh.astype(dtype)


def qr(x: Any, mode: str = "reduced", **options: Any) -> Any:
    """``np.linalg.qr(x, mode)`` of a tall ``(N, k)`` array: ``(Q, R)`` with ``Q`` a lazy
    ``(N, k)`` array and ``R`` a computed ``(k, k)`` NumPy array (R's diagonal
    non-negative); ``mode="r"`` gives R alone. Runs one pass now (R) and Q lazily (see
    the module docstring). Raises LinAlgError for Q of a rank-deficient x."""
    if mode not in ("reduced", "r"):
        raise ValueError(
            f"tw.linalg.qr supports mode='reduced' and mode='r', not {mode!r}: the complete "
            "Q of an (N, k) array is N x N"
        )
    array = _tall(x, "tw.linalg.qr")
    dtype = _result_dtype(array.dtype)
    if _small(array):
        return _qr_in_memory(array, mode, dtype, options)
    r = _r_factor(array, options)
    if mode == "r":
        return r.astype(dtype)
    if len(r) < r.shape[1]:  # fewer rows than columns, known only now (after a mask)
        return _qr_in_memory(array, mode, dtype, options)
    basis = _basis(array, r, "tw.linalg.qr(x)", options)
    q = _cast(_times(basis.rows, basis.inverse), dtype)
    return q, basis.r.astype(dtype)


def _flip(u: np.ndarray, vh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Signs so that each row of ``vh`` has its largest-magnitude entry positive."""
    if not vh.size:
        return u, vh
    biggest = np.argmax(np.abs(vh), axis=1)
    signs = np.sign(vh[np.arange(len(vh)), biggest])
    signs[signs == 0] = 1.0
    return u * signs, vh * signs[:, None]


def svd(
    x: Any,
    full_matrices: bool = True,
    compute_uv: bool = True,
    hermitian: bool = False,
    **options: Any,
) -> Any:
    """``np.linalg.svd(x, full_matrices=False)`` of a tall ``(N, k)`` array: ``(U, S, Vh)``
    with ``U`` a lazy ``(N, k)`` array and ``S``, ``Vh`` computed NumPy arrays; ``S``
    alone with ``compute_uv=False``. Signs: each row of ``Vh`` has its largest-magnitude
    entry positive. ``full_matrices=True`` (NumPy's default) is refused: U would be N x N.
    """
    if hermitian:
        raise ValueError("tw.linalg.svd of a tall array: hermitian=True needs a square matrix")
    array = _tall(x, "tw.linalg.svd")
    if full_matrices and compute_uv:
        raise ValueError(
            f"tw.linalg.svd(x) of an array of shape {build.describe_shape(array.shape)}: the full "
            "U would be N x N; pass full_matrices=False for U of shape (N, k)"
        )
    dtype = _result_dtype(array.dtype)
    if _small(array):
        return _svd_in_memory(array, compute_uv, dtype, options)
    r = _r_factor(array, options)
    if not compute_uv:
        return np.linalg.svd(r, compute_uv=False).astype(dtype)
    if len(r) < r.shape[1]:  # fewer rows than columns, known only now (after a mask)
        return _svd_in_memory(array, compute_uv, dtype, options)
    basis = _basis(array, r, "tw.linalg.svd(x)", options)
    ur, s, vh = np.linalg.svd(basis.r)
    ur, vh = _flip(ur, vh)
    u = _cast(_times(basis.rows, basis.inverse @ ur), dtype)
    return u, s.astype(dtype), vh.astype(dtype)


@dataclass(frozen=True)
class PCA:
    """The principal components of the rows of an ``(N, k)`` array.

    ``components`` ``(n, k)`` (rows of unit length, largest-magnitude entry positive),
    ``explained_variance`` ``(n,)`` (``S**2 / (N - 1)``, as scikit-learn's),
    ``explained_variance_ratio`` (over the variance of all ``k`` components),
    ``singular_values``, the column ``mean`` (float64, whatever the data: a float32 mean
    of data near 1e6 would be off by up to 0.03) and ``n_samples``; ``projection`` is the lazy
    ``(N, n)`` array ``(x - mean) @ components.T``.
    """

    components: np.ndarray
    explained_variance: np.ndarray
    explained_variance_ratio: np.ndarray
    singular_values: np.ndarray
    mean: np.ndarray
    n_samples: int
    projection: Array

    def transform(self, x: Any) -> Array:
        """``(x - mean) @ components.T`` of another array with the same columns (lazy)."""
        array = from_array(x)
        return _cast((array - self.mean) @ self.components.T, self.projection.dtype)


def pca(x: Any, n_components: int | None = None, **options: Any) -> PCA:
    """The first ``n_components`` (default: all ``k``) principal components of the rows
    of ``x`` ``(N, k)``, in one pass: TSQR of ``[1 | x]`` gives the row count, the means
    and the R factor of the centred data (centring by orthogonal transformations, so
    data far from zero loses nothing); its SVD gives the components. The projection is
    lazy. Raises ValueError for fewer than two rows or ``n_components`` outside
    ``1..min(N, k)``."""
    array = _tall(x, "tw.linalg.pca")
    dtype = _result_dtype(array.dtype)
    r = _r_factor(array, options, with_ones=True)
    count = round(float(r[0, 0]) ** 2) if r.size else 0
    k = int(array.shape[1])  # type: ignore[arg-type]
    if count < 2:
        raise ValueError(f"tw.linalg.pca needs at least two rows; x has {count}")
    limit = min(count, k)
    n = limit if n_components is None else int(n_components)
    if not 1 <= n <= limit:
        raise ValueError(
            f"n_components={n_components} must be between 1 and min(N, k) = {limit} for x of "
            f"shape {build.describe_shape(array.shape)}"
        )
    mean = r[0, 1:] / r[0, 0]
    centred_r = np.zeros((k, k))
    centred_r[: len(r) - 1] = r[1:, 1:]  # fewer than k + 1 rows: zero rows, zero values
    _, s, vh = np.linalg.svd(centred_r)
    _, vh = _flip(np.empty((0, len(vh))), vh)
    s = s[:limit]
    variance = s**2 / (count - 1)
    total = variance.sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = variance / total
    components = vh[:n]
    projection = _cast((array - mean) @ components.T, dtype)
    return PCA(
        components=components.astype(dtype),
        explained_variance=variance[:n].astype(dtype),
        explained_variance_ratio=ratio[:n].astype(dtype),
        singular_values=s[:n].astype(dtype),
        mean=mean,
        n_samples=count,
        projection=projection,
    )


# -- np.linalg.norm ---------------------------------------------------------------------


@dispatch.implements(np.linalg.norm)
def norm(x: Any, ord: Any = None, axis: Any = None, keepdims: bool = False) -> Any:
    """``np.linalg.norm(x, ord, axis, keepdims)``: within rows on each block; over the
    rows as sums (``ord`` None, 2, 1, a power, ``'fro'``), maxima or minima (``inf``,
    ``-inf``, matrix ``1``/``-1``/``inf``/``-inf``) and counts (``0``) of the rows.
    Matrix 2-norms and the nuclear norm over the rows need singular values: refused."""
    array = from_array(x)
    node = array._node
    if isinstance(node, Value):
        return blockwise.in_memory(
            np.linalg.norm, "norm", array, ord=ord, axis=axis, keepdims=keepdims
        )
    assert isinstance(node, Chunked)
    ndim = array.ndim
    # NumPy's own errors (the axes, ord for vectors and matrices), on one row of zeros
    dtype = blockwise.numpy_dtype(
        np.linalg.norm, array.dtype, node.row_shape, ord=ord, axis=axis, keepdims=keepdims
    )
    if axis is not None and not isinstance(axis, tuple):
        axis = (operator.index(axis),)
    axes = blockwise.axes(axis, ndim)
    if 0 not in axes:
        return blockwise.on_blocks(
            "norm", np.linalg.norm, [array], ord=ord, axis=axis, keepdims=keepdims
        )
    values = array if array.dtype.kind in "fc" else array.astype(np.float64)
    # NumPy's norm of every value (its square root of re.re + im.im over the raveled x).
    every = ord is None or (ord in ("f", "fro") and ndim == 2) or (ord == 2 and ndim == 1)
    if axis is None and every:
        squares = blockwise.squares(values, by_parts=True).sum(
            axis=None, dtype=np.float64, keepdims=keepdims
        )
        return blockwise.in_memory(
            blockwise.cast_result, "norm", dtype, blockwise.lazy(np.sqrt, squares)
        )
    if len(axes) == 1 or (axis is None and ndim == 1):
        result = _vector_norm(values, ord, axes[0], keepdims)
    elif len(axes) == 2:
        result = _matrix_norm(values, ord, tuple(axis or (0, 1)), keepdims, ndim)
    else:
        raise ValueError("Improper number of dimensions to norm.")
    return blockwise.in_memory(blockwise.cast_result, "norm", dtype, result)


def _vector_norm(values: Array, ord: Any, axis: int, keepdims: bool) -> Array:
    if ord is None or ord == 2:
        return blockwise.lazy(np.sqrt, blockwise.squares(values).sum(axis=axis, keepdims=keepdims))
    if isinstance(ord, str):
        raise ValueError(f"Invalid norm order '{ord}' for vectors")
    magnitude = blockwise.lazy(np.abs, values)
    if ord == np.inf:
        return magnitude.max(axis=axis, keepdims=keepdims, initial=0)
    if ord == -np.inf:
        return magnitude.min(axis=axis, keepdims=keepdims)
    if ord == 0:
        return (values != 0).sum(axis=axis, keepdims=keepdims).astype(np.float64)
    if ord == 1:
        return magnitude.sum(axis=axis, dtype=np.float64, keepdims=keepdims)
    power = float(ord)
    total = (magnitude.astype(np.float64) ** power).sum(axis=axis, keepdims=keepdims)
    return total ** (1.0 / power)


def _matrix_norm(
    values: Array, ord: Any, axis: tuple[int, ...], keepdims: bool, ndim: int
) -> Array:
    row_axis, col_axis = (a % ndim for a in axis)
    if row_axis == col_axis:
        raise ValueError("Duplicate axes given.")
    if ord in (2, -2, "nuc"):
        raise ValueError(
            f"np.linalg.norm(x, ord={ord!r}) over the row axis needs the singular values of "
            "the whole matrix, which one pass over row blocks does not give; use "
            "ord='fro', 1 or inf, or compute() first"
        )
    magnitude = blockwise.lazy(np.abs, values)
    if ord in (None, "fro", "f"):
        result = blockwise.lazy(np.sqrt, blockwise.squares(values).sum(axis=(row_axis, col_axis)))
    elif ord in (1, -1):
        sums = magnitude.sum(axis=row_axis, dtype=np.float64)
        after = col_axis - 1 if col_axis > row_axis else col_axis
        result = sums.max(axis=after, initial=0) if ord == 1 else sums.min(axis=after)
    elif ord in (np.inf, -np.inf):
        sums = magnitude.sum(axis=col_axis, dtype=np.float64)
        after = row_axis - 1 if row_axis > col_axis else row_axis
        result = sums.max(axis=after, initial=0) if ord > 0 else sums.min(axis=after)
    else:
        raise ValueError("Invalid norm order for matrices.")
    if keepdims:
        shape = [1 if i in (row_axis, col_axis) else n for i, n in enumerate(values.shape)]
        result = result.reshape(shape)
    return result
