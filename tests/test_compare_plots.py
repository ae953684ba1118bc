"""The comparison's heat map is legible from 6 to 500 parameters: labels of a readable size on rows tall enough,
every parameter while they fit, else those whose similarity fell lowest."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.colors import to_rgb

from msprobe_mlflow.compare.plots import MAX_HEATMAP_ROWS, SUSPICIOUS_COLOUR, heatmap_figure

MIN_LABEL_POINTS = 9   # about 12 pixels at 100 dpi: readable without zooming
MIN_ROW_PIXELS = 16    # a label's height and a little space


def parameters(count: int, steps: int = 12, seed: int = 0) -> tuple[list[str], list[int], np.ndarray]:
    """``count`` parameter names and a similarity matrix where a third of the parameters fall from step 5."""
    rng = np.random.default_rng(seed)
    names = [f"model.layers.{i // 4}.{('q_proj', 'k_proj', 'up_proj', 'down_proj')[i % 4]}.weight"
             for i in range(count)]
    matrix = np.ones((count, steps))
    falls = rng.uniform(0.05, 0.5, count) * (rng.random(count) < 0.3)
    matrix[:, 5:] -= falls[:, None]
    return names, list(range(steps)), matrix


def drawn_rows(figure) -> tuple[list[str], float, float]:
    """Labels of the heat map's rows, their font size in points, and each row's height in pixels."""
    axes = figure.axes[0]
    labels = [label for label in axes.get_yticklabels() if label.get_text()]
    figure.canvas.draw()
    row_pixels = axes.get_window_extent().height / len(labels)
    return [label.get_text() for label in labels], min(label.get_fontsize() for label in labels), row_pixels


@pytest.mark.parametrize("count", [6, 60, 500])
def test_row_labels_are_readable_at_every_parameter_count(count):
    names, steps, matrix = parameters(count)
    labels, points, row_pixels = drawn_rows(heatmap_figure(names, steps, matrix))
    assert len(labels) == min(count, MAX_HEATMAP_ROWS)
    assert points >= MIN_LABEL_POINTS
    assert row_pixels >= MIN_ROW_PIXELS
    step_labels = [label.get_text() for label in heatmap_figure(names, steps, matrix).axes[0].get_xticklabels()]
    assert step_labels == [str(s) for s in steps]


def test_every_parameter_is_drawn_in_model_order_while_they_fit():
    names, steps, matrix = parameters(MAX_HEATMAP_ROWS)
    labels, _, _ = drawn_rows(heatmap_figure(names, steps, matrix))
    assert labels == names


def test_past_the_limit_the_parameters_whose_similarity_fell_lowest_are_drawn_in_model_order():
    names, steps, matrix = parameters(500)
    matrix[7, :] = np.nan  # never compared: last in line, whatever its neighbours
    figure = heatmap_figure(names, steps, matrix)
    labels, _, _ = drawn_rows(figure)
    lowest = np.nan_to_num(matrix, nan=np.inf).min(axis=1)
    chosen = sorted(sorted(range(500), key=lambda i: (lowest[i], i))[:MAX_HEATMAP_ROWS])
    assert labels == [names[i] for i in chosen]
    assert f"{MAX_HEATMAP_ROWS} of 500 parameters" in figure.axes[0].get_title()
    assert "similarities.csv" in figure.axes[0].get_title()


def test_over_long_names_are_shortened_in_the_middle():
    long_name = "model." + "very_long_module_name." * 6 + "weight"
    labels, _, _ = drawn_rows(heatmap_figure([long_name, "bias"], [0, 1], np.ones((2, 2))))
    assert labels[0].startswith("model.very_long") and labels[0].endswith("_name.weight") and "..." in labels[0]
    assert len(labels[0]) <= 60 and labels[1] == "bias"


def test_the_first_suspicious_step_and_its_culprits_are_marked_in_red_on_the_heat_map():
    names, steps, matrix = parameters(6, steps=100)  # step labels every third step: 50 is not one of them
    figure = heatmap_figure(names, steps, matrix, suspicious_step=50, culprits={names[1], names[4]})
    axes = figure.axes[0]
    [outline] = [patch for patch in axes.patches if patch.get_edgecolor()[:3] == to_rgb(SUSPICIOUS_COLOUR)]
    assert (outline.get_x(), outline.get_width()) == (steps.index(50) - 0.5, 1)  # the column of step 50, no other
    step_labels = {label.get_text(): label for label in axes.get_xticklabels()}
    assert to_rgb(step_labels["50"].get_color()) == to_rgb(SUSPICIOUS_COLOUR)
    assert [to_rgb(label.get_color()) == to_rgb(SUSPICIOUS_COLOUR) for label in step_labels.values()].count(True) == 1
    red_rows = [label.get_text() for label in axes.get_yticklabels()
                if to_rgb(label.get_color()) == to_rgb(SUSPICIOUS_COLOUR)]
    assert red_rows == [names[1], names[4]]
    assert "first suspicious step 50" in axes.get_title()


def test_a_consistent_comparison_marks_nothing_on_the_heat_map():
    names, steps, matrix = parameters(6)
    axes = heatmap_figure(names, steps, matrix).axes[0]
    assert len(axes.patches) == 0 and "suspicious" not in axes.get_title()


def test_rows_whose_sign_is_rounding_are_greyed_and_labelled_as_noise():
    names, steps, matrix = parameters(6)
    matrix[2] = 0.5  # a key bias's signs: a coin toss at every step
    axes = heatmap_figure(names, steps, matrix, noise={names[2]}).axes[0]
    [grey] = [patch for patch in axes.patches if to_rgb(patch.get_facecolor()) == to_rgb("lightgrey")]
    assert (grey.get_y(), grey.get_height(), grey.get_width()) == (1.5, 1, len(steps))  # row 2, every step
    labels = [label.get_text() for label in axes.get_yticklabels()]
    assert labels[2] == f"{names[2]} (sign noise)" and all("noise" not in label for i, label in enumerate(labels)
                                                           if i != 2)
    assert "grey: sign is rounding" in axes.get_title()
