"""The cross-framework benchmark (issue 47, item 6): does the verdict on a MindSpore training against its PyTorch twin
stay quiet when the two only differ in the frameworks' rounding, and name the first step at which a bug on the
MindSpore side makes them part, with the parameter it touched, with no name map?

One model family, held out: it was declared before it was ever measured and never used to tune the rule. The same
small MLP in both frameworks (a LayerNorm, then Linear 16 -> 64, Tanh, LayerNorm, Linear 64 -> 64, ReLU, Linear
64 -> 10), each in its framework's words: MindSpore a numbered ``nn.SequentialCell`` (``ln.gamma``,
``body.0.weight``, ``body.2.beta``...), PyTorch named modules (``ln.weight``, ``body.fc1.weight``,
``body.norm.bias``...); the comparator pairs them itself (``compare_dumps`` with no name map). The initial weights
are PyTorch's (``torch.manual_seed(seed)``), copied into MindSpore; the batches (64 x 16 features, the class is the
largest of the first ten) are a function of (seed, step) alone, fed to both; both use SGD with momentum 0.9,
learning rate 0.05 and weight decay 1e-4 on the Linear layers only (MindSpore's default decay filter leaves
``gamma``/``beta`` out; the PyTorch twin's parameter groups do the same). MindSpore 2.x runs in PyNative mode on
the CPU with the forward and backward compiled by ``mindspore.jit`` (compiled again where a bug changes the model),
and its ``nn.Momentum`` receives the gradients from ``value_and_grad`` in the custom loop; PyTorch runs on one
thread. Both train under the real monitors with the divergence benchmark's settings (L2, bounds ``[-1, 0, 1]``, the
weights' norms ``statistics=["param_norm"]``, local dump only), so that its lines and this family's are measured
alike (until stop 55: L1, without the weights' norms; that evaluation is in the history of ``results/``).

- Baseline (side A of every pair): PyTorch float32, 300 steps, per seed (3 seeds).
- Benign pairs, 300 steps: MindSpore float32 against the baseline, and MindSpore float32 against PyTorch float64.
- Harmful scenarios (:data:`SCENARIOS`), on the MindSpore side only, 60-step runs, from step 30 and from step 0,
  judged against the PyTorch float32 baseline. The truth is measured, not assumed (``Truth`` of
  ``divergence_benchmark.py``): the first step at which the bug run's recorded gradients (summary CSV bytes,
  direction bits) differ from the clean MindSpore run's of the same seed. Culprits are named as PyTorch names them
  (side A). A control trains the clean MindSpore run of the first seed twice and checks that the truth finds no
  difference (MindSpore's CPU kernels are reproducible run to run, or no truth here means anything).

Each verdict is read from ``compare_dumps(torch_dump, mindspore_dump, None, plots=False)``: the first suspicious
step, its grade (``verdict.grade``, ``ranks[0].grade``), ``ranks[0].parameter_trips`` and ``verdict.partial``
(None: every parameter of both models was paired). Beside the default rule: msprobe's, and the default rule told
that both runs computed in float32 (``precision="float32"``, what the verdict's first-steps note proposes where it
reads one run's 16-bit gradients as autocast); it differs from the default only where a run recorded no compute
format for its first steps. A bug's effect is measured too (``effect_and_pair_difference``), for issue 47's
decision 1.

    python benchmarks/cross_framework_benchmark.py            # trains what --work lacks, judges, writes results
    python benchmarks/cross_framework_benchmark.py evaluate   # judges the cached dumps again
    python benchmarks/cross_framework_benchmark.py --quick    # 1 seed, short runs, results in --work only

MindSpore writes compiler reports into the current folder: the script runs from ``--work``.
"""
from __future__ import annotations

import os

os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ warnings, at every compile

import argparse
import dataclasses
import datetime
import hashlib
import json
import logging
import multiprocessing
import platform
import shutil
import sys
import time
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import mindspore as ms
import numpy as np
import torch
from mindspore import Tensor, nn, ops

from msprobe_mlflow import GradProbeConfig
from msprobe_mlflow.compare.engine import compare_dumps
from msprobe_mlflow.statistics_table import PARAMETER_NORM
from msprobe_mlflow.mindspore import GradientMonitor as MindSporeMonitor
from msprobe_mlflow.pytorch import GradientMonitor as TorchMonitor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from divergence_benchmark import (Truth, flip_exponent_bit, fraction, generator, largest_change, load,  # noqa: E402
                                  outcome, package_provenance, progress, recorded_statistics, steps_off, table)

RESULTS = Path(__file__).resolve().parent / "results"
RECIPE = 2  # bump when a training below changes: dumps cached under another recipe are trained again (2: L2, weights'
# norms; 1: L1)
FAMILY = "mlp-twins"  # held out: declared before it was measured, never used to tune the rule
RULES = ("noise", "msprobe", "noise, precision float32")  # the third: compare_dumps(precision="float32")
VARIANTS = ("from step 30", "from step 0")  # "from step 30": from Plan.bug_step

