"""Writes tests/data/msprobe_dumps/{a,b,c}: msprobe 1.0.3's own statistics dumps (level mix) of step 2 of the tiny
transformer; B with every weight one ulp up and a faulty GELU kernel (the second call's output at step 2 1% off);
C with every weight 1e-4 larger (a benign pair whose activations differ well beyond rounding).
Both runs' aten::gelu is the same Python kernel (torch.library), B's being faulty: msprobe's hooks next to a
TorchDispatchMode crash this torch.
Run with msprobe 1.0.3 installed (benchmarks/setup-env): benchmarks/.venv/bin/python tests/data/make_msprobe_dumps.py
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from msprobe.pytorch import PrecisionDebugger

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.tiny_transformer import TinyGPT, one_ulp_up, train  # noqa: E402

HERE = Path(__file__).resolve().parent / "msprobe_dumps"


class GeluKernel:
    """aten::gelu on the CPU, its ``number``-th call while armed ``1 + error`` off."""

    def __init__(self, number: int, error: float):
        self.number, self.error, self.armed, self.calls = number, error, False, 0

    def __call__(self, x, approximate="none"):
        y = 0.5 * x * (1 + torch.erf(x * 0.7071067811865476))
        if self.armed:
            y = y * (1 + self.error) if self.calls == self.number else y
            self.calls += 1
        return y


def dump(name: str, fault: GeluKernel) -> None:
    folder = HERE / name
    shutil.rmtree(folder, ignore_errors=True)
    HERE.mkdir(parents=True, exist_ok=True)
    config = HERE / f"{name}.config.json"
    config.write_text(json.dumps({"task": "statistics", "dump_path": str(folder), "rank": [], "step": [2],
                                  "level": "mix", "seed": 1234, "is_deterministic": False,
                                  "statistics": {"scope": [], "list": [], "data_mode": ["all"],
                                                 "summary_mode": "statistics"}}))
    torch.manual_seed(0)
    model = TinyGPT()
    if name == "b":
        one_ulp_up(model)
    if name == "c":
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1 + 1e-4)
    debugger = PrecisionDebugger(config_path=str(config), model=model)
    config.unlink()

    def on_step(step, phase, _):
        if phase == "start":
            debugger.start()
            fault.armed = step == 2
        else:
            debugger.stop()
            debugger.step()

    library = torch.library.Library("aten", "IMPL")
    library.impl("gelu", fault, "CPU")
    train(3, on_step=on_step, model=model)
    for path in folder.rglob("*.json"):  # the machine's paths out of the stacks
        text = path.read_text().replace(str(Path(sys.prefix)), "<venv>")
        path.write_text(text.replace(str(Path(__file__).resolve().parents[2]), "<repo>"))


if len(sys.argv) == 1:  # msprobe's debugger is one per process: each dump in its own
    for name in ("a", "b", "c"):
        subprocess.run([sys.executable, __file__, name], check=True)
else:
    dump(sys.argv[1], GeluKernel(1, 1e-2 if sys.argv[1] == "b" else 0.0))
