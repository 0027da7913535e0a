"""The import rule: no import cycle inside the package, and no module importing another
module's private name (a ``_name`` that is not a module).

Both are read from grimp's import graph, the one import-linter checks the layering on
(``make lint``, ``[tool.importlinter]`` in pyproject.toml). Imports made only under
``TYPE_CHECKING`` are left out; imports inside functions count, since they run as soon
as the function does.
"""

from __future__ import annotations

import ast
import importlib.util
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest


def import_graph(package: str) -> grimp.ImportGraph:
    """The package's imports, those under ``TYPE_CHECKING`` left out (no cache on disk)."""
    return grimp.build_graph(package, exclude_type_checking_imports=True, cache_dir=None)


def strongly_connected(graph: grimp.ImportGraph) -> list[set[str]]:
    """The import cycles: each group of two or more modules that all reach each other
    through imports (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(module: str) -> Iterator[str]:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        return iter(sorted(graph.find_modules_directly_imported_by(module)))

    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, visit(root))]
        while work:
            module, imported = work[-1]
            for other in imported:
                if other not in index:
                    work.append((other, visit(other)))
                    break
                if other in on_stack:
                    low[module] = min(low[module], index[other])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    found.append(_pop_component(module, stack, on_stack))
    return [component for component in found if len(component) > 1]


def _pop_component(module: str, stack: list[str], on_stack: set[str]) -> set[str]:
    component: set[str] = set()
    while True:
        other = stack.pop()
        on_stack.discard(other)
        component.add(other)
        if other == module:
            return component


def cycle_chain(graph: grimp.ImportGraph, component: set[str]) -> list[str]:
    """A chain of imports that starts and ends at the component's first module and
    passes through every module of it; each arrow is one direct import."""
    start = min(component)
    chain = [start]
    left = component - {start}
    while left:
        steps = [graph.find_shortest_chain(importer=chain[-1], imported=m) for m in sorted(left)]
        nearest = min((s for s in steps if s is not None), key=len)
        chain.extend(nearest[1:])
        left -= set(nearest)
    back = graph.find_shortest_chain(importer=chain[-1], imported=start)
    assert back is not None
    chain.extend(back[1:])
    return chain


def import_cycles(graph: grimp.ImportGraph) -> list[str]:
    """Each import cycle as ``a -> b -> ... -> a``, through every module of it."""
    chains = [cycle_chain(graph, c) for c in strongly_connected(graph)]
    return sorted(" -> ".join(chain) for chain in chains)


def private_name_imports(graph: grimp.ImportGraph, package: str) -> list[str]:
    """Each import of another module's private name, as ``importer <- module._name``.

    Only the import statements in the graph count (so not those under
    ``TYPE_CHECKING``); importing a private *module* (``from . import _blocks``) is not
    a private name.
    """
    found = []
    for importer in sorted(graph.modules):
        lines = {
            detail["line_number"]
            for imported in graph.find_modules_directly_imported_by(importer)
            for detail in graph.get_import_details(importer=importer, imported=imported)
        }
        path = _source_of(importer)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.lineno in lines:
                found += _private_names(graph, importer, path, node, package)
    return found


def _private_names(
    graph: grimp.ImportGraph, importer: str, path: Path, node: ast.ImportFrom, package: str
) -> list[str]:
    parent = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    source = importlib.util.resolve_name("." * node.level + (node.module or ""), parent)
    if source != package and not source.startswith(package + "."):
        return []
    return [
        f"{importer} <- {source}.{alias.name}"
        for alias in node.names
        if alias.name.startswith("_")
        and not alias.name.startswith("__")
        and f"{source}.{alias.name}" not in graph.modules
        and source != importer
    ]


def _source_of(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin)


@pytest.fixture(scope="module")
def tierflow_graph() -> grimp.ImportGraph:
    return import_graph("tierflow")


def test_the_package_has_no_import_cycle(tierflow_graph: grimp.ImportGraph) -> None:
    cycles = import_cycles(tierflow_graph)
    assert not cycles, "import cycles (imports under TYPE_CHECKING left out):\n" + "\n".join(
        f"  {cycle}" for cycle in cycles
    )


def test_no_module_imports_another_modules_private_name(
    tierflow_graph: grimp.ImportGraph,
) -> None:
    found = private_name_imports(tierflow_graph, "tierflow")
    assert not found, "imports of another module's private name:\n" + "\n".join(
        f"  {line}" for line in found
    )


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> grimp.ImportGraph:
    """A small package with one real cycle (a function-local import closes it), one
    cycle only under TYPE_CHECKING, and private names imported three ways."""
    files = {
        "__init__.py": "",
        "a.py": "from .b import B\n\n\ndef _helper():\n    pass\n",
        "b.py": "B = 1\n\n\ndef late():\n    from .c import C\n",
        "c.py": "from toy_imports.a import _helper\n\nC = 2\n",
        "d.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
            "    from .e import _E\n\nfrom . import _private\n"
        ),
        "e.py": "from .d import _private as P\n\n_E = 3\n",
        "_private.py": "",
    }
    root = tmp_path / "toy_imports"
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    return import_graph("toy_imports")


def test_a_function_local_import_that_closes_a_circle_is_a_cycle(
    toy: grimp.ImportGraph,
) -> None:
    assert import_cycles(toy) == [
        "toy_imports.a -> toy_imports.b -> toy_imports.c -> toy_imports.a"
    ]


def test_private_names_are_found_but_not_private_modules_nor_typing_only_imports(
    toy: grimp.ImportGraph,
) -> None:
    assert private_name_imports(toy, "toy_imports") == [
        "toy_imports.c <- toy_imports.a._helper",
        "toy_imports.e <- toy_imports.d._private",
    ]
