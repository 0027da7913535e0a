"""What a :class:`~tierflow.engine.observe.profile.Profile` shows: figures, a picture, HTML.

The picture (:func:`plot`, matplotlib) has two panels over one time axis::

    tierflow-worker-0 | ▆▆▆ ▆▆▆▆ ▆▆▆  ▆▆ ...     task stream: one lane per worker,
    tierflow-worker-1 |  ▆▆▆▆ ▆▆▆ ▆▆▆▆ ▆ ...     a rectangle per task, coloured by kind
    ------------------+---------------------
         GB           | ---------------- budget
                      |   ~~~~~~~~ RSS
                      | ▒▒▒▒▒▒▒▒▒▒▒▒▒▒▒▒▒▒    memory by tier (RAM, SSD, GPU stacked);
                      |   [  high  ]          pressure levels as background bands

:func:`html_fragment` is the notebook view (the picture as an inline PNG and the
summary), :func:`save` one HTML file with nothing fetched from the network (the same
picture, the summary, each compute's plan). matplotlib is imported only here, when a
picture is drawn: it is the ``plot`` extra.

:class:`~tierflow.engine.observe.profile.Profile` imports this module when one of its report
methods is called; this module names ``Profile`` for typing only, so neither imports the
other when the package loads.
"""

from __future__ import annotations

import base64
import html
import io
import os
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...config import GB, MB, format_bytes
from ...errors import missing_dependency

if TYPE_CHECKING:
    from .profile import Profile

__all__ = ["KIND_COLOURS", "LEVEL_COLOURS", "Summary", "html_fragment", "plot", "save", "summarize"]

KIND_COLOURS = {
    "block": "#4c72b0",
    "prepare": "#8172b2",
    "append": "#dd8452",
    "commit": "#55a868",
    "assemble": "#937860",
    "finish": "#c44e52",
    "value": "#da8bc3",
}
TIER_COLOURS = {"RAM": "#4c72b0", "SSD": "#dd8452", "GPU": "#55a868"}
LEVEL_COLOURS = {"moderate": "#fff3b0", "high": "#ffd199", "critical": "#ffb3b3"}
DPI = 100


@dataclass(frozen=True)
class Summary:
    """The figures of a profile; sizes in bytes, times in seconds.

    ``seconds``: from the first compute's start to the last one's end; ``stages``: each
    stage's time, from its first task's start to its last task's end, named
    ``"compute N, stage S: <passes>"`` (no ``compute N,`` for a profile of one compute);
    ``bytes_read``: the blocks the tasks read (their projected inputs: source rows and
    held blocks); ``bytes_spilled``: what went to the SSD (arrays placed there, held
    results moved there); ``retries``: operator calls retried on halves after running
    out of memory; ``cache_hits``: blocks, partials and values found in the cache;
    ``peak_held``: the most tierflow held per tier (RAM, SSD, GPU) in any sample;
    ``peak_rss``: this process's; ``peak_workers_rss``: its worker processes' together
    (processes executor); ``busy``: seconds each worker ran tasks."""

    computes: int
    tasks: int
    seconds: float
    stages: dict[str, float]
    bytes_read: int
    bytes_spilled: int
    retries: int
    cache_hits: int
    peak_held: dict[str, int]
    peak_rss: int
    peak_workers_rss: int
    busy: dict[str, float] = field(default_factory=dict)

    def rows(self) -> list[tuple[str, str]]:
        """(name, value) lines, as the HTML table shows them."""
        lines = [
            ("computes", str(self.computes)),
            ("tasks", str(self.tasks)),
            ("time", f"{self.seconds:.3f} s"),
        ]
        lines += [(name, f"{s:.3f} s") for name, s in self.stages.items()]
        lines += [
            ("bytes read", format_bytes(self.bytes_read, 2)),
            ("bytes spilled", format_bytes(self.bytes_spilled, 2)),
            ("retries (halvings)", str(self.retries)),
            ("cache hits", str(self.cache_hits)),
        ]
        lines += [(f"peak held {t}", format_bytes(n, 2)) for t, n in self.peak_held.items()]
        lines.append(("peak RSS", format_bytes(self.peak_rss, 2)))
        if self.peak_workers_rss:
            lines.append(("peak RSS of worker processes", format_bytes(self.peak_workers_rss, 2)))
        return lines


