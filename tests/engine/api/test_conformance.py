"""Conformance: every entry of tierflow's function table against NumPy, over a corpus
of edge cases.

**The table** is read live when the tests are collected (:func:`table`): the NumPy
functions a lazy array answers (``tierflow.engine.api.dispatch.FUNCTIONS``), every ufunc
NumPy exports (``Array.__array_ufunc__`` answers them) and the ufunc reductions of
``REDUCE_UFUNCS``, the methods, properties and Python operators of ``tw.Array``, and
tierflow's own functions (``tw.__all__``, ``tw.linalg.__all__``). Each entry needs a
case in conformance_cases.py: how to call it and how to compare its result. Elementwise
ufuncs, ufunc reductions and Python operators get theirs generically. An entry with
no case fails :func:`test_every_entry_of_the_table_has_a_case`, which says where to
add one; names that are not operations on values (constructors, settings) are listed
in :data:`NOT_COMPARED`, with the reason.

**The corpus** (conformance.py): every numeric dtype, ``bool`` and ``float16``, in both
byte orders; 0, 1 and 23 rows; 1-D, one column and three; blocks of 1 row, 7 rows and
the whole array; no mask, a mask that empties some blocks and one that empties all;
plain values and edge values (NaN, ±inf, -0.0; the integer types' limits).

**The comparison** (:func:`conformance.assert_conforms`, one rule): where NumPy raises,
tierflow raises the same type (or a subclass); where NumPy answers, tierflow gives the
same warning categories, dtypes (byte order aside), shapes and values. Integers and
booleans are exact; floats by the case's :class:`conformance.Rule`: exact for values
moved or picked (sorts, selections, quantiles), within 4 units in the last place for
values computed one by one (ufuncs and operators: NumPy's SIMD and plain loops differ
there), within a tolerance by precision for sums, means, variances and products
(``conformance.tolerance``: tierflow accumulates in float64); NaN in the same places;
the sign of a zero compared where the function decides it.

**Sampling.** The corpus has about 4,000 points and the table about 270 entries, so
each entry gets :data:`SAMPLES` pairs of a point and one of its calls: 8 on the threads
executor, 4 others on the processes executor, one more on each of Dask and Ray (the
``dask_client`` / ``ray_runtime`` session clusters) and 2 on threads with
``jit="eager"`` (every program that has a compiled kernel runs it, whatever its size:
the compiled path against NumPy), drawn by a random generator seeded
by the entry's name: the same tests in every run and in CI, and a new entry's samples
never move another's. A test id names the executor, the entry, the call and the point
(``threads-np.median-axis=0-float32-swapped-23x3-b7-mask_some-edges``); the point alone
rebuilds the input's values. The whole module takes about 110 s on a 2-core machine:
half of it on the clusters, and 45 s on the compiled path (mostly numba compiling each
kernel once).

**make fuzz** (``HYPOTHESIS_PROFILE=fuzz``, ``-m conformance``) draws 20 times as many
samples per entry, from a fresh seed each run (printed in the first line of a failure;
set ``TIERFLOW_CONFORMANCE_SEED`` to replay it). ``TIERFLOW_CONFORMANCE_SEED`` alone
picks another seed for a run of the usual size.

**Known failures** (:data:`KNOWN`): the samples of the seed ``ci`` that fail today,
grouped by cause and by the item of issue 22 that fixes it, each marked
``xfail(strict=True)``: a fix turns its tests into failures (XPASS), which says to
delete them from the table. Under another seed the same causes fail as plain failures.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.api import dispatch
from tierflow.engine.api.dispatch import REFUSED, function_name

from . import conformance_cases as cases
from .conformance import (
    Point,
    assert_conforms,
    draw,
    lazy_operands,
    lazy_outcome,
    numpy_operands,
    numpy_outcome,
)
from common import examples

pytestmark = pytest.mark.conformance

# Worker processes and clusters get the cases' functions by value (tests/ is not on
# their path).
cloudpickle.register_pickle_by_value(cases)
cloudpickle.register_pickle_by_value(sys.modules[__name__.rpartition(".")[0] + ".conformance"])

# Samples per entry: 20 times as many under make fuzz. Worker processes cost about five
# times what threads do per compute, clusters ten times.
SAMPLES = {
    "threads": examples(8),
    "processes": examples(4),
    "clusters": examples(1),
    "jit": examples(2),  # on threads, every kernel compiled and waited for (jit="eager")
}
_FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
SEED = os.environ.get("TIERFLOW_CONFORMANCE_SEED") or (
    str(random.SystemRandom().randrange(2**32)) if _FUZZ else "ci"
)


# -- the table -----------------------------------------------------------------------------

# Names in the table that are not operations on values, and why.
NOT_COMPARED: dict[str, str] = {
    **{
        f"Array.{name}": "the class's own plumbing"
        for name in ("__init__", "__repr__", "__dict__", "__doc__", "__module__", "__weakref__")
    },
    "Array.__hash__": "identity, as for any object",
    "Array.__array_function__": "the dispatch itself: every np.* entry goes through it",
    "Array.__array_ufunc__": "the dispatch itself: every ufunc entry goes through it",
    "Array.__array_priority__": "a number NumPy reads to dispatch",
    "Array.key": "tierflow's cache key, no NumPy counterpart (tests/engine/io/test_cache_keys.py)",
    "Array.blocks": "tierflow's row blocks, no NumPy counterpart (tests/engine/api/test_array.py)",
    "Array.nblocks": "tierflow's row blocks, no NumPy counterpart (tests/engine/api/test_array.py)",
    "Array.chunks": "the row blocks as dask's chunks, no NumPy counterpart (test_methods.py)",
    "np.result_type": "a dtype from dtypes, no values (tests/engine/api/test_functions.py)",
    "tw.store": "writes into the caller's targets, no value (tests/engine/io/test_indexed.py)",
    "Array.cache": "marks a node for the cache, no value (tests/engine/io/test_cache.py)",
    "Array.visualize": "draws the graph, no value (tests/engine/planning/test_plan.py)",
    **{
        f"tw.{name}": "makes the lazy array every case starts from"
        for name in (
            "from_array",
            "from_dask",
            "from_files",
            "from_hdf5",
            "from_npy",
            "from_parquet",
            "from_raw",
            "from_zarr",
        )
    },
    "tw.cache_clear": "a setting of the cache, no value",
    "tw.cache_info": "a report on the cache, no value",
    "tw.use_executor": "chooses the executor each test runs on",
    "tw.profile": "a report on a run, no value (tests/engine/observe/test_profile.py)",
    "tw.last_profile": "a report on a run, no value (tests/engine/observe/test_profile.py)",
}


def ufuncs() -> list[np.ufunc]:
    """Every ufunc NumPy exports, once each (``np.abs`` is ``np.absolute``)."""
    found = {id(u): u for u in vars(np).values() if isinstance(u, np.ufunc)}
    return sorted(found.values(), key=lambda u: u.__name__)


def table() -> dict[str, Any]:
    """Every entry of the function table, by the name its case is registered under."""
    entries: dict[str, Any] = {}
    for fn in dispatch.FUNCTIONS:
        entries[function_name(fn)] = fn
    for u in ufuncs():
        entries[f"np.{u.__name__}"] = u
    for u in dispatch.REDUCTIONS:
        entries[f"np.{u.__name__}.reduce"] = u
    for name in vars(tw.Array):
        if name not in REFUSED and (not name.startswith("_") or name.startswith("__")):
            entries[f"Array.{name}"] = getattr(tw.Array, name)
    for prefix, module in (("tw", tw), ("tw.linalg", tw.linalg)):
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and not isinstance(obj, type):
                entries[f"{prefix}.{name}"] = obj
    return entries


def case_of(name: str, entry: Any) -> cases.Case | None:
    """The case of an entry: its own, or the generic one of a ufunc, a ufunc's
    reduction or a Python operator."""
    if name in cases.CASES:
        return cases.CASES[name]
    if name.endswith(".reduce"):
        return cases.reduce_ufunc_case(entry)
    if isinstance(entry, np.ufunc):
        return cases.ufunc_case(entry)
    if name.startswith("Array.__"):
        return cases.operator_case(name.removeprefix("Array."))
    return None


TABLE = table()
CASES = {name: c for name, entry in TABLE.items() if (c := case_of(name, entry)) is not None}


# -- known failures --------------------------------------------------------------------------


@dataclass(frozen=True)
class Known:
    """Samples that fail today, from one cause: ``item`` of issue 22 that fixes it
    ("-" for a cause outside the issue, left as it is), ``what`` happens instead of
    NumPy's answer, and the samples (``executor:sample id``, as the test id shows them)."""

    item: str
    what: str
    cases: frozenset[str] | set[str]

    def matches(self, sample: Sample, executor: str) -> bool:
        return f"{executor}:{sample.id}" in self.cases


