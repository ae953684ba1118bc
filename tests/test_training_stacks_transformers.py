"""Hugging Face Trainer with the callback: one run (Trainer's own), one record per optimizer step with gradient
accumulation, tied weights once, and the recorded norms are those of the gradients the optimizer applied, measured
independently from the SGD update (``(before - after) / lr``, float64). A tiny GPT-2 from a config, no download."""
from __future__ import annotations

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from msprobe_mlflow import GradProbeConfig  # noqa: E402
from msprobe_mlflow.dump import read_summary  # noqa: E402
from msprobe_mlflow.integrations.transformers import GradientProbeCallback  # noqa: E402
from msprobe_mlflow.tracking.upload import upload_dump  # noqa: E402

LR = 0.1
STEPS = 3


class AppliedGradients(transformers.TrainerCallback):
    """Parameters at the start and after each optimizer step: each step's applied gradient, by eager name."""

    def __init__(self):
        self.snapshots = []

    def snapshot(self, model):
        self.snapshots.append({n: p.detach().double().clone() for n, p in model.named_parameters()})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.snapshot(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.snapshot(model)

    def norms(self, step: int) -> dict[str, float]:
        before, after = self.snapshots[step], self.snapshots[step + 1]
        return {n: float(np.linalg.norm(((before[n] - after[n]) / LR).numpy())) for n in before}


def test_trainer_callback_records_each_optimizer_step_into_trainers_run(tmp_path, tmp_experiment, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=97, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).double()  # float64: the update gives the gradient exactly
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 97, (16, 12), generator=generator)
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=LR, optim="sgd", lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, report_to=["mlflow"], logging_steps=1, save_strategy="no",
        use_cpu=True, disable_tqdm=True)
    applied = AppliedGradients()
    probe = GradientProbeCallback(GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1"))
    clip_grad_norm_ = accelerate.Accelerator.clip_grad_norm_
    transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[applied, probe]).train()

    client = MlflowClient()
    (run,) = client.search_runs([tmp_experiment])
    assert run.info.run_id == probe.monitor.run_id and mlflow.active_run() is None
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names  # tied: once, under the first name
    assert sorted(p.name for p in (tmp_path / "dump/rank0").glob("*.csv")) == \
        [f"grad_summary_{s}.csv" for s in range(STEPS)]
    for step in range(STEPS):
        table = read_summary(tmp_path / "dump/rank0" / f"grad_summary_{step}.csv")
        assert table.column("param_name") == names
        expected = applied.norms(step)
        np.testing.assert_allclose(table.numbers("norm"), [expected[n] for n in names], rtol=1e-5, atol=1e-12)
        assert np.linalg.norm(table.numbers("norm")) <= 1.0 + 1e-5  # max_grad_norm=1.0: the clipped gradients
    # In MLflow, at Trainer's step numbers (the dump's step S is global_step S + 1): before, total_norm was at 0-2.
    history = {key: client.get_metric_history(run.info.run_id, key) for key in (
        "grad/rank0/total_norm", "grad/rank0/total_norm_before_clipping", "grad_norm")}
    assert {key: [m.step for m in values] for key, values in history.items()} == {
        key: [1, 2, 3] for key in history}
    # Beside the flat clipped norm, the norm before clipping: Trainer's own grad_norm, step by step (before, with
    # accelerate 1.16, which clips without torch.nn.utils.clip_grad_norm_, none was logged, but the tag announced it).
    trainers = [m.value for m in history["grad_norm"]]
    before = [m.value for m in history["grad/rank0/total_norm_before_clipping"]]
    assert before == pytest.approx(trainers, rel=1e-12) and min(before) > 1.0  # every step was clipped
    assert [m.value for m in history["grad/rank0/total_norm"]] == pytest.approx([1.0] * STEPS, rel=1e-5)
    assert run.data.tags["msprobe_mlflow.gradients_recorded"] == (
        "after clipping (max_grad_norm=1.0); total_norm_before_clipping is the norm before clipping (Trainer's "
        "grad_norm); MLflow step S+1 is the dump's step S")
    assert accelerate.Accelerator.clip_grad_norm_ is clip_grad_norm_  # given back at the end
    # upload of the same dump into the run adds nothing: it reads the run's step offset (else step 0 came again)
    assert upload_dump(tmp_path / "dump", run.info.run_id).metrics_logged == 0
    files = [f.path for f in client.list_artifacts(run.info.run_id, "grad_probe/rank0")]
    assert sum(path.endswith(".csv") for path in files) == STEPS


@pytest.mark.parametrize("config, options, refused", [
    ({"task": "grad_probe"}, {}, r"config: dump_path = None is not accepted; expected a folder path \(the key is "
                                 r"missing\)"),
    (None, {"log_every_n_steps": 0}, r"log_every_n_steps = 0 is not accepted; expected an integer >= 1"),
])
def test_a_bad_config_or_option_is_refused_when_the_callback_is_made_leaving_no_run(config, options, refused,
                                                                                     tmp_path, tmp_experiment):
    """Made inside the user's Trainer(...) call: before the fix the error came at on_train_begin, after Trainer's
    MLflowCallback had opened its run, which was left behind, empty."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=11,
                                                                 n_positions=8))
    tokens = torch.zeros(2, 8, dtype=torch.long)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to=["mlflow"],
                                          save_strategy="no", use_cpu=True, disable_tqdm=True)
    with pytest.raises(ValueError, match=refused):
        transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
                             callbacks=[GradientProbeCallback(config, **options)]).train()
    assert MlflowClient().search_runs([tmp_experiment]) == [] and mlflow.active_run() is None