FEATURES, WIDTH, CLASSES, BATCH = 16, 64, 10, 64
LEARNING_RATE, MOMENTUM, WEIGHT_DECAY, EPSILON = 0.05, 0.9, 1e-4, 1e-5
# The twins' parameters in model order, each framework's name: what the comparator has to pair by itself.
TORCH_NAMES = ("ln.weight", "ln.bias", "body.fc1.weight", "body.fc1.bias", "body.norm.weight", "body.norm.bias",
               "body.fc2.weight", "body.fc2.bias", "body.head.weight", "body.head.bias")
MINDSPORE_NAMES = ("ln.gamma", "ln.beta", "body.0.weight", "body.0.bias", "body.2.gamma", "body.2.beta",
                   "body.3.weight", "body.3.bias", "body.5.weight", "body.5.bias")
TORCH_NAME = dict(zip(MINDSPORE_NAMES, TORCH_NAMES))
DECAYED = tuple(t for t, m in zip(TORCH_NAMES, MINDSPORE_NAMES) if "gamma" not in m and "beta" not in m)


@dataclasses.dataclass(frozen=True)
class Plan:
    seeds: tuple[int, ...] = (0, 1, 2)
    benign_steps: int = 300
    harmful_steps: int = 60
    bug_step: int = 30


QUICK = Plan(seeds=(0,), benign_steps=24, harmful_steps=12, bug_step=6)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A bug on the MindSpore side. ``culprits``: the parameters it touches, as PyTorch names them (None: not
    localized); ``feeding``: for a bug in the forward pass, the parameters of the layer feeding the touched one (their
    gradients, reached through the touched layer, change first); ``magnitude``: at its first step the bug changes
    magnitudes only, every sign intact."""

    name: str
    category: str
    what: str
    culprits: tuple[str, ...] | None = None
    feeding: tuple[str, ...] = ()
    magnitude: bool = False


SCENARIOS = (
    Scenario("new batches", "data", "other batches from the bug's step on (another data stream)"),
    Scenario("labels corrupted", "data", "20% of the labels replaced by random classes"),
    Scenario("learning rate x10", "optimizer", "the dynamic learning rate list x10 from the bug's step"),
    Scenario("weight decay x10", "optimizer", "a dynamic weight decay (a Cell of the global step) x10 from the bug's "
             "step"),
    Scenario("model code changed", "model code", "the SequentialCell's Tanh replaced by ReLU"),
    Scenario("norm epsilon", "numerics", "both LayerNorms' epsilon 1e-5 -> 1e-3"),
    Scenario("one layer in float16", "numerics", "body.3 (torch body.fc2) computes its matmul in float16",
             culprits=("body.fc2.weight", "body.fc2.bias"), feeding=("body.norm.weight", "body.norm.bias")),
    Scenario("gradients x2", "gradient plumbing", "every gradient x2, as by a wrong world size", magnitude=True),
    Scenario("loss summed", "gradient plumbing", "loss summed instead of averaged", magnitude=True),
    Scenario("gradient zeroed", "gradient plumbing", "body.3.weight's gradient zeroed",
             culprits=("body.fc2.weight",)),
    Scenario("LayerNorm gamma's gradient x1.5", "gradient plumbing", "ln.gamma's gradient x1.5 (a wrong backward)",
             culprits=("ln.weight",), magnitude=True),
    Scenario("weights corrupted", "silent corruption", "4 elements of body.3.weight set to 10x its largest value at "
             "the bug's step", culprits=("body.fc2.weight",), feeding=("body.norm.weight", "body.norm.bias")),
    Scenario("exponent bit flip", "silent corruption", "one exponent bit flipped in one element of body.5.weight's "
             "gradient at the bug's step (that value x 256)", culprits=("body.head.weight",), magnitude=True),
)
SCENARIO_BY_NAME = {s.name: s for s in SCENARIOS}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    framework: str  # torch, mindspore
    dtype: str  # float32, float64 (torch only)
    seed: int
    steps: int
    scenario: str | None = None
    bug_from: int | None = None
    repeat: int = 0  # the control: the same run trained again

    @property
    def name(self) -> str:
        bug = "" if self.scenario is None else f"-{self.scenario.replace(' ', '_')}-from{self.bug_from}"
        again = f"-again{self.repeat}" if self.repeat else ""
        return f"{self.framework}-{self.dtype}-s{self.seed}{bug}{again}-{self.steps}steps"

    def key(self) -> dict:
        return {**dataclasses.asdict(self), "recipe": RECIPE, "torch": torch.__version__,
                "mindspore": ms.__version__}


# ---- the twins: weights, data


def initial_weights(seed: int) -> dict[str, np.ndarray]:
    """PyTorch's initialisation of the twin for ``seed``, by PyTorch name (float32)."""
    torch.manual_seed(seed)
    return {name: p.detach().numpy().copy() for name, p in TorchTwin().named_parameters()}


