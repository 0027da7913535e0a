"""The notebooks in ``examples/`` run in a real Jupyter kernel and show what they promise.

Each notebook is executed with nbclient in an ipykernel (the ``python3`` kernel of this
interpreter), its cell tagged ``parameters`` replaced by small sizes, with ``TMPDIR``
pointed at an empty folder. The outputs are checked: no error, the HTML view of a lazy
array, the progress bar as a Jupyter widget, and values against NumPy. The committed
notebooks carry no outputs.
"""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs nbformat (the test extra)")
nbclient = pytest.importorskip("nbclient", reason="needs nbclient (the test extra)")
pytest.importorskip("ipykernel", reason="needs ipykernel (the test extra)")
pytest.importorskip("ipywidgets", reason="needs ipywidgets: tqdm.auto draws its bar with it")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
WIDGET = "application/vnd.jupyter.widget-view+json"
ROWS = 200_000


def _outputs(nb: Any) -> list[dict[str, Any]]:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]


def _cell(nb: Any, starts: str) -> int:
    """The index of the code cell whose source starts with ``starts``."""
    found = [
        k for k, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.startswith(starts)
    ]
    assert len(found) == 1, f"{len(found)} code cells start with {starts!r}"
    return found[0]


def _run(nb: Any, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Execute ``nb`` in place in a kernel of this interpreter, importing this checkout's
    tierflow, with TMPDIR at ``folder``."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TMPDIR", str(folder))
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=240,
        resources={"metadata": {"path": str(EXAMPLES)}},
    )
    client.execute()


@pytest.fixture(scope="module")
def committed() -> Any:
    return nbformat.read(EXAMPLES / "explore.ipynb", as_version=4)


def test_the_committed_notebook_has_no_outputs(committed: Any) -> None:
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert code
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert (EXAMPLES / "explore.ipynb").stat().st_size < 20_000


def test_explore_notebook_runs_in_a_kernel_and_shows_tables_widgets_and_right_values(
    committed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nb = nbformat.from_dict(json.loads(json.dumps(committed)))  # a copy to execute
    (parameters,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    parameters.source = f'ROWS = {ROWS}\nBUDGET = "8MB"\nFOLDER = None\n'
    # NumPy's histogram of the same column, beside tierflow's, printed by the kernel.
    at = _cell(nb, "lazy_counts, edges = np.histogram(")
    check = (
        "import json\n"
        "column = np.load(path)[:, 1]\n"
        "expected, expected_edges = np.histogram(column, bins=12, range=(float(lo[1]), float(hi[1])))\n"
        "print(json.dumps({'tierflow': counts.tolist(), 'numpy': expected.tolist(),\n"
        "                  'edges': bool(np.array_equal(edges, expected_edges))}))\n"
    )
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(check))
    temp = tmp_path / "tmp"
    temp.mkdir()

    _run(nb, temp, monkeypatch)

    outputs = _outputs(nb)
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, "\n".join(f"{e.ename}: {e.evalue}" for e in errors)
    # The lazy array's view: an HTML table holding its shape.
    x_cell = nb.cells[_cell(nb, "x = tw.from_npy(path)")]
    html = [o.data["text/html"] for o in x_cell.outputs if "text/html" in o.get("data", {})]
    assert html and f"({ROWS}, 8)" in html[0]
    masked = nb.cells[_cell(nb, "positive = x[x[:, 0] > 0]")]
    assert any("(?, 8)" in o.get("data", {}).get("text/html", "") for o in masked.outputs)
    # The progress bar of the long compute: a widget, not text.
    bar_cell = nb.cells[_cell(nb, "standardised = (x - mean) / std")]
    assert any(WIDGET in o.get("data", {}) for o in bar_cell.outputs), bar_cell.outputs
    # The histogram against NumPy's.
    printed = "".join(o.text for o in nb.cells[at + 1].outputs if o.output_type == "stream")
    values = json.loads(printed)
    assert values["tierflow"] == values["numpy"]
    assert sum(values["tierflow"]) == ROWS
    assert values["edges"] is True
    # argmax found the planted spike.
    argmax = nb.cells[_cell(nb, "where = int(x[:, SPIKE_COLUMN].argmax()")]
    text = "".join(o.text for o in argmax.outputs if o.output_type == "stream")
    found, planted = text.split("(the spike was planted at row ")
    assert found.removeprefix("row ").strip() == planted.split(")")[0]
    # The profile: a picture of the task stream and memory (a PNG with pixels that are
    # not background), with its summary table, and the summary's figures.
    profile_cell = nb.cells[_cell(nb, "with tw.profile() as p:")]
    (view,) = [
        o.data["text/html"] for o in profile_cell.outputs if "text/html" in o.get("data", {})
    ]
    assert "tierflow-profile" in view and "<table" in view
    picture = base64.b64decode(view.split("data:image/png;base64,")[1].split("'")[0].split('"')[0])
    import matplotlib.image

    pixels = matplotlib.image.imread(io.BytesIO(picture), format="png")
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert (pixels[..., :3] < 0.9).any(axis=-1).mean() > 0.02  # drawn, not a blank image
    summary = nb.cells[_cell(nb, "p.summary()")]
    assert any(o.get("data") for o in summary.outputs)
    # memory.status() as a table; everything made in TMPDIR is gone.
    status = nb.cells[_cell(nb, "memory.status()")]
    assert any("<table" in o.get("data", {}).get("text/html", "") for o in status.outputs)
    assert list(temp.iterdir()) == []
