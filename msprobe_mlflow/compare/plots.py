"""The comparison's pictures, drawn with matplotlib's object API (no pyplot state, safe off the main thread).

Per rank: ``summary_similarities.png`` (x ``steps``, y ``similarities``, as msprobe draws it) and
``similarity_heatmap.png`` (parameter x step); per parameter ``{param}_similarities.png`` only on request.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from msprobe_mlflow.safe_paths import param_file_stem

# Above this many parameters the heat map keeps its rows but drops their labels (they would overlap).
MAX_LABELLED_ROWS = 80


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

    def summary(self, folder: Path, steps: list[int], summary: list[float | None]) -> Path:
        return self.save(folder / "summary_similarities.png", "summary_similarities", steps, summary)

    def parameter(self, folder: Path, name: str, steps: list[int], values: list[float | None]) -> Path:
        stem = param_file_stem(name, suffix="_similarities.png")
        return self.save(folder / f"{stem}_similarities.png", f"{name}_similarities", steps, values)


def heatmap(folder: Path, names: list[str], steps: list[int], matrix: np.ndarray) -> Path:
    """``matrix[i, j]``: similarity of ``names[i]`` at ``steps[j]``; NaN cells (not compared) stay blank."""
    path = folder / "similarity_heatmap.png"
    height = min(3 + 0.18 * min(len(names), MAX_LABELLED_ROWS), 20)
    width = min(6 + 0.15 * len(steps), 20)
    figure = Figure(figsize=(width, height), dpi=80, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    finite = matrix[np.isfinite(matrix)]
    low = min(0.5, float(finite.min())) if finite.size else 0.5
    image = axes.imshow(np.ma.masked_invalid(matrix), aspect="auto", interpolation="nearest", cmap="viridis",
                        vmin=low, vmax=1.0)
    figure.colorbar(image, ax=axes, label="similarity")
    columns = range(len(steps))
    shown_columns = columns[::max(1, math.ceil(len(steps) / 30))]
    axes.set_xticks(list(shown_columns), [str(steps[j]) for j in shown_columns])
    if len(names) <= MAX_LABELLED_ROWS:
        axes.set_yticks(range(len(names)), names, fontsize=7)
    else:
        axes.set_yticks([])
        axes.set_ylabel(f"{len(names)} parameters (model order)")
    axes.set_xlabel("steps")
    axes.set_title("direction similarity per parameter")
    _save(figure, path)
    return path
