"""Pictures of where a rank's gradients sit among the binary exponents, step by step, against the limits of the
narrow formats: steps across, exponents up (a row per exponent ``e``, from ``2**e`` up to ``2**(e+1)``; zeros in a
row below, non-finite elements in one above), each step's share of the elements per exponent as colour (a
logarithmic scale: a share of 1e-6 shows), and the normal range of each format of
:data:`~msprobe_mlflow.formats.RANGES` drawn as two lines (moved by the step's loss scale, as the format losses
are): below the lower line an element would be subnormal or zero in that format, above the upper one infinite.

One panel for the whole model, one per parameter group (:func:`parameter_groups`). Read from the dump's exponent
files (``rank{R}/exponents_{S}.npz``), at most :data:`MAX_COLUMNS` steps evenly spread over those recorded. Drawn
with matplotlib's object API (no pyplot state).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from msprobe_mlflow.dump import exponents_path
from msprobe_mlflow.exponents import read_exponents
from msprobe_mlflow.formats import RANGES, scale_exponent
from msprobe_mlflow.statistics_table import EXPONENT_BINS, EXPONENT_LOW, NON_FINITE_BIN, ZERO_BIN

MAX_COLUMNS = 500  # steps drawn: a picture is a few hundred pixels wide
MAX_GROUPS = 8  # parameter groups drawn beside the whole model
MODEL = "model"
LEAST_SHARE = 1e-6  # the colour scale's floor: shares below it are drawn at its colour, none left white
_COLOURS = ("tab:orange", "tab:red", "tab:purple", "tab:brown")
LAYER = "layer "  # a group of a ``Sequential``'s numbered layers: ``layer 3``, ``layer 0-6``


def parameter_group(name: str) -> str:
    """A parameter's group: its name up to its first numbered part (a layer: ``transformer.h.0``; ``layer 3`` for
    a ``Sequential``'s ``3.weight``), else its first part (``transformer.wte.weight`` -> ``transformer``)."""
    parts = name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:index + 1]) if index else f"{LAYER}{part}"
    return parts[0]


def parameter_groups(names: list[str], most: int = MAX_GROUPS) -> dict[str, list[int]]:
    """The groups of :func:`parameter_group` (label -> row indices, in the order of ``names``), numbered layers
    joined into ranges (``transformer.h.0-3``) as wide as needed to leave at most ``most`` groups; {} when even one
    range per stack of layers leaves more."""
    groups: dict[str, list[int]] = {}
    for index, name in enumerate(names):
        groups.setdefault(parameter_group(name), []).append(index)
    deepest = max((layer for _, layer in map(_layer, groups) if layer is not None), default=0)
    width, joined = 1, groups
    while len(joined) > most:
        if width > deepest:
            return {}
        width *= 2
        joined = _layer_ranges(groups, width)
    return joined


def _layer(label: str) -> tuple[str, int | None]:
    """``transformer.h.3`` -> (``transformer.h.``, 3); ``layer 3`` -> (``layer ``, 3); else (label, None)."""
    if label.startswith(LAYER):
        stem, last = LAYER, label[len(LAYER):]
    else:
        before, _, last = label.rpartition(".")
        stem = f"{before}."
    return (stem, int(last)) if last.isdigit() else (label, None)


