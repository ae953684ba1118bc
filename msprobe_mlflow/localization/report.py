"""What ``locate`` leaves to read beside its one line: ``ops.csv`` (every aligned call, both sides' statistics of
its first output and the judgement) and a plot of the differences along the execution order, the named call marked."""
from __future__ import annotations

import csv
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from msprobe_mlflow.localization import Localization
from msprobe_mlflow.localization.align import module_path

OPS_FILE, PLOT_FILE = "ops.csv", "differences.png"
COLUMNS = ["index", "phase", "name_a", "name_b", "module", "input_difference", "output_difference", "tolerance",
           "format", "inputs_bit_equal", "judgement", "a_max", "a_min", "a_mean", "a_norm", "b_max", "b_min",
           "b_mean", "b_norm"]
_MARK = "tab:red"


def write_ops_csv(found: Localization, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for index, (pair, judgement) in enumerate(found.rows):
            if pair is found.pair:
                verdict = f"named: {found.kind}"
            elif judgement is None:
                verdict = "in one run only"
            else:
                verdict = "beyond" if judgement.beyond else "explained"
            numbers = [] if judgement is None else [judgement.input_difference, judgement.output_difference,
                                                    judgement.tolerance, judgement.format, judgement.inputs_bit_equal]
            writer.writerow([index, pair.call.phase, pair.a.name if pair.a else "", pair.b.name if pair.b else "",
                             module_path(pair.call.parent), *(numbers or [""] * 5), verdict,
                             *_first_output(pair.a), *_first_output(pair.b)])
    return path


def _first_output(call) -> list:
    tensors = call.tensors_out if call is not None else []
    return list(tensors[0].statistics()) if tensors else [""] * 4


def plot_differences(found: Localization, path: Path) -> Path:
    """Each call's output difference and what its inputs and rounding explain, log scale, in execution order."""
    judged = [(i, j) for i, (_, j) in enumerate(found.rows) if j is not None]
    figure = Figure(figsize=(12, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    floor = min([j.tolerance for _, j in judged if j.tolerance > 0] or [1e-12]) / 10
    axes.plot([i for i, _ in judged], [max(j.output_difference, floor) for _, j in judged], ".", markersize=3,
              label="output difference")
    axes.plot([i for i, _ in judged], [max(j.tolerance, floor) for _, j in judged], "-", linewidth=0.8,
              color="tab:gray", label="explained by inputs and rounding")
    backward = next((i for i, (pair, _) in enumerate(found.rows) if pair.call.phase == "backward"), None)
    if backward is not None:
        axes.axvline(backward, color="tab:gray", linestyle=":", linewidth=0.8)
    if found.pair is not None:
        index = next(i for i, (pair, _) in enumerate(found.rows) if pair is found.pair)
        axes.axvline(index, color=_MARK, linewidth=1.2, label=f"{found.pair.call.name} ({found.kind})")
    axes.set_yscale("log")
    axes.set_xlabel("operator calls in execution order (forward, then backward after the dotted line)")
    axes.set_ylabel("difference on the tensor's scale")
    axes.set_title(found.describe() if len(found.describe()) < 110 else found.describe()[:107] + "...",
                   fontsize=9)
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