def batch(seed: int, step: int, stream: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """64 x 16 float32 features (mean 1, deviation 2: the first LayerNorm has work to do); the class is the largest of
    the first ten."""
    rng = np.random.default_rng(int.from_bytes(hashlib.blake2b(repr((seed, step, stream)).encode(),
                                                               digest_size=8).digest(), "little"))
    inputs = (rng.standard_normal((BATCH, FEATURES)) * 2 + 1).astype(np.float32)
    return inputs, inputs[:, :CLASSES].argmax(1).astype(np.int32)


def corrupted_labels(labels: np.ndarray, seed: int, step: int) -> np.ndarray:
    rng = np.random.default_rng([seed, step, 7])
    wrong = rng.random(labels.shape) < 0.2
    return np.where(wrong, rng.integers(CLASSES, size=labels.shape), labels).astype(labels.dtype)


class TorchTwin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(FEATURES, eps=EPSILON)
        self.body = torch.nn.Sequential(OrderedDict(
            fc1=torch.nn.Linear(FEATURES, WIDTH), act1=torch.nn.Tanh(), norm=torch.nn.LayerNorm(WIDTH, eps=EPSILON),
            fc2=torch.nn.Linear(WIDTH, WIDTH), act2=torch.nn.ReLU(), head=torch.nn.Linear(WIDTH, CLASSES)))

    def forward(self, x):
        return self.body(self.ln(x))


class MindSporeTwin(nn.Cell):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm((FEATURES,), epsilon=EPSILON)
        self.body = nn.SequentialCell([nn.Dense(FEATURES, WIDTH), nn.Tanh(), nn.LayerNorm((WIDTH,), epsilon=EPSILON),
                                       nn.Dense(WIDTH, WIDTH), nn.ReLU(), nn.Dense(WIDTH, CLASSES)])

    def construct(self, x):
        return self.body(self.ln(x))


class SteppedWeightDecay(nn.Cell):
    """MindSpore's dynamic weight decay (a Cell of the optimizer's global step): ``value``, times ``factor`` from
    step ``start`` on. Every MindSpore run uses it (factor 1 when clean), so clean and bug runs agree bit for bit
    before the bug."""

    def __init__(self, value: float, factor: float, start: int):
        super().__init__()
        self.before, self.after, self.start = Tensor(value, ms.float32), Tensor(value * factor, ms.float32), start

    def construct(self, global_step):
        return ops.select(global_step >= self.start, self.after, self.before).reshape(())


class DenseInFloat16(nn.Dense):
    """A ``Dense`` whose matmul runs on float16 copies of its input, weight and bias, its output cast back (the class
    of one layer is swapped: its parameters keep their names)."""

    def construct(self, x):
        half = ms.float16
        return ops.dense(x.astype(half), self.weight.astype(half), self.bias.astype(half)).astype(x.dtype)


# ---- one training each


def monitor_config(dump: Path) -> GradProbeConfig:
    return GradProbeConfig(dump_path=str(dump), level="L2", bounds=(-1, 0, 1))


def digest_of(arrays) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for array in arrays:
        digest.update(array.tobytes())
    return digest.hexdigest()


def train_torch(spec: RunSpec, dump: Path) -> dict:
    """The PyTorch twin (no bug: bugs are MindSpore's here), float32 or float64, on one thread."""
    model, weights = TorchTwin(), initial_weights(spec.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(weights[name]))
    dtype = torch.float64 if spec.dtype == "float64" else torch.float32
    model.to(dtype).train()
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD([{"params": [params[n] for n in DECAYED], "weight_decay": WEIGHT_DECAY},
                                 {"params": [p for n, p in params.items() if n not in DECAYED], "weight_decay": 0.0}],
                                lr=LEARNING_RATE, momentum=MOMENTUM)
    monitor = TorchMonitor(monitor_config(dump), log_to_mlflow=False, anomaly_flags=False, silent=True,
                           statistics=[PARAMETER_NORM]).monitor(model, optimizer)
    start, digests = time.perf_counter(), []
    for step in range(spec.steps):
        inputs, labels = batch(spec.seed, step)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(inputs).to(dtype)),
                                                 torch.from_numpy(labels).long())
        loss.backward()
        digests.append(digest_of(p.grad.numpy() for p in params.values()))
        optimizer.step()
    monitor.stop()
    return {"spec": spec.key(), "seconds": time.perf_counter() - start, "gradient_digests": digests}


