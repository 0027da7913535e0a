"""docs/engine.md lists every NumPy function a lazy array answers, and no other."""

from __future__ import annotations

import re
from pathlib import Path

from tierflow.engine.api import dispatch

ENGINE_MD = Path(__file__).resolve().parents[1] / "docs" / "engine.md"


def _public_name(fn: object) -> str:
    module = getattr(fn, "__module__", "") or ""
    prefix = "np.linalg." if module.endswith("linalg") else "np."
    return prefix + getattr(fn, "__name__", "")


def _table() -> str:
    text = ENGINE_MD.read_text()
    start = text.index("### Every NumPy function a lazy array answers")
    return text[start : text.index("\n### ", start + 1)]


def test_every_lazy_numpy_function_is_in_the_table_of_engine_md() -> None:
    first_cells = [line.split("|")[1] for line in _table().splitlines() if line.startswith("| ")]
    listed = set(re.findall(r"`(np\.[a-z_.]+)`", "".join(first_cells)))
    answered = {_public_name(fn) for fn in dispatch.FUNCTIONS}
    assert answered - listed == set(), "add these to the table in docs/engine.md"
    assert listed - answered == set(), "the table names functions that are not lazy"