ITEMS = {
    "2": "issue 22 item 2 (byte order)",
    "3": "issue 22 item 3 (zero rows, empty blocks)",
    "4": "issue 22 item 4 (unknown row counts)",
    "5": "issue 22 item 5 (NumPy's argument checks)",
    "-": "outside issue 22",
}

KNOWN: list[Known] = []


# -- the samples -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    entry: str
    label: str
    point: Point
    salt: str  # the executor (or clusters) it was drawn for

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.label.replace(' ', '')}-{self.point.id}"


def samples(entry: str, count: int, salt: str) -> list[Sample]:
    """``count`` distinct (point, call) pairs for ``entry``, drawn by a generator seeded
    by the run's seed, ``salt`` and the entry's name."""
    rng = random.Random(f"{SEED}/{salt}/{entry}")
    found: dict[tuple[str, Point], Sample] = {}
    for _ in range(count * 20):
        if len(found) == count:
            break
        point = draw(rng)
        calls = CASES[entry].calls(point, numpy_operands(point))
        if calls:
            label = rng.choice(calls).label
            found.setdefault((label, point), Sample(entry, label, point, salt))
    return list(found.values())


def params(count: int, salt: str) -> list[Any]:
    return list(_params(count, salt))


def _params(count: int, salt: str) -> Iterator[Any]:
    for entry in sorted(CASES):
        for s in samples(entry, count, salt):
            yield pytest.param(s, id=s.id)