class MindSporeTraining:
    """The MindSpore twin of ``spec``: clean, or with the scenario's bug from ``bug_from``."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.scenario = None if spec.scenario is None else SCENARIO_BY_NAME[spec.scenario]
        self.net = MindSporeTwin()
        weights = initial_weights(spec.seed)
        self.params = {p.name: p for p in self.net.trainable_params()}
        if tuple(self.params) != MINDSPORE_NAMES:
            raise RuntimeError(f"the MindSpore twin's parameters are {list(self.params)}; expected {MINDSPORE_NAMES}")
        for name, p in self.params.items():
            ops.assign(p, Tensor(weights[TORCH_NAME[name]]))  # in place: set_data would leave compiled graphs stale
        bug, start = spec.scenario, spec.bug_from if spec.bug_from is not None else spec.steps
        rates = [LEARNING_RATE * (10 if bug == "learning rate x10" and s >= start else 1) for s in range(spec.steps)]
        decay = SteppedWeightDecay(WEIGHT_DECAY, 10.0 if bug == "weight decay x10" else 1.0, start)
        self.optimizer = nn.Momentum(self.net.trainable_params(), learning_rate=rates, momentum=MOMENTUM,
                                     weight_decay=decay)
        self.reduction = "mean"
        self.compile()

    def compile(self) -> None:
        """The forward and backward as one graph; again whenever a bug changes the model or the loss."""
        with_loss = nn.WithLossCell(self.net, nn.CrossEntropyLoss(reduction=self.reduction))
        self.gradients = ms.jit(ms.value_and_grad(with_loss, None, self.optimizer.parameters))

    def bug_on(self, step: int) -> bool:
        return self.scenario is not None and step >= self.spec.bug_from

    def start_bug(self) -> None:
        """What the bug changes once, before its first step's forward."""
        name = self.scenario.name
        if name == "model code changed":
            self.net.body[1] = nn.ReLU()
        elif name == "norm epsilon":
            for cell in (self.net.ln, self.net.body[2]):
                cell.epsilon = 1e-3
                cell.layer_norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=1e-3)
        elif name == "one layer in float16":
            self.net.body[3].__class__ = DenseInFloat16
        elif name == "loss summed":
            self.reduction = "sum"
        elif name == "weights corrupted":
            weight = self.params["body.3.weight"]
            values = weight.asnumpy().copy()
            places = np.random.default_rng([self.spec.seed, 11]).permutation(values.size)[:4]
            values.reshape(-1)[places] = 10 * np.abs(values).max()
            ops.assign(weight, Tensor(values))
        self.compile()

    def data(self, step: int) -> tuple[Tensor, Tensor]:
        bug = self.scenario.name if self.bug_on(step) else None
        inputs, labels = batch(self.spec.seed, step, "other" if bug == "new batches" else "train")
        if bug == "labels corrupted":
            labels = corrupted_labels(labels, self.spec.seed, step)
        return Tensor(inputs), Tensor(labels)

    def after_backward(self, step: int, gradients: tuple) -> tuple:
        """Bugs in the gradients between ``value_and_grad`` and ``optimizer(gradients)``, where the monitor probes."""
        name, index = self.scenario.name, {n: i for i, n in enumerate(MINDSPORE_NAMES)}
        gradients = list(gradients)
        if name == "gradients x2":
            gradients = [g * 2 for g in gradients]
        elif name == "gradient zeroed":
            gradients[index["body.3.weight"]] = ops.zeros_like(gradients[index["body.3.weight"]])
        elif name == "LayerNorm gamma's gradient x1.5":
            gradients[index["ln.gamma"]] = gradients[index["ln.gamma"]] * 1.5
        elif name == "exponent bit flip" and step == self.spec.bug_from:
            values = gradients[index["body.5.weight"]].asnumpy().copy()
            flip_exponent_bit(torch.from_numpy(values),  # shares memory with values
                              torch.randperm(values.size, generator=generator(self.spec.seed, "flip")))
            gradients[index["body.5.weight"]] = Tensor(values)
        return tuple(gradients)

    def step(self, step: int) -> str:
        if self.scenario is not None and step == self.spec.bug_from:
            self.start_bug()
        inputs, labels = self.data(step)
        _, gradients = self.gradients(inputs, labels)
        if self.bug_on(step):
            gradients = self.after_backward(step, gradients)
        digest = digest_of(g.asnumpy() for g in gradients)
        self.optimizer(gradients)
        return digest


def train_mindspore(spec: RunSpec, dump: Path) -> dict:
    training = MindSporeTraining(spec)
    monitor = MindSporeMonitor(monitor_config(dump), log_to_mlflow=False, anomaly_flags=False, silent=True,
                               statistics=[PARAMETER_NORM])
    monitor.monitor(training.optimizer)
    start = time.perf_counter()
    digests = [training.step(step) for step in range(spec.steps)]
    monitor.stop()
    return {"spec": spec.key(), "seconds": time.perf_counter() - start, "gradient_digests": digests}


# ---- which runs, and the work folder


def baseline(seed: int, plan: Plan, dtype: str = "float32") -> RunSpec:
    return RunSpec("torch", dtype, seed, plan.benign_steps)


def clean_mindspore(seed: int, plan: Plan) -> RunSpec:
    return RunSpec("mindspore", "float32", seed, plan.benign_steps)


def control(plan: Plan) -> RunSpec:
    return RunSpec("mindspore", "float32", plan.seeds[0], plan.harmful_steps, repeat=1)


def benign_pairs(plan: Plan) -> list[dict]:
    return [{"seed": seed, "a": baseline(seed, plan, dtype), "b": clean_mindspore(seed, plan)}
            for seed in plan.seeds for dtype in ("float32", "float64")]


def harmful_cases(plan: Plan) -> list[dict]:
    """Every (scenario, seed, variant): the MindSpore bug run, judged against the PyTorch float32 baseline; the
    truth against the clean MindSpore run."""
    return [{"seed": seed, "scenario": scenario.name, "variant": variant, "a": baseline(seed, plan),
             "b": RunSpec("mindspore", "float32", seed, plan.harmful_steps, scenario.name,
                          plan.bug_step if variant == VARIANTS[0] else 0),
             "clean": clean_mindspore(seed, plan)}
            for seed in plan.seeds for scenario in SCENARIOS for variant in VARIANTS]


