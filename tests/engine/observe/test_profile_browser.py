"""The saved profile report, opened in a real browser: both panels are drawn.

Headless Chromium (Debian's ``chromium``; ``make test`` installs it where it is missing
and it runs as root) takes a screenshot of the saved HTML file; the test finds each
panel where the figure's layout puts it and checks what was drawn there: the task
rectangles in the task stream, the budget and RSS lines in the memory panel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.observe.report import DPI, KIND_COLOURS

pytestmark = [pytest.mark.slow, pytest.mark.executors("threads")]


def chromium() -> str:
    for candidate in (
        "/usr/bin/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.skip(
        "no chromium here: `make test` installs Debian's chromium when run as root "
        "(apt-get install -y chromium)"
    )


def rgb(colour: str) -> np.ndarray:
    return np.array([int(colour[k : k + 2], 16) for k in (1, 3, 5)], dtype=float)


def near(pixels: np.ndarray, colour: str, tolerance: float = 12) -> int:
    """How many pixels are within ``tolerance`` (per channel, 0-255) of ``colour``."""
    return int((np.abs(pixels - rgb(colour)).max(axis=-1) <= tolerance).sum())


def test_saved_report_shows_both_panels_in_chromium(tmp_path: Path) -> None:
    browser = chromium()
    tw.memory.budget("64MB")
    data = np.random.default_rng(0).uniform(size=(400_000, 4)).astype("float32")
    x = tw.from_array(data, rows=25_000)
    with tw.profile() as p:
        mean, std = tw.compute(x.mean(axis=0), x.std(axis=0))
        ((x - mean) / std).to_npy(tmp_path / "z.npy")
    page = p.save(tmp_path / "run.html")
    fig = p.plot()  # the same layout the saved picture has
    width, height = (round(float(v) * DPI) for v in fig.get_size_inches())

    shot = tmp_path / "shot.png"
    result = subprocess.run(
        [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--force-device-scale-factor=1", f"--screenshot={shot}",
            f"--window-size={width},{height + 200}", Path(page).as_uri(),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shot.exists(), result.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))[..., :3] * 255.0
    assert pixels.shape[1] == width

    def panel(k: int) -> np.ndarray:
        """The inside of axes ``k`` on the screenshot (the image sits at the top left),
        a few pixels in from its frame."""
        box = fig.axes[k].get_position()
        left, right = int(box.x0 * width) + 3, int(box.x1 * width) - 3
        top, bottom = int((1 - box.y1) * height) + 3, int((1 - box.y0) * height) - 3
        return pixels[top:bottom, left:right]

    tasks, memory = panel(0), panel(1)
    background = (pixels > 250).all(axis=-1)
    assert background[: height // 50].mean() > 0.9  # the page itself is white above the plot
    # The task stream: a block rectangle per block task, in the block colour.
    blocks = sum(t.kind == "block" for t in p.tasks)
    assert blocks >= 32
    assert near(tasks, KIND_COLOURS["block"]) > 200
    # The memory panel: the budget line (dashed red) and the RSS line (black).
    assert near(memory, "#c44e52", 40) > 50
    assert near(memory, "#000000", 60) > 50
    # Outside the panels, right of the legends: nothing drawn.
    assert (pixels[height // 2 : height - 10, width - 8 :] > 250).all()
