"""How often the anomaly flags fire on clean trainings, and how many injected faults they catch: the measurement
behind ``SpikeRule``'s defaults (``msprobe_mlflow/anomaly_rule.py``).

Four small trainings of 300 steps (CPU, one torch thread): an MLP with Adam on a noisy regression, the same MLP with
SGD momentum and a tenfold learning-rate decay at step 150, a CNN with SGD momentum, a 2-layer transformer encoder
with AdamW. Each step's per-parameter gradient norms go through the real rule (``AnomalyFlags``, as the sink runs
it). Reported per training and threshold:

- false flags: flagged (parameter, step) pairs and steps with any flag (parameters and the total norm), on the
  clean run;
- recall: a fault injected into one parameter's norm at one step (40 random parameter-steps after the warm-up per
  training and fault: x10, x100, x0.1, and 0, a zeroed layer), flagged at that step for that parameter.

Results: ``results/anomalies.md``::

    PYTHONPATH=. .venv/bin/python benchmarks/anomaly_rates.py

``--quick --out DIR``: a dry run of the harness in seconds (the same trainings and rule, 60 steps, 4 injections per
fault), its table only in DIR.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from msprobe_mlflow.records import StepRecord
from msprobe_mlflow.anomaly_rule import AnomalyFlags, SpikeRule

RESULTS = Path(__file__).resolve().parent / "results"
STEPS = 300
THRESHOLDS = (6.0, 7.0, 8.0)
FAULTS = {"x10": 10.0, "x100": 100.0, "x0.1": 0.1, "zeroed": 0.0}
INJECTIONS = 40
QUICK_STEPS, QUICK_INJECTIONS = 60, 4  # --quick: past the rule's warm-up (window // 2 steps), a few faults


def regression_mlp():
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    weights = torch.randn(8, 1)

    def batch(generator):
        x = torch.randn(32, 8, generator=generator)
        return x, x @ weights + 0.1 * torch.randn(32, 1, generator=generator)
    return model, batch, torch.nn.functional.mse_loss


def cnn():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
                                torch.nn.Flatten(), torch.nn.Linear(256, 10))
    projection = torch.randn(256, 10)

    def batch(generator):
        x = torch.randn(32, 1, 16, 16, generator=generator)
        return x, (x.reshape(32, -1) @ projection).argmax(1)
    return model, batch, torch.nn.functional.cross_entropy


class Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(50, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = torch.nn.Linear(32, 50)

    def forward(self, tokens):
        return self.out(self.encoder(self.embedding(tokens)))


def transformer():
    def batch(generator):
        tokens = torch.randint(0, 50, (16, 12), generator=generator)
        return tokens, (tokens * 7 + 3) % 50

    def loss(output, target):
        return torch.nn.functional.cross_entropy(output.reshape(-1, 50), target.reshape(-1))
    return Transformer(), batch, loss


TRAININGS = {
    "MLP, Adam": (regression_mlp, lambda p: torch.optim.Adam(p, lr=1e-3), None),
    "MLP, SGD momentum, lr / 10 at step 150": (regression_mlp, lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),
                                               150),
    "CNN, SGD momentum": (cnn, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), None),
    "transformer, AdamW": (transformer, lambda p: torch.optim.AdamW(p, lr=3e-4), None),
}


def clean_norms(name: str, steps: int = STEPS) -> tuple[list[str], np.ndarray]:
    """Steps x parameters gradient norms (float32, as the monitor computes them) of one clean training."""
    build, optimizer_for, decay_at = TRAININGS[name]
    torch.manual_seed(0)
    model, batch, loss_fn = build()
    optimizer = optimizer_for(model.parameters())
    generator = torch.Generator().manual_seed(1)
    norms = []
    for step in range(steps):
        if step == decay_at:
            for group in optimizer.param_groups:
                group["lr"] /= 10
        optimizer.zero_grad()
        inputs, target = batch(generator)
        loss_fn(model(inputs), target).backward()
        norms.append(torch.stack(torch._foreach_norm([p.grad for p in model.parameters()])).numpy())
        optimizer.step()
    return [n for n, _ in model.named_parameters()], np.array(norms, dtype=np.float32)


def flags_of(names: list[str], norms: np.ndarray, rule: SpikeRule, last_step: int | None = None) -> list:
    flagger = AnomalyFlags(rule)
    found = []
    for step, row in enumerate(norms[: None if last_step is None else last_step + 1]):
        values = np.column_stack([row, -row, row])
        record = StepRecord(0, step, "L1", (-1, 0, 1), names, [(1,)] * len(names), values)
        found += flagger.step_flags(record)
    return found


def measure(name: str, steps: int = STEPS, injections: int = INJECTIONS) -> dict:
    names, norms = clean_norms(name, steps)
    result = {"parameters": len(names), "steps": steps, "injections": injections, "by_threshold": {}}
    for threshold in THRESHOLDS:
        rule = SpikeRule(threshold=threshold)
        clean = flags_of(names, norms, rule)
        rng = np.random.default_rng(0)
        recall = {}
        for fault, factor in FAULTS.items():
            caught = 0
            for _ in range(injections):
                parameter, step = int(rng.integers(len(names))), int(rng.integers(rule.window // 2 + 5, steps))
                faulty = norms.copy()
                faulty[step, parameter] *= factor
                caught += any(f.step == step and f.parameter == names[parameter]
                              for f in flags_of(names, faulty, rule, step))
            recall[fault] = caught / injections
        result["by_threshold"][threshold] = {
            "false_parameter_steps": sum(f.parameter is not None for f in clean),
            "false_total_steps": sum(f.parameter is None for f in clean),
            "steps_with_a_flag": len({f.step for f in clean}), "recall": recall}
    return result


def markdown(results: dict) -> str:
    window = SpikeRule().window
    first = next(iter(results.values()))
    steps, injections = first["steps"], first["injections"]
    lines = ["# Anomaly flags: false flags on clean trainings, recall of injected faults", "",
             f"{len(TRAININGS)} trainings of {steps} steps (CPU); the rule of `SpikeRule` (window {window} steps, "
             f"judged from {window // 2}), at each threshold. *False*: flags on the clean run (parameter-steps of "
             f"all parameter-steps; steps with any flag, the total norm included, of {steps}). *Recall*: of "
             f"{injections} faults injected into one parameter's norm at one step each, those flagged there.", "",
             "| training | threshold | false parameter-steps | steps with a flag | recall x10 | x100 | x0.1 | zeroed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    totals = {t: [0, 0, 0] for t in THRESHOLDS}
    for name, result in results.items():
        for threshold, row in result["by_threshold"].items():
            recall = row["recall"]
            lines.append(f"| {name} | {threshold:g} | {row['false_parameter_steps']} / "
                         f"{result['parameters'] * steps:,} | {row['steps_with_a_flag']} / {steps} | "
                         + " | ".join(f"{recall[f]:.2f}" for f in FAULTS) + " |")
            totals[threshold][0] += row["false_parameter_steps"]
            totals[threshold][1] += row["steps_with_a_flag"]
            totals[threshold][2] += result["parameters"] * steps
    lines += ["", "All trainings: " + "; ".join(
        f"threshold {t:g}: {false} false parameter-steps of {all_:,}, {flagged} flagged steps of "
        f"{steps * len(results)}" for t, (false, flagged, all_) in totals.items()) + ".", "",
        "Reproduce: `PYTHONPATH=. python benchmarks/anomaly_rates.py` (also run by `benchmarks/run`)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help=f"where anomalies.md goes (default {RESULTS}; --quick needs it)")
    parser.add_argument("--quick", action="store_true", help=f"a dry run of the harness in seconds: {QUICK_STEPS} "
                        f"steps, {QUICK_INJECTIONS} injections per fault")
    args = parser.parse_args()
    if args.quick and args.out is None:
        parser.error("--quick needs --out: a dry run never writes into benchmarks/results/")
    args.out = args.out or RESULTS
    torch.set_num_threads(1)
    steps, injections = (QUICK_STEPS, QUICK_INJECTIONS) if args.quick else (STEPS, INJECTIONS)
    results = {name: measure(name, steps, injections) for name in TRAININGS}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "anomalies.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
