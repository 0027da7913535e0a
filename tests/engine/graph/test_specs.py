"""Specs as value objects: every field of every spec reaches the node's key.

The specs are found, not listed: every subclass of
:class:`~tierflow.engine.graph.keyed.Keyed` in the engine, and every class of the engine
named ``...Spec``. Each has two samples in :data:`SAMPLES` that differ in every field;
changing one field of the first to the second's value must change the key, unless the
field is declared not part of it and is listed in :data:`NOT_KEY_FIELDS`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pickle
import pkgutil
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import numpy as np
import pytest

import tierflow.engine
from tierflow.engine import graph
from tierflow.engine.api import blockwise, linalg, products
from tierflow.engine.graph import specs
from tierflow.engine.graph.keyed import Keyed, key_parts
from tierflow.engine.planning import counting
from tierflow.engine.rowwide import external_sort, frequencies, overlap, quantiles, scans, topk
from tierflow.operators import reductions
from tierflow.operators.order_stats import Limits
from tierflow.storage import identity

pytestmark = pytest.mark.executors("threads")  # nothing runs: keys only

# Fields whose value does not change what the operator computes.
NOT_KEY_FIELDS = {
    ("MapSpec", "device"),  # the result is the same wherever it runs
    ("CountSpec", "what"),  # the name of the counted node, for the label
    ("RunsSpec", "files"),  # the run files of one compute
    ("Rule", "out_dtype"),  # made from the rule's other fields
    ("Rule", "out_shape"),
}


def _double(block: np.ndarray) -> np.ndarray:
    return block * 2


def _triple(block: np.ndarray) -> np.ndarray:
    return block * 3


def _first(a: Any, b: Any) -> Any:
    return a


def _rule(**changes: Any) -> quantiles.Rule:
    fields = {
        "function": "quantile", "q": np.array([0.5]), "weak_q": False, "method": "linear",
        "flat": False, "keepdims": False, "dtype": np.dtype("f8"), "row_shape": (3,),
        "out_dtype": np.dtype("f8"), "out_shape": (1, 3),
    }  # fmt: skip
    return quantiles.Rule(**{**fields, **changes})


def _samples() -> dict[type, tuple[Any, Any]]:
    """Two instances of each keyed class, differing in every field."""
    sum_rows = specs.ReduceOptions("sum", 0, False, None, 0)
    mean_columns = specs.ReduceOptions("mean", (0, 1), True, np.dtype("f4"), 1, initial=5)
    user = reductions.ReductionOptions()
    user_other = reductions.ReductionOptions(
        with_offset=True, n_inputs=2, commutative=False, out_dtype=np.dtype("f4"),
        out_shape=(2,), partial_bytes=64, temp_bytes=lambda rows: rows, name="total",
    )  # fmt: skip
    sorting = external_sort.Sorting("values")
    sorting_other = external_sort.Sorting("rows", (1,), True, (3,))
    pairs = [
        (specs.Spec(), specs.Spec()),
        (specs.ReduceSpec(), specs.ReduceSpec()),
        (specs.CollectSpec(), specs.CollectSpec()),
        (specs.RowwiseSpec(sum_rows), specs.RowwiseSpec(mean_columns)),
        (specs.KindSpec(sum_rows), specs.KindSpec(mean_columns)),
        (specs.MatmulSpec(np.ones((3, 2))), specs.MatmulSpec(None)),
        (specs.IndexSpec((slice(None), 1)), specs.IndexSpec((Ellipsis, 2))),
        (
            specs.MapSpec(_double, np.dtype("f8"), (3,), None, {}),
            specs.MapSpec(_triple, np.dtype("f4"), (2,), "cuda:0", {"scale": 2}),
        ),
        (
            specs.AlongAxisSpec("sort", 1, {}),
            specs.AlongAxisSpec("cumsum", 2, {"dtype": "f4"}),
        ),
        (specs.ReshapeSpec((6,)), specs.ReshapeSpec((2, 3))),
        (specs.StackSpec(np.concatenate, 1), specs.StackSpec(np.stack, 2)),
        (
            specs.UfuncOutSpec(np.divmod, 0, {}, ()),
            specs.UfuncOutSpec(np.modf, 1, {"dtype": "f4"}, (None, specs.VALUE)),
        ),
        (specs.HistogramSpec(10, None, False), specs.HistogramSpec(5, (0.0, 1.0), True)),
        (
            specs.UserSpec(_double, np.add, None, user),
            specs.UserSpec(_triple, _first, _double, user_other),
        ),
        (specs.ContractSpec(np.ones(3), "right"), specs.ContractSpec(None, "left")),
        (specs.HeadSpec(5), specs.HeadSpec(7)),
        (products.CrossSpec(False), products.CrossSpec(True)),
        (products.CoMomentSpec(1, None), products.CoMomentSpec(0, np.dtype("f4"))),
        (quantiles.StatsSpec(False), quantiles.StatsSpec(True)),
        (
            quantiles.NarrowSpec(_rule(), 1, Limits(1024, 2048)),
            quantiles.NarrowSpec(
                _rule(
                    function="nanmedian",
                    q=None,
                    weak_q=True,
                    method="nearest",
                    flat=True,
                    keepdims=True,
                    dtype=np.dtype("f4"),
                    row_shape=(2,),
                    out_dtype=np.dtype("f4"),
                    out_shape=(2,),
                ),
                2,
                Limits(4096, 8192),
            ),
        ),
        (
            blockwise.BlockFunctionSpec("clip", np.clip, {}, (None, 0, 1)),
            blockwise.BlockFunctionSpec("where", np.where, {"out": None}, (None, specs.VALUE)),
        ),
        (linalg.TallQRSpec(False), linalg.TallQRSpec(True)),
        (frequencies.UniqueSpec(False, False, False), frequencies.UniqueSpec(True, True, True)),
        (frequencies.InverseSpec(False), frequencies.InverseSpec(True)),
        (frequencies.BincountSpec(False, 0), frequencies.BincountSpec(True, 4)),
        (topk.TopKSpec(2), topk.TopKSpec(3)),
        (
            counting.CountSpec("rows", (0, 2, 4), 2, "x"),
            counting.CountSpec("nonzero", None, 3, "mask"),
        ),
        (
            external_sort.RunsSpec(sorting, external_sort.RunFiles()),
            external_sort.RunsSpec(sorting_other, external_sort.RunFiles("runs")),
        ),
        (sorting, sorting_other),
        (scans.Scanning("cumsum", "<f8"), scans.Scanning("ffill", "<f4", 3)),
        (
            scans.UserScan(np.cumsum, np.add, 0, None, "<f8"),
            scans.UserScan(np.cumprod, np.multiply, 1, _first, "<f4"),
        ),
        (
            scans.CarriesSpec(scans.Scanning("cumsum", "<f8")),
            scans.CarriesSpec(scans.Scanning("bfill", "<f4", 2)),
        ),
        (overlap.Halo(1, 2), overlap.Halo(3, 4, "constant", 0.5)),
        (
            graph.ElemOp("ufunc", ufunc=np.add),
            graph.ElemOp(
                "astype",
                ufunc=np.subtract,
                kwargs={"dtype": "f4"},
                dtype="f4",
                decimals=2,
                has_lo=False,
                has_hi=False,
            ),
        ),
    ]
    return {type(a): (a, b) for a, b in pairs}


SAMPLES = _samples()


def _engine_classes() -> Iterator[type]:
    """Every class defined in a module of :mod:`tierflow.engine`."""
    for info in pkgutil.walk_packages(tierflow.engine.__path__, "tierflow.engine."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name:
                yield cls


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    return found.union(*(_subclasses(c) for c in found))


def _variants(a: Any, b: Any) -> Iterator[tuple[str, str, Any, Any, Any, bool]]:
    """``(class, field, a's value, b's value, a with b's value, whether it is part of
    the key)`` for each field of ``a``, and each field of a dataclass it holds."""
    for f in dataclasses.fields(a):
        mine, theirs = getattr(a, f.name), getattr(b, f.name)
        is_key = f.metadata.get("key", True)
        changed = dataclasses.replace(a, **{f.name: theirs})
        yield type(a).__qualname__, f.name, mine, theirs, changed, is_key
        if dataclasses.is_dataclass(mine) and type(mine) is type(theirs):
            for owner, name, x, y, inner, inner_key in _variants(mine, theirs):
                outer = dataclasses.replace(a, **{f.name: inner})
                yield owner, name, x, y, outer, is_key and inner_key


def _field_token(value: Any) -> str:
    return identity.token(key_parts(value) if dataclasses.is_dataclass(value) else value)


def test_every_keyed_class_of_the_engine_has_samples() -> None:
    in_engine = set(_engine_classes())  # imports every module: no subclass is missed
    found = _subclasses(Keyed) & in_engine
    assert found == set(SAMPLES), (
        f"give each keyed class two samples in SAMPLES: missing "
        f"{sorted(c.__qualname__ for c in found - set(SAMPLES))}"
    )


def test_every_spec_of_the_engine_is_a_frozen_keyed_dataclass() -> None:
    named = [c for c in _engine_classes() if c.__name__.endswith("Spec")]
    assert len(named) >= 25
    for cls in named:
        assert issubclass(cls, Keyed), f"{cls.__qualname__} is not a Keyed value object"
        assert cls.__dataclass_params__.frozen, f"{cls.__qualname__} is not frozen"


def test_no_keyed_class_writes_its_own_key() -> None:
    for cls in SAMPLES:
        assert "params" not in vars(cls), f"{cls.__qualname__}.params bypasses the fields"


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__qualname__)
def test_changing_any_key_field_changes_the_key(cls: type) -> None:
    a, b = SAMPLES[cls]
    for owner, name, mine, theirs, changed, is_key in _variants(a, b):
        path = f"{cls.__qualname__}: {owner}.{name}"
        assert _field_token(mine) != _field_token(theirs), (
            f"{path}: both samples hold the same value; give the second another one"
        )
        if is_key:
            assert changed.params() != a.params(), f"{path} does not reach the key"
        else:
            assert (owner, name) in NOT_KEY_FIELDS, f"{path} is left out of the key"
            assert changed.params() == a.params(), f"{path} is declared not in the key"


def test_map_blocks_on_another_device_has_the_same_key() -> None:
    a = specs.MapSpec(_double, np.dtype("f8"), (3,), None, {})
    assert dataclasses.replace(a, device="cuda:0").params() == a.params()


def test_a_field_at_its_default_stays_out_of_the_key() -> None:
    given = specs.KindSpec(specs.ReduceOptions("sum", 0, False, None, 0, initial=0))
    default = specs.KindSpec(specs.ReduceOptions("sum", 0, False, None, 0))
    (_, ((_, (_, options)),)) = key_parts(default)
    assert "initial" not in dict(options)
    assert "initial" in dict(key_parts(given)[1][0][1][1])
    assert given.params() != default.params()


def test_specs_of_two_kinds_with_equal_fields_have_different_keys() -> None:
    assert products.CrossSpec(True).params() != linalg.TallQRSpec(True).params()
    assert frequencies.InverseSpec(True).params() != quantiles.StatsSpec(True).params()


def test_specs_are_frozen() -> None:
    spec = topk.TopKSpec(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.k = 4  # type: ignore[misc]


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps])
def test_the_value_marker_of_a_template_arrives_as_itself(dumps: Callable[[Any], bytes]) -> None:
    assert pickle.loads(dumps(specs.VALUE)) is specs.VALUE


def test_a_user_reduction_spec_travels_with_its_functions_by_value() -> None:
    shared = lambda a, b: a + b  # noqa: E731
    spec = specs.UserSpec(lambda b: b.sum(), shared, shared, reductions.ReductionOptions())
    back = pickle.loads(pickle.dumps(spec))
    assert back.combine is back.aggregate
    assert back.params() == spec.params()