class Work:
    """The work folder: ``dumps/<run>/`` and ``runs/<run>.json`` (written once the dump is complete)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def dump(self, spec: RunSpec) -> Path:
        return self.folder / "dumps" / spec.name

    def record(self, spec: RunSpec) -> dict | None:
        path = self.folder / "runs" / f"{spec.name}.json"
        if not path.exists():
            return None
        record = json.loads(path.read_text())
        return record if record["spec"] == spec.key() else None

    def save(self, spec: RunSpec, record: dict) -> None:
        path = self.folder / "runs" / f"{spec.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))


def machine() -> str:
    return (f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__} on "
            f"{torch.get_num_threads()} thread(s), MindSpore {ms.__version__} (PyNative, CPU), Python "
            f"{platform.python_version()}")


def generate(work: Work, plan: Plan) -> dict:
    """Trains every run whose complete dump is not in the work folder yet."""
    specs = [s for pair in benign_pairs(plan) for s in (pair["a"], pair["b"])]
    specs = list(dict.fromkeys(specs + [c["b"] for c in harmful_cases(plan)] + [control(plan)]))
    load_before, start, trained = os.getloadavg(), time.perf_counter(), 0
    for index, spec in enumerate(specs, 1):
        if work.record(spec) is None:
            dump = work.dump(spec)
            shutil.rmtree(dump, ignore_errors=True)
            record = (train_torch if spec.framework == "torch" else train_mindspore)(spec, dump)
            work.save(spec, record)
            trained += 1
            progress(f"generate {index}/{len(specs)}: {spec.name} ({record['seconds']:.1f} s)")
    summary = {"runs": len(specs), "trained_now": trained, "seconds_now": time.perf_counter() - start,
               "training_seconds_all_runs": sum(work.record(s)["seconds"] for s in specs),
               "steps_all_runs": sum(s.steps for s in specs), "load_before": load_before,
               "load_after": os.getloadavg(), "machine": machine(), "package": package_provenance(),
               "date": datetime.datetime.now().isoformat(timespec="seconds")}
    if trained or not (work.folder / "generate.json").exists():  # a call that only found the cache keeps the last
        (work.folder / "generate.json").write_text(json.dumps(summary, indent=1))
    progress(f"generate: {len(specs)} runs ({trained} trained now, {summary['seconds_now']:.0f} s)")
    return summary


# ---- evaluation


def effect_and_pair_difference(work: Work, row: dict) -> tuple[float, float]:
    """At the truth's step: the bug's effect (the bug run against the clean MindSpore run) and the pair's own
    difference (the clean MindSpore run against the PyTorch baseline), each as :func:`largest_change`. Issue 47's
    decision 1: a bug whose effect is below the pair's own difference does not count against the exact-step line."""
    clean = recorded_statistics(work.dump(row["clean"]), row["truth"], TORCH_NAME)
    return (largest_change(clean, recorded_statistics(work.dump(row["b"]), row["truth"], TORCH_NAME)),
            largest_change(recorded_statistics(work.dump(row["a"]), row["truth"], TORCH_NAME), clean))


def verdict_of(dump_a: Path, dump_b: Path, rule: str) -> dict:
    options = {"rule": "noise", "precision": "float32"} if rule == "noise, precision float32" else {"rule": rule}
    comparison = compare_dumps(dump_a, dump_b, None, plots=False, progress=False, **options)
    verdict, rank = comparison.verdict, comparison.verdict.ranks[0]
    return {"step": rank.first_suspicious_step, "grade": verdict.grade, "rank_grade": rank.grade,
            "evidence": rank.evidence or None, "culprits": [t.name for t in rank.parameter_trips],
            "partial": verdict.partial, "recorded_precision": rank.recorded_precision,
            "describe": verdict.describe() if rank.first_suspicious_step is not None or verdict.partial else None}


def verdicts(pairs: list[tuple[Path, Path, str]], jobs: int) -> list[dict]:
    """``verdict_of`` for every (A, B, rule) on ``jobs`` processes (spawned: MindSpore's threads do not fork)."""
    found = []
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for index, verdict in enumerate(pool.map(verdict_of, *zip(*pairs), chunksize=2), 1):
            found.append(verdict)
            if index % 20 == 0 or index == len(pairs):
                progress(f"evaluate: {index}/{len(pairs)} comparisons")
    return found


