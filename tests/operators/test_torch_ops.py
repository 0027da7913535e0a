"""torch_ops: elementwise expressions and row-reduction partials with torch, against NumPy."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from tierflow.operators import reductions
from tierflow.operators.elementwise import Input, astype, call, clip, where
from tierflow.operators.fused import FusedKernel
from tierflow.operators.torch_ops import (
    TorchKernel,
    TorchReduction,
    kernel_supported,
    reduction_supported,
)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

X = Input(0)


@pytest.mark.parametrize(
    ("expr", "dtype"),
    [
        (call(np.sqrt, abs(X) * 2.0 + 1), np.float32),
        (X * 2.5, np.int16),  # int16 * weak float: float64, as NumPy says
        (call(np.less, X, 0.5), np.float32),
        (where(call(np.greater, X, 0), X, -X), np.float64),
        (clip(X, -1, 1) - 3, np.int8),
        (astype(X * 10, np.int32) // 3, np.float32),
        (10 - X, np.uint8),
    ],
)
def test_a_kernel_gives_numpys_dtype_and_values(expr: object, dtype: type) -> None:
    block: np.ndarray = (np.random.default_rng(1).normal(size=(50, 4)) * 5).astype(dtype)
    want = FusedKernel(expr, [dtype], [(4,)]).apply(block)  # type: ignore[arg-type]
    assert kernel_supported(expr, [dtype])  # type: ignore[arg-type]
    kernel = TorchKernel(expr, [dtype], [(4,)])  # type: ignore[arg-type]
    got = kernel.apply_tensors(torch.from_numpy(block)).numpy()
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6)
    again = pickle.loads(pickle.dumps(kernel))  # rebuilt from its expression
    np.testing.assert_array_equal(again.apply_tensors(torch.from_numpy(block)).numpy(), got)


def test_what_torch_does_not_do_the_numpy_way_is_not_supported() -> None:
    assert not kernel_supported(call(np.cbrt, X), [np.float32])  # no torch cbrt
    assert not kernel_supported(X * 2, [np.complex64])
    assert not kernel_supported(X + 1, [np.uint32])
    assert not kernel_supported(call(np.add, X, 1, dtype=np.float64), [np.float32])
    assert not kernel_supported(clip(X, -5, 5), [np.uint8])  # -5 would wrap to 251
    assert not kernel_supported(abs(X), [np.bool_])  # torch has no boolean abs
    assert kernel_supported(clip(X, 0, 5), [np.uint8])
    assert not kernel_supported(X // Input(1), [np.int32, np.int32])  # y may hold zeros
    assert not kernel_supported(X ** Input(1), [np.int32, np.int32])  # may be negative
    assert not kernel_supported(call(np.sign, X), [np.float32])  # torch: sign(nan) is 0
    assert kernel_supported(X // 3, [np.int32]) and kernel_supported(
        X // Input(1), [np.float32] * 2
    )
    assert not reduction_supported(reductions.reduction("var", np.float32, (3,), axis=0))
    assert not reduction_supported(reductions.reduction("sum", np.uint32, (3,), axis=0))
    assert reduction_supported(reductions.reduction("sum", np.float32, (3,), axis=0))


@pytest.mark.parametrize(
    "kind", ["sum", "prod", "min", "max", "any", "all", "mean", "count_nonzero"]
)
@pytest.mark.parametrize("axis", [0, None, (0, 2)])
def test_a_partial_has_the_numpy_reductions_format(kind: str, axis: object) -> None:
    block = np.random.default_rng(2).normal(size=(40, 3, 5)).astype(np.float32)
    block[3] = 0  # zeros for count_nonzero, any and all
    op = reductions.reduction(kind, np.float32, (3, 5), axis=axis)  # type: ignore[arg-type]
    assert isinstance(op, reductions.RowReduction)
    want = op.chunk(block)
    got = TorchReduction(op).chunk(torch.from_numpy(block))
    if kind == "mean":
        assert got[0] == want[0]
        got = (got[0], got[1].numpy())
        pairs = [(got[1], want[1])]
    else:
        got = got.numpy()
        pairs = [(got, want)]
    for g, w in pairs:
        assert g.dtype == np.asarray(w).dtype and g.shape == np.shape(w)
        np.testing.assert_allclose(g, w, rtol=1e-6)
    # A partial from torch combines with one from NumPy.
    np.testing.assert_allclose(
        op.aggregate(op.combine(want, got)), op.aggregate(op.combine(want, want)), rtol=1e-6
    )