def _stage_names(p: Profile) -> dict[tuple[int, int], str]:
    """``(compute, stage)`` -> its label, naming the passes whose blocks ran in it."""
    passes: dict[tuple[int, int], list[str]] = defaultdict(list)
    by_number = {c.number: c for c in p.computes}
    for t in p.tasks:
        record = by_number.get(t.compute)
        if record is None:
            continue
        key = (t.compute, record.stage_of(t.index))
        if t.kind == "block" and " of " in t.name:
            name = t.name.split(" of ", 1)[1]
            if name not in passes[key]:
                passes[key].append(name)
        else:
            passes.setdefault(key, [])
    many = len(p.computes) > 1
    labels: dict[tuple[int, int], str] = {}
    for (number, stage), names in sorted(passes.items()):
        head = f"compute {number}, stage {stage}" if many else f"stage {stage}"
        labels[(number, stage)] = f"{head}: {', '.join(names)}" if names else f"{head}: values"
    return labels


def summarize(p: Profile) -> Summary:
    """The figures of ``p`` so far (see :class:`Summary`)."""
    tasks = list(p.tasks)
    samples = list(p.samples)
    by_number = {c.number: c for c in p.computes}
    labels = _stage_names(p)
    spans: dict[str, list[float]] = {}
    busy: dict[str, float] = defaultdict(float)
    for t in tasks:
        c = by_number.get(t.compute)
        if c is not None:
            label = labels[(t.compute, c.stage_of(t.index))]
            span = spans.setdefault(label, [t.start, t.end])
            span[0], span[1] = min(span[0], t.start), max(span[1], t.end)
        busy[t.worker] += t.end - t.start
    ended = [c for c in p.computes if c.end > 0]
    seconds = max((c.end for c in ended), default=0.0) - min((c.start for c in ended), default=0.0)
    scheduler_spills = sum(c.spilled_bytes for c in p.computes)
    placed = sum(t.spilled_bytes for t in tasks)
    task_halvings = sum(t.halvings for t in tasks)
    return Summary(
        computes=len(p.computes),
        tasks=len(tasks),
        seconds=seconds,
        stages={k: b - a for k, (a, b) in spans.items()},
        bytes_read=sum(t.inputs for t in tasks if t.kind == "block"),
        # A held result the scheduler moved to the SSD is counted on its task too.
        bytes_spilled=max(placed, scheduler_spills),
        retries=max(task_halvings, sum(c.oom_retries for c in p.computes)),
        cache_hits=sum(t.cache_hits for t in tasks),
        peak_held={
            "RAM": max((s.ram for s in samples), default=0),
            "SSD": max((s.ssd for s in samples), default=0),
            "GPU": max((s.gpu for s in samples), default=0),
        },
        peak_rss=max((s.rss for s in samples), default=0),
        peak_workers_rss=max((s.workers_rss for s in samples), default=0),
        busy=dict(busy),
    )


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise missing_dependency("matplotlib", "plot", "a profile picture") from None
    return matplotlib, Figure


def _lanes(p: Profile) -> list[str]:
    """Workers in the order they first started a task."""
    first: dict[str, float] = {}
    for t in p.tasks:
        if t.worker not in first or t.start < first[t.worker]:
            first[t.worker] = t.start
    return sorted(first, key=lambda w: first[w])