def evaluate(work: Work, plan: Plan, jobs: int) -> dict:
    load_before, start = os.getloadavg(), time.perf_counter()
    benign, harmful = benign_pairs(plan), harmful_cases(plan)
    for spec in {s for row in benign + harmful for s in (row["a"], row["b"])} | {control(plan)}:
        if work.record(spec) is None:
            raise SystemExit(f"{work.dump(spec)}: missing or incomplete; run generate first")
    truth = Truth(work)
    for row in harmful:
        scenario = SCENARIO_BY_NAME[row["scenario"]]
        row.update(category=scenario.category, magnitude=scenario.magnitude, bug_from=row["b"].bug_from,
                   culprits=scenario.culprits, feeding=scenario.feeding,
                   truth=truth.first_difference(row["b"], row["clean"]),
                   exact_truth=truth.exact_first_difference(row["b"], row["clean"]))
        if row["truth"] is not None:
            row["effect"], row["pair_difference"] = effect_and_pair_difference(work, row)
            row["beyond_pair"] = row["effect"] > row["pair_difference"]
    reproducible = truth.first_difference(control(plan), clean_mindspore(plan.seeds[0], plan)) is None
    judged = [(row, rule) for row in benign + [r for r in harmful if r["truth"] is not None] for rule in RULES]
    found = verdicts([(work.dump(row["a"]), work.dump(row["b"]), rule) for row, rule in judged], jobs)
    for (row, rule), verdict in zip(judged, found):
        if "truth" in row:
            verdict["outcome"] = outcome(row["truth"], verdict["step"])
            if row["culprits"] is not None:
                verdict["culprit_in_top3"] = bool(set(verdict["culprits"][:3]) & set(row["culprits"]))
                verdict["culprit_or_feeding_in_top3"] = bool(set(verdict["culprits"][:3])
                                                             & set(row["culprits"] + row["feeding"]))
        verdict["culprits"] = verdict["culprits"][:5]
        row.setdefault("verdicts", {})[rule] = verdict
    for row in benign + harmful:
        row["a"], row["b"] = row["a"].name, row["b"].name
        row.pop("clean", None)
    generated = work.folder / "generate.json"
    result = {"command": " ".join(["benchmarks/cross_framework_benchmark.py"] + sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
              "package": package_provenance(), "family": FAMILY, "held_out": True,
              "plan": dataclasses.asdict(plan), "rules": list(RULES),
              "scenarios": [dataclasses.asdict(s) for s in SCENARIOS],
              "generate": json.loads(generated.read_text()) if generated.exists() else None,
              "control_reproducible": reproducible, "benign": benign, "harmful": harmful}
    result["summary"] = {rule: summarize(result, rule) for rule in RULES}
    result["evaluate"] = {"seconds": time.perf_counter() - start, "load_before": load_before,
                          "load_after": os.getloadavg()}
    return result


def rate(rows: list[dict], rule: str, key: str = "outcome", wanted="exact") -> list[int]:
    return [sum(r["verdicts"][rule].get(key) == wanted for r in rows), len(rows)]


def summarize(result: dict, rule: str) -> dict:
    harmful = [r for r in result["harmful"] if r["truth"] is not None]
    beyond = [r for r in harmful if r["beyond_pair"]]
    judged = [(r, r["verdicts"][rule]) for r in harmful]
    benign = [(r, r["verdicts"][rule]) for r in result["benign"]]
    off = {kind: [abs(v["step"] - r["truth"]) for r, v in judged if v["outcome"] == kind] for kind in ("early", "late")}
    localized = [r for r in harmful if r["culprits"] is not None]
    compared = [r["verdicts"][rule] for r in result["benign"] + harmful]
    return {
        "benign_pairs": len(benign),
        "benign_alarms": [sum(v["step"] is not None for _, v in benign), len(benign)],
        "benign_alarm_steps": [v["step"] for _, v in benign if v["step"] is not None],
        "benign_breaks": sum(v["grade"] == "break" for _, v in benign),
        "benign_departures": sum(v["grade"] == "departure" for _, v in benign),
        "exact": rate(harmful, rule),
        "exact_as_break": [sum(v["outcome"] == "exact" and v["grade"] == "break" for _, v in judged), len(judged)],
        "beyond_pair": [len(beyond), len(harmful)],
        "exact_beyond_pair": rate(beyond, rule),
        "exact_as_break_beyond_pair": [sum(r["verdicts"][rule]["outcome"] == "exact"
                                           and r["verdicts"][rule]["grade"] == "break" for r in beyond), len(beyond)],
        "exact_below_pair": rate([r for r in harmful if not r["beyond_pair"]], rule),
        "exact_by_variant": {variant: rate([r for r in harmful if r["variant"] == variant], rule)
                             for variant in VARIANTS},
        "exact_by_category": {c: rate([r for r in harmful if r["category"] == c], rule)
                              for c in dict.fromkeys(s.category for s in SCENARIOS)},
        "exact_magnitude_bugs": rate([r for r in harmful if r["magnitude"]], rule),
        "steps_early": off["early"], "steps_late": off["late"],
        "missed": sum(v["outcome"] == "missed" for _, v in judged),
        "culprit_in_top3": rate(localized, rule, "culprit_in_top3", True),
        "culprit_or_feeding_in_top3": rate(localized, rule, "culprit_or_feeding_in_top3", True),
        "every_parameter_paired": [sum(v["partial"] is None for v in compared), len(compared)],
    }


# ---- the report


def share(pair: list[int]) -> float:
    return pair[0] / pair[1] if pair[1] else float("nan")


def summary_rows(summary: dict) -> list[list]:
    """One row per measure: each rule's figure, then issue 47's done-when line for it and whether the default rule
    meets it."""
    noise = summary["noise"]

    def row(label, figure, line="", met=None):
        return [label] + [figure(summary[r]) for r in RULES] + [line, "" if met is None else "yes" if met else "**no**"]
    benign = noise["benign_pairs"]
    return [
        row("benign pairs with an alarm (at steps)",
            lambda s: f"{s['benign_alarms'][0]}/{s['benign_alarms'][1]}"
                      + (f" ({', '.join(map(str, s['benign_alarm_steps']))})" if s["benign_alarm_steps"] else "")),
        row("benign pairs with a *break*", lambda s: f"{s['benign_breaks']}/{s['benign_pairs']}", "0",
            noise["benign_breaks"] == 0),
        row("benign pairs with a *departure*", lambda s: f"{s['benign_departures']}/{s['benign_pairs']}",
            "at most 5%", noise["benign_departures"] <= 0.05 * benign),
        row("harmful cases named at the exact step (any grade)", lambda s: fraction(s["exact"])),
        row("... as a *break*", lambda s: fraction(s["exact_as_break"])),
        *[row(f"... {variant}", lambda s, v=variant: fraction(s["exact_by_variant"][v])) for variant in VARIANTS],
        row("... magnitude-only bugs (signs intact at their step)", lambda s: fraction(s["exact_magnitude_bugs"])),
        row("early (steps early)", lambda s: steps_off(s["steps_early"])),
        row("late (steps late)", lambda s: steps_off(s["steps_late"])),
        row("missed (never suspicious)", lambda s: s["missed"]),
        row("harmful cases whose effect exceeds the pair's own difference at their step",
            lambda s: fraction(s["beyond_pair"])),
        row("... named at the exact step (any grade)", lambda s: fraction(s["exact_beyond_pair"]), "at least 95%",
            share(noise["exact_beyond_pair"]) >= 0.95),
        row("... ... as a *break*", lambda s: fraction(s["exact_as_break_beyond_pair"]), "at least 80%",
            share(noise["exact_as_break_beyond_pair"]) >= 0.80),
        row("harmful cases whose effect is within the pair's own difference: named at the exact step",
            lambda s: fraction(s["exact_below_pair"])),
        row("culprit in the top 3, localized bugs", lambda s: fraction(s["culprit_in_top3"]), "at least 90%",
            share(noise["culprit_in_top3"]) >= 0.90),
        row("... or the layer feeding it (forward-pass bugs show there first)",
            lambda s: fraction(s["culprit_or_feeding_in_top3"])),
        row("comparisons with every parameter paired, no name map (`verdict.partial` None)",
            lambda s: fraction(s["every_parameter_paired"]), "every one", share(noise["every_parameter_paired"]) == 1),
    ]


def describe(verdict: dict) -> str:
    if verdict["step"] is None:
        return "none"
    grade = f" {verdict['grade']}" if verdict["grade"] else ""
    shown = verdict["culprits"][:3]
    return f"{verdict['step']}{grade}" + (f" ({', '.join(shown)})" if shown else "")


def markdown(result: dict) -> str:
    summary, plan, generated = result["summary"], result["plan"], result["generate"] or {}
    valid = [r for r in result["harmful"] if r["truth"] is not None]
    invalid = [r for r in result["harmful"] if r["truth"] is None]
    lines = ["# Cross-framework benchmark: MindSpore against its PyTorch twin, no name map", "",
             f"Produced by `{result['command']}` on {result['date']}; {result['machine']}; judged by "
             f"{result['package']}; trained by {generated.get('package', '?')} (training finished "
             f"{generated.get('date', '?')}). "
             f"Design and scenarios: `benchmarks/cross_framework_benchmark.py`'s docstring (issue 47, item 6). "
             f"Family `{result['family']}`, **held out**: declared before it was measured, never used to tune the "
             f"rule. Rules: " + ", ".join(f"`{r}`" for r in result["rules"]) + " (each judged the same dumps).", "",
             f"Runs: {generated.get('runs', '?')} trainings ({generated.get('steps_all_runs', '?')} steps, "
             f"{generated.get('training_seconds_all_runs', 0) / 60:.1f} min of training in all); seeds "
             f"{tuple(plan['seeds'])}; benign pairs {plan['benign_steps']} steps (MindSpore float32 against PyTorch "
             f"float32, the baseline, and against PyTorch float64); harmful scenarios {plan['harmful_steps']} steps on "
             f"the MindSpore side with the bug from step {plan['bug_step']} or 0, judged against the PyTorch float32 "
             f"baseline; {len(result['benign'])} benign pairs, {len(result['harmful'])} harmful cases of which "
             f"{len(invalid)} invalid (their gradients never differ from the clean run's). Control: the clean "
             f"MindSpore run trained twice is "
             f"{'identical (reproducible)' if result['control_reproducible'] else '**not identical**'}. Training "
             f"took {generated.get('seconds_now', 0):.0f} s, evaluation {result['evaluate']['seconds']:.0f} s; load "
             f"average (1, 5, 15 min) before and after: generate {load(generated.get('load_before'))} -> "
             f"{load(generated.get('load_after'))}, evaluate {load(result['evaluate']['load_before'])} -> "
             f"{load(result['evaluate']['load_after'])} (2 CPUs shared with other work: durations are indicative).",
             "",
             "The truth is the first step at which the MindSpore bug run's recorded gradients (summary CSV bytes, "
             "direction bits) differ from the clean MindSpore run's; *exact*: the rule's first suspicious step is that "
             "step; *early* includes alarms raised by the frameworks' rounding alone. Culprits are PyTorch's names "
             "(side A); the MindSpore names they were paired with are in the docstring. *Effect*: the largest change "
             "the bug made to the recorded statistics (max, min, norm) of any parameter's gradient at the truth's "
             "step, "
             "against the clean MindSpore run, in units of that gradient's norm; *pair's difference*: the same "
             "measure between the clean MindSpore run and the PyTorch baseline at that step (issue 47's decision 1: "
             "a bug whose effect is within it does not count against the exact-step line).", "",
             "## Summary (held out)", ""]
    lines += table(["metric"] + [f"rule `{r}`" for r in RULES] + ["issue 47 done-when", "met (`noise`)"],
                   summary_rows(summary))
    lines += ["## Exact step by category", ""]
    lines += table(["category"] + list(RULES), [[c] + [fraction(summary[r]["exact_by_category"][c]) for r in RULES]
                                                for c in summary[RULES[0]]["exact_by_category"]])
    lines += ["## Benign pairs (first suspicious step and grade; none: no alarm)", ""]
    lines += table(["seed", "A", "B", "steps", "every parameter paired"] + list(RULES),
                   [[r["seed"], r["a"].rsplit("-", 1)[0], r["b"].rsplit("-", 1)[0], plan["benign_steps"],
                     r["verdicts"]["noise"]["partial"] or "yes"] + [describe(r["verdicts"][rule]) for rule in RULES]
                    for r in result["benign"]])
    lines += ["## Harmful scenarios: exact step per variant (seeds together)", ""]
    rows = []
    for scenario in result["scenarios"]:
        of = [r for r in valid if r["scenario"] == scenario["name"]]
        row = [scenario["name"] + (" (magnitude)" if scenario["magnitude"] else ""), scenario["category"],
               ", ".join(scenario["culprits"]) if scenario["culprits"] else "not localized"]
        for variant in VARIANTS:
            in_variant = [r for r in of if r["variant"] == variant]
            row += [fraction(rate(in_variant, rule)).split(" ")[0] for rule in RULES]
        exact = [r["verdicts"]["noise"] for r in of if r["verdicts"]["noise"]["outcome"] == "exact"]
        row.append(", ".join(f"{grade} {sum(v['grade'] == grade for v in exact)}" for grade in ("break", "departure")))
        rows.append(row)
    lines += table(["scenario", "category", "culprits (torch names)"]
                   + [f"{variant}: {rule}" for variant in VARIANTS for rule in RULES]
                   + ["grade at the exact step (`noise`)"], rows)
    missed = [r for r in valid if r["verdicts"]["noise"]["outcome"] != "exact"
              or r["verdicts"]["noise"].get("culprit_in_top3") is False]
    lines += ["## Cases the `noise` rule did not name at the exact step, or without the culprit in its top 3", ""]
    if missed:
        lines += table(["scenario", "seed", "variant", "truth", "effect", "pair's difference"] + list(RULES),
                       [[r["scenario"], r["seed"], r["variant"], r["truth"], f"{r['effect']:.1e}",
                         f"{r['pair_difference']:.1e}"] + [describe(r["verdicts"][rule]) for rule in RULES]
                        for r in missed])
    else:
        lines += ["None.", ""]
    if invalid:
        lines += ["## Invalid cases (gradients identical to the clean run's at every step: not counted)", ""]
        lines += table(["scenario", "seed", "variant"], [[r["scenario"], r["seed"], r["variant"]] for r in invalid])
    differs = [r for r in result["harmful"] if r["truth"] != r["exact_truth"]]
    if differs:
        lines += ["## Cases whose exact gradients differ before the recorded ones", ""]
        lines += table(["scenario", "seed", "variant", "recorded", "exact"],
                       [[r["scenario"], r["seed"], r["variant"], r["truth"], r["exact_truth"]] for r in differs])
    lines += ["Reproduce: `benchmarks/run-cross-framework` (the dev venv; the dumps stay in `/tmp/cross_framework`, "
              "so a second run only evaluates); `benchmarks/run-cross-framework evaluate` judges the cached dumps "
              "again.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("phase", nargs="?", default="all", choices=("generate", "evaluate", "all"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/cross_framework"), help="where the dumps are cached")
    parser.add_argument("--quick", action="store_true", help="1 seed, short runs: a dry run; results go into --work, "
                        "not benchmarks/results")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="evaluate's comparison processes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same bits in every run: the truth compares runs bit for bit
    logging.getLogger("msprobe_mlflow").setLevel(logging.ERROR)
    plan = QUICK if args.quick else Plan()
    work = Work((args.work / "quick" if args.quick else args.work).resolve())
    out = work.folder if args.quick else args.out.resolve()
    work.folder.mkdir(parents=True, exist_ok=True)
    os.chdir(work.folder)  # MindSpore's compiler reports land here
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    if args.phase in ("generate", "all"):
        generate(work, plan)
    if args.phase in ("evaluate", "all"):
        result = evaluate(work, plan, args.jobs)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cross_framework.json").write_text(json.dumps(result, indent=1))
        (out / "cross_framework.md").write_text(markdown(result))
        print(markdown(result))
        progress(f"wrote {out / 'cross_framework.json'} and {out / 'cross_framework.md'}")


if __name__ == "__main__":
    main()