def _layer_ranges(groups: dict[str, list[int]], width: int) -> dict[str, list[int]]:
    joined: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    for label, indices in groups.items():
        stem, layer = _layer(label)
        layers, members = joined.setdefault((stem, -1 if layer is None else layer // width), ([], []))
        layers.extend([] if layer is None else [layer])
        members.extend(indices)
    return {stem if not layers else f"{stem}{layers[0]}" if len(layers) == 1 else f"{stem}{min(layers)}-{max(layers)}":
            sorted(members) for (stem, _), (layers, members) in joined.items()}


def drawn_steps(steps: list[int], most: int = MAX_COLUMNS) -> list[int]:
    """At most ``most`` of ``steps`` (sorted), evenly spread, the first and the last among them."""
    if len(steps) <= most:
        return list(steps)
    return [steps[i] for i in sorted({round(i) for i in np.linspace(0, len(steps) - 1, most)})]


@dataclass
class ExponentHistory:
    """A rank's exponent counts over steps, summed per panel: ``counts[panel][j]`` holds step ``steps[j]``'s
    :data:`EXPONENT_BINS` bins; ``shifts[j]`` is that step's loss scale as a power of two."""

    steps: list[int]
    counts: dict[str, np.ndarray]
    shifts: np.ndarray

    @classmethod
    def read(cls, dump_path: str | os.PathLike, rank: int, steps: list[int]) -> "ExponentHistory":
        """From the exponent files of ``steps`` (:func:`drawn_steps` of them); the groups are those of the first
        step's names, matched by name at every step (a parameter a step lacks counts nothing there)."""
        steps = drawn_steps(steps)
        group_of: dict[str, str] | None = None
        counts: dict[str, np.ndarray] = {}
        shifts = np.zeros(len(steps), np.int64)
        for column, step in enumerate(steps):
            names, exponent_counts, loss_scale = read_exponents(exponents_path(dump_path, rank, step))
            if group_of is None:
                group_of = {name: label for label, rows in parameter_groups(names).items() for name in
                            (names[r] for r in rows)}
                labels = [MODEL, *dict.fromkeys(group_of.values())]
                counts = {label: np.zeros((len(steps), EXPONENT_BINS), np.int64) for label in labels}
            full = exponent_counts.full()
            counts[MODEL][column] = full.sum(axis=0)
            for name, row in zip(names, full):
                if (label := group_of.get(name)) is not None:
                    counts[label][column] += row
            shifts[column] = scale_exponent(loss_scale)
        return cls(steps, counts, shifts)


def pictures(history: ExponentHistory, panel: str, uptos: list[int], title: str = "") -> Iterator[np.ndarray]:
    """The picture of ``panel`` (:data:`MODEL` or a group) filled up to each step of ``uptos`` in turn, as RGB
    arrays, on the axes of the whole history, so that they line up as a slider shows them: one figure drawn once,
    the steps after ``upto`` covered."""
    figure = Figure(figsize=(9, 4.8), dpi=100)
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    _draw_panel(figure, axes, history, panel, title or panel)
    figure.tight_layout()
    edges = _step_edges(history.steps)
    bottom, top = axes.get_ylim()  # the cover goes above the cells and lines (zorder 2), below the frame (2.5)
    future = axes.add_patch(Rectangle((edges[-1], bottom), 0, top - bottom, facecolor="white", edgecolor="none",
                                      zorder=2.2))
    for upto in uptos:
        start = edges[np.searchsorted(history.steps, upto, side="right")]
        future.set_x(start)
        future.set_width(edges[-1] - start)
        canvas.draw()
        yield np.asarray(canvas.buffer_rgba())[..., :3].copy()


def save_summary(history: ExponentHistory, path: str | os.PathLike, title: str) -> None:
    """Every panel on one figure: the whole model on top, the groups below, three across."""
    groups = [label for label in history.counts if label != MODEL]
    rows = 1 + -(-len(groups) // 3)
    figure = Figure(figsize=(15, 4.2 * rows), dpi=80)
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(rows, 3)
    _draw_panel(figure, figure.add_subplot(grid[0, :]), history, MODEL, f"{title}: {MODEL}")
    for index, label in enumerate(groups):
        _draw_panel(figure, figure.add_subplot(grid[1 + index // 3, index % 3]), history, label, label, legend=False)
    figure.tight_layout()
    figure.savefig(path)


def _draw_panel(figure: Figure, axes, history: ExponentHistory, panel: str, title: str, legend: bool = True) -> None:
    counts = history.counts[panel]
    occurring = np.flatnonzero(counts[:, :ZERO_BIN].any(axis=0))
    low, high = ((EXPONENT_LOW + int(occurring[0]), EXPONENT_LOW + int(occurring[-1])) if occurring.size
                 else (0, 0))
    # rows from low - 3: zeros at low - 3, a blank row, the exponents, a blank row, non-finite at high + 2
    rows = np.zeros((len(history.steps), high - low + 6))
    rows[:, 3:high - low + 4] = counts[:, low - EXPONENT_LOW:high - EXPONENT_LOW + 1]
    rows[:, 0], rows[:, -1] = counts[:, ZERO_BIN], counts[:, NON_FINITE_BIN]
    totals = rows.sum(axis=1, keepdims=True)
    shares = np.divide(rows, totals, out=np.zeros_like(rows), where=totals > 0)
    shown = np.ma.masked_less_equal(np.log10(np.maximum(shares, LEAST_SHARE * 1e-3)), np.log10(LEAST_SHARE) - 1)
    edges = _step_edges(history.steps)
    mesh = axes.pcolormesh(edges, np.arange(low - 3, high + 4), shown.T, cmap="viridis",
                           norm=Normalize(np.log10(LEAST_SHARE), 0), shading="flat")
    figure.colorbar(mesh, ax=axes, label="share of elements (log10)", pad=0.01)
    beyond = _draw_limits(axes, edges, history.shifts, low, high) if occurring.size else []  # none over zeros
    ticks = _exponent_ticks(low, high)
    axes.set_yticks([low - 2.5, *(e + 0.5 for e in ticks), high + 2.5],
                    ["zero", *(f"2^{e}" for e in ticks), "inf/NaN"])
    axes.set_ylim(low - 3, high + 3)
    axes.set_xlim(edges[0], edges[-1])
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_title(title + (f"\n(beyond the picture: {'; '.join(beyond)})" if beyond and legend else ""),
                   fontsize=10)
    if legend and axes.get_legend_handles_labels()[0]:
        axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)


def _step_edges(steps: list[int]) -> np.ndarray:
    """Cell edges halfway between the drawn steps (half a step's gap before the first and after the last)."""
    centres = np.asarray(steps, np.float64)
    gaps = np.diff(centres)
    first, last = (gaps[0], gaps[-1]) if gaps.size else (1.0, 1.0)
    return np.concatenate([[centres[0] - first / 2], centres[:-1] + gaps / 2, [centres[-1] + last / 2]])


def _draw_limits(axes, edges: np.ndarray, shifts: np.ndarray, low: int, high: int) -> list[str]:
    """Each distinct normal range of the formats as two step lines; returns, for those wholly outside the
    exponents shown, their names and limits."""
    ranges: dict[tuple[int, int], list[str]] = {}
    for name, limits in RANGES.items():
        ranges.setdefault((limits.least_normal, limits.overflow), []).append(name)
    beyond = []
    for colour, ((normal, overflow), names) in zip(_COLOURS, ranges.items()):
        label = ", ".join(names)
        drawn = False
        for limit, style in ((normal, "-"), (overflow, "--")):
            heights = limit - shifts
            if not heights.size or heights.max() < low - 1 or heights.min() > high + 2:
                continue
            axes.stairs(heights, edges, baseline=None, color=colour, linestyle=style, linewidth=1.6,
                        label=None if drawn else f"{label}: normal from 2^{normal} (-), inf from 2^{overflow} (--)")
            drawn = True
        if not drawn:
            beyond.append(f"{label} from 2^{normal} to 2^{overflow}")
    return beyond


def _exponent_ticks(low: int, high: int, most: int = 12) -> list[int]:
    step = max(1, -(-(high - low + 1) // most))
    return list(range(low - low % step + (step if low % step else 0), high + 1, step)) or [low]