def plot(p: Profile, *, width: float = 10.0) -> Any:
    """The picture of ``p``: a matplotlib ``Figure`` (not shown; no pyplot state).

    Its two axes are the task stream (``figure.axes[0]``: one lane per worker, one
    rectangle per task in a collection with gid ``"tasks"``) and memory
    (``figure.axes[1]``: RAM/SSD/GPU held stacked, the RSS and the budget as lines
    labelled ``"RSS"`` and ``"budget"``, pressure bands with gid ``"pressure"``)."""
    _, figure_class = _matplotlib()
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    tasks = sorted(p.tasks, key=lambda t: t.start)
    samples = list(p.samples)
    lanes = _lanes(p)
    lane_of = {w: k for k, w in enumerate(lanes)}
    # Heights in inches: a lane per worker (at least a panel of 1.2), memory 2.4, and
    # fixed margins for the title and the time axis.
    lanes_in = max(1.2, (0.3 if len(lanes) <= 8 else 0.16) * len(lanes))
    memory_in, above, below, gap = 2.4, 0.4, 0.6, 0.15
    height = lanes_in + memory_in + above + below + gap
    fig = figure_class(figsize=(width, height), dpi=DPI)
    top, bottom = fig.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [lanes_in, memory_in]}
    )
    fig.subplots_adjust(
        left=0.19, right=0.82, top=1 - above / height, bottom=below / height,
        hspace=gap / ((lanes_in + memory_in) / 2),
    )  # fmt: skip

    verts = [
        [(t.start, lane_of[t.worker] - 0.4), (t.start, lane_of[t.worker] + 0.4),
         (t.end, lane_of[t.worker] + 0.4), (t.end, lane_of[t.worker] - 0.4)]
        for t in tasks
    ]  # fmt: skip
    colours = [KIND_COLOURS.get(t.kind, KIND_COLOURS["value"]) for t in tasks]
    bars = PolyCollection(verts, facecolors=colours, edgecolors=colours, linewidths=0.4)
    bars.set_gid("tasks")
    top.add_collection(bars)
    top.set_ylim(-0.6, max(len(lanes), 1) - 0.4)
    top.set_yticks(range(len(lanes)))
    top.set_yticklabels([_short(w) for w in lanes], fontsize=8)
    top.invert_yaxis()
    kinds = [k for k in KIND_COLOURS if any(t.kind == k for t in tasks)]
    top.legend(
        handles=[Patch(color=KIND_COLOURS[k], label=k) for k in kinds],
        loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="task", title_fontsize=8,
    )  # fmt: skip
    top.set_title(_title(p), fontsize=10, loc="left")

    peak = max([s.rss for s in samples] + [s.ram + s.ssd + s.gpu for s in samples] + [1])
    budget = samples[-1].budget if samples else 0
    unit, unit_name = (GB, "GB") if max(peak, budget) >= GB else (MB, "MB")
    times = [s.t for s in samples]
    _pressure_bands(bottom, samples)
    bottom.stackplot(
        times,
        [s.ram / unit for s in samples],
        [s.ssd / unit for s in samples],
        [s.gpu / unit for s in samples],
        labels=["RAM held", "SSD held", "GPU held"],
        colors=[TIER_COLOURS["RAM"], TIER_COLOURS["SSD"], TIER_COLOURS["GPU"]],
        alpha=0.75,
    )
    bottom.plot(times, [s.rss / unit for s in samples], color="black", lw=1.2, label="RSS")
    if any(s.workers_rss for s in samples):
        bottom.plot(
            times, [s.workers_rss / unit for s in samples], color="#555555", lw=1, ls="--",
            label="workers' RSS",
        )  # fmt: skip
    bottom.plot(
        times, [s.budget / unit for s in samples], color="#c44e52", lw=1.5, ls="--",
        label="budget",
    )  # fmt: skip
    bottom.set_ylabel(f"memory ({unit_name})")
    bottom.set_xlabel("seconds")
    bottom.set_ylim(0, max(peak, budget) / unit * 1.1)
    handles, names = bottom.get_legend_handles_labels()
    seen = {s.level for s in samples}  # only the levels that occurred
    handles += [Patch(color=c, label=lvl) for lvl, c in LEVEL_COLOURS.items() if lvl in seen]
    names += [f"pressure {lvl}" for lvl in LEVEL_COLOURS if lvl in seen]
    bottom.legend(handles, names, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    end = max([t.end for t in tasks] + times + [0.0])
    start = min([t.start for t in tasks] + times + [end])
    top.set_xlim(start, end + (end - start) * 0.01 + 1e-3)
    for c in p.computes[1:]:
        for ax in (top, bottom):
            ax.axvline(c.start, color="#999999", lw=0.6, ls=":")
    return fig


def _pressure_bands(ax: Any, samples: list[Any]) -> None:
    """Background bands where the level was above ``ok`` (from one sample to the next)."""
    k = 0
    while k < len(samples):
        level = samples[k].level
        j = k
        while j + 1 < len(samples) and samples[j + 1].level == level:
            j += 1
        if level in LEVEL_COLOURS:
            stop = samples[j + 1].t if j + 1 < len(samples) else samples[j].t
            band = ax.axvspan(samples[k].t, stop, color=LEVEL_COLOURS[level], zorder=0, lw=0)
            band.set_gid("pressure")
        k = j + 1


def _short(worker: str) -> str:
    return worker if len(worker) <= 24 else worker[:11] + "…" + worker[-11:]


def _title(p: Profile) -> str:
    s = summarize(p)
    what = p.computes[0].what if len(p.computes) == 1 else f"{len(p.computes)} computes"
    return (
        f"{what[:60]}: {s.tasks} tasks, {s.seconds:.2f} s, peak RSS {format_bytes(s.peak_rss, 2)}"
    )


def png(p: Profile) -> bytes:
    """The picture of ``p`` as PNG bytes."""
    fig = plot(p)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(k)}</th>"
        f"<td style='text-align:right'>{html.escape(v)}</td></tr>"
        for k, v in rows
    )
    return f"<table class='tierflow-profile-summary'>{body}</table>"


