"""The comparison's pictures, drawn with matplotlib's object API (no pyplot state, safe off the main thread).

Per rank: ``summary_similarities.png`` (x ``steps``, y ``similarities``, as msprobe draws it) and
``similarity_heatmap.png`` (parameter x step); per parameter ``{param}_similarities.png`` only on request. Both
summary pictures mark the first suspicious step (and the heat map the parameters tripping there) in red.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from msprobe_mlflow.safe_paths import param_file_stem

# The heat map draws at most this many parameters (every one while they fit, else those whose similarity fell
# lowest), each on a labelled row tall enough to read at 100 dpi; similarities.csv holds them all.
MAX_HEATMAP_ROWS = 60
MAX_LABEL_CHARACTERS = 56
MAX_STEP_LABELS = 40
SUSPICIOUS_COLOUR = "tab:red"  # the first suspicious step, on the curve and the heat map
NOISE_COLOUR, NOISE_LABEL = "lightgrey", " (sign noise)"  # a heat-map row whose sign is rounding
_DPI, _ROW_INCHES, _STEP_INCHES, _LABEL_POINTS = 100, 0.24, 0.3, 10


def _save(figure: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


class CurvePlotter:
    """Similarity curves (x ``steps``, y ``similarities``, as msprobe draws them) on one figure reused for every
    curve: redrawing a line is about twice as fast as building a figure per parameter."""

    def __init__(self):
        self.figure = Figure(figsize=(6.4, 4.8), dpi=80)
        FigureCanvasAgg(self.figure)
        self.axes = self.figure.add_subplot()
        (self.line,) = self.axes.plot([], [])
        self.axes.set_xlabel("steps")
        self.axes.set_ylabel("similarities")
        self.axes.xaxis.set_major_locator(MaxNLocator(integer=True))

    def save(self, path: Path, title: str, steps: list[int], values: list[float | None]) -> Path:
        self.line.set_data(steps, [math.nan if v is None else v for v in values])
        self.line.set_marker("o" if len(steps) < 50 else "")
        self.axes.relim()
        self.axes.autoscale_view()
        self.axes.set_title(title)
        _save(self.figure, path)
        return path

    def summary(self, folder: Path, steps: list[int], summary: list[float | None], band: dict[int, float] | None = None,
                suspicious_step: int | None = None) -> Path:
        """The summary curve; with ``band`` (step -> the lowest similarity the rule expected from noise) the band
        shaded, and the first suspicious step marked."""
        extras = []
        if band:
            lows = [band.get(step, math.nan) for step in steps]
            extras.append(self.axes.fill_between(steps, lows, 1.0, color="tab:green", alpha=0.15, step="mid",
                                                 label="expected from noise"))
        if suspicious_step is not None:
            extras.append(self.axes.axvline(suspicious_step, color=SUSPICIOUS_COLOUR, linestyle="--",
                                            label=f"first suspicious step {suspicious_step}"))
        legend = self.axes.legend(loc="lower left") if extras else None
        try:
            return self.save(folder / "summary_similarities.png", "summary_similarities", steps, summary)
        finally:
            for artist in extras + ([legend] if legend else []):
                artist.remove()

    def parameter(self, folder: Path, name: str, steps: list[int], values: list[float | None]) -> Path:
        stem = param_file_stem(name, suffix="_similarities.png")
        return self.save(folder / f"{stem}_similarities.png", f"{name}_similarities", steps, values)


def heatmap_rows(matrix: np.ndarray, limit: int = MAX_HEATMAP_ROWS) -> list[int]:
    """The rows to draw, in model order: all of them up to ``limit``, else the ``limit`` whose lowest similarity is
    lowest (rows never compared last, ties in model order)."""
    if len(matrix) <= limit:
        return list(range(len(matrix)))
    lowest = np.where(np.isnan(matrix), np.inf, matrix).min(axis=1)
    return sorted(np.argsort(lowest, kind="stable")[:limit].tolist())


def _shortened(name: str) -> str:
    """``name``, cut in the middle to ``MAX_LABEL_CHARACTERS`` (the start names the block, the end the tensor)."""
    if len(name) <= MAX_LABEL_CHARACTERS:
        return name
    keep = MAX_LABEL_CHARACTERS - 3
    return f"{name[:keep // 2]}...{name[len(name) - (keep - keep // 2):]}"


def heatmap_figure(names: list[str], steps: list[int], matrix: np.ndarray, suspicious_step: int | None = None,
                   culprits=(), noise=()) -> Figure:
    """``matrix[i, j]``: similarity of ``names[i]`` at ``steps[j]``; NaN cells (not compared) stay blank. The
    ``suspicious_step``'s column is outlined in red, its step label red and bold, and the rows of ``culprits`` (the
    parameters tripping there) have red labels, so the picture says where the verdict points. The rows of
    ``noise`` (parameters whose sign is rounding: their similarity is low from the start and means nothing) are
    greyed over and labelled so, or they would be the most conspicuous thing on it.

    Sized to what it shows: a 0.24-inch row per parameter with 10-point labels, 0.3 inch per step (at most
    ``MAX_STEP_LABELS`` step labels, always the suspicious step's), so 6 parameters and 500 read alike.
    """
    rows = heatmap_rows(matrix)
    labels = [_shortened(names[i]) + (NOISE_LABEL if names[i] in noise else "") for i in rows]
    label_inches = 0.085 * max(map(len, labels), default=0)
    width = min(max(label_inches + 2.5 + _STEP_INCHES * len(steps), 8), 24)
    figure = Figure(figsize=(width, 2.2 + _ROW_INCHES * len(rows)), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    shown = matrix[rows]
    finite = shown[np.isfinite(shown)]
    low = min(0.5, float(finite.min())) if finite.size else 0.5
    image = axes.imshow(np.ma.masked_invalid(shown), aspect="auto", interpolation="nearest", cmap="viridis",
                        vmin=low, vmax=1.0)
    figure.colorbar(image, ax=axes, fraction=0.05, aspect=30).set_label("similarity", fontsize=_LABEL_POINTS)
    marked = steps.index(suspicious_step) if suspicious_step in steps else None
    columns = list(range(len(steps))[::max(1, math.ceil(len(steps) / MAX_STEP_LABELS))])
    if marked is not None and marked not in columns:
        columns = sorted(columns + [marked])
    axes.set_xticks(columns, [str(steps[j]) for j in columns])
    axes.set_yticks(range(len(rows)), labels)
    axes.tick_params(labelsize=_LABEL_POINTS)
    axes.set_xlabel("steps", fontsize=_LABEL_POINTS)
    title = "direction similarity per parameter"
    for position, row in enumerate(rows):
        if names[row] in noise:
            axes.add_patch(Rectangle((-0.5, position - 0.5), len(steps), 1, facecolor=NOISE_COLOUR, alpha=0.85,
                                     edgecolor="none"))
            axes.get_yticklabels()[position].set(color="dimgrey", fontstyle="italic")
    if any(names[row] in noise for row in rows):
        title += " (grey: sign is rounding)"
    if marked is not None:
        axes.add_patch(Rectangle((marked - 0.5, -0.5), 1, len(rows), fill=False, edgecolor=SUSPICIOUS_COLOUR,
                                 linewidth=2.5, clip_on=False))
        axes.get_xticklabels()[columns.index(marked)].set(color=SUSPICIOUS_COLOUR, fontweight="bold")
        for label, row in zip(axes.get_yticklabels(), rows):
            if names[row] in culprits:
                label.set(color=SUSPICIOUS_COLOUR, fontweight="bold")
        title += f" (red: first suspicious step {suspicious_step}" + (", its culprits)" if culprits else ")")
    if len(rows) < len(names):
        title += (f"\nthe {len(rows)} of {len(names)} parameters whose similarity fell lowest, in model order "
                  f"(all in similarities.csv)")
    axes.set_title(title, fontsize=_LABEL_POINTS + 2)
    return figure


def heatmap(folder: Path, names: list[str], steps: list[int], matrix: np.ndarray, suspicious_step: int | None = None,
            culprits=(), noise=()) -> Path:
    """Saves :func:`heatmap_figure` as ``{folder}/similarity_heatmap.png``."""
    path = folder / "similarity_heatmap.png"
    _save(heatmap_figure(names, steps, matrix, suspicious_step, culprits, noise), path)
    return path