def check(sample: Sample, executor: str, request: pytest.FixtureRequest) -> None:
    """The sample's call on tierflow, run by ``executor``, against the same call on
    NumPy; a known failure (:data:`KNOWN`) is marked to fail, strictly."""
    for k in KNOWN:
        if k.matches(sample, executor):
            reason = f"{ITEMS[k.item]}: {k.what}"
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    case = CASES[sample.entry]
    point = sample.point
    expected_ops = numpy_operands(point)
    (call,) = [c for c in case.calls(point, expected_ops) if c.label == sample.label]
    lazy = lazy_operands(point, f"{sample.salt}/{sample.id}")
    refused = call.refusal(lazy)
    got = lazy_outcome(call, lazy)
    note = f"seed {SEED}: {sample.id}"
    if refused is not None:
        assert isinstance(got.error, refused), (
            f"{note}: documented as refused with {refused.__name__}; tierflow gives "
            f"{got.describe()}"
        )
        return
    want = numpy_outcome(call, expected_ops)
    rule = call.rule or case.rule
    try:
        assert_conforms(got, want, rule, expected_ops)
    except AssertionError as exc:
        raise AssertionError(f"{note}\n{exc}") from exc.__cause__


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.executors("threads")
def test_every_entry_of_the_table_has_a_case() -> None:
    missing = sorted(set(TABLE) - set(CASES) - set(NOT_COMPARED))
    assert not missing, (
        f"no conformance case for {', '.join(missing)}: add one to CASES in "
        "tests/engine/api/conformance_cases.py (how to call it on a lazy array and on NumPy's), "
        "or, for a name that is not an operation on values, to NOT_COMPARED in "
        "tests/engine/api/test_conformance.py with the reason"
    )
    stale = sorted(set(NOT_COMPARED) - set(TABLE))
    assert not stale, f"NOT_COMPARED names what is not in the table: {stale}"


@pytest.mark.executors("threads")
def test_every_known_failure_names_sampled_cases() -> None:
    if SEED != "ci":
        pytest.skip(f"KNOWN names the samples of seed 'ci'; this run draws seed {SEED}'s")
    everything = [
        s for salt, n in SAMPLES.items() for entry in CASES for s in samples(entry, n, salt)
    ]
    executors = {
        "threads": ["threads"],
        "processes": ["processes"],
        "clusters": ["dask", "ray"],
        "jit": ["jit"],
    }
    drawn = {f"{e}:{s.id}" for s in everything for e in executors[s.salt]}
    stale = sorted(case for k in KNOWN for case in k.cases if case not in drawn)
    assert not stale, f"KNOWN names samples that are not drawn (delete them): {stale}"


@pytest.mark.executors("threads")
@pytest.mark.parametrize("sample", params(SAMPLES["threads"], "threads"))
def test_an_entry_on_threads_gives_numpys_answer(
    sample: Sample, executor_name: str, request: pytest.FixtureRequest
) -> None:
    check(sample, executor_name, request)


@pytest.mark.executors("processes")
@pytest.mark.parametrize("sample", params(SAMPLES["processes"], "processes"))
def test_an_entry_on_processes_gives_numpys_answer(
    sample: Sample, executor_name: str, request: pytest.FixtureRequest
) -> None:
    check(sample, executor_name, request)


@pytest.mark.executors("dask", "ray")
@pytest.mark.parametrize("sample", params(SAMPLES["clusters"], "clusters"))
def test_an_entry_on_a_cluster_gives_numpys_answer(
    sample: Sample, executor_name: str, request: pytest.FixtureRequest
) -> None:
    check(sample, executor_name, request)


@pytest.mark.executors("threads")
@pytest.mark.parametrize("sample", params(SAMPLES["jit"], "jit"))
def test_an_entry_with_compiled_kernels_gives_numpys_answer(
    sample: Sample, request: pytest.FixtureRequest
) -> None:
    # Every program that has a kernel runs it, whatever its size: the compiled path
    # against NumPy (the samples above mostly run the NumPy path: they are small).
    pytest.importorskip("numba")
    with tw.config.set(jit="eager"):
        check(sample, "jit", request)