def _img(data: bytes) -> str:
    encoded = base64.b64encode(data).decode("ascii")
    return (
        f"<img id='tierflow-profile-plot' alt='task stream and memory by tier' "
        f"src='data:image/png;base64,{encoded}'>"
    )


def _picture(p: Profile) -> tuple[str, str | None]:
    """The picture as an inline ``<img>``, and None; without matplotlib, a paragraph that
    says why there is none, and that reason."""
    try:
        return _img(png(p)), None
    except ImportError as exc:  # no matplotlib: the figures alone, and why
        reason = str(exc)
        return f"<p id='tierflow-profile-no-plot'>No picture: {html.escape(reason)}</p>", reason


def html_fragment(p: Profile) -> str:
    """The notebook view: the picture (an inline PNG) and the summary table."""
    picture, _ = _picture(p)
    return f"<div class='tierflow-profile'>{picture}{_table(summarize(p).rows())}</div>"


def save(p: Profile, path: Any) -> str:
    """Write ``p`` as one self-contained HTML file at ``path``; its absolute path.

    Without matplotlib the file has the figures and the plans but no picture; it says
    why, and so does a :class:`UserWarning`."""
    path = os.path.abspath(os.fspath(path))
    picture, missing = _picture(p)
    plans = "".join(
        f"<h3>compute {c.number}: {html.escape(c.what)}</h3>"
        f"<p>{html.escape(c.executor)} executor, {c.workers} worker(s), budget "
        f"{html.escape(format_bytes(c.budget, 2))}, {c.end - c.start:.3f} s"
        + (f", <b>failed</b>: {html.escape(c.error)}" if c.error else "")
        + f"</p><pre>{html.escape(c.plan)}</pre>"
        for c in p.computes
    )
    document = (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>tierflow profile</title>"
        "<style>body{margin:0;font-family:sans-serif;background:#fff;color:#222}"
        "img{display:block}main,body>p{padding:8px 16px}pre{font-size:12px;background:#f6f6f6;"
        "padding:6px;overflow-x:auto}</style></head><body>"
        f"{picture}<main><h2>Summary</h2>{_table(summarize(p).rows())}"
        f"<h2>Plans</h2>{plans}</main></body></html>\n"
    )
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(document)
    os.replace(tmp, path)
    if missing is not None:
        warnings.warn(f"the profile at {path} has no picture: {missing}", stacklevel=3)
    return path
