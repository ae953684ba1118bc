"""Lightning: the callback (and autolog) log into ``MLFlowLogger``'s run, one run per training, and record the
gradients the optimizer applies under automatic optimization with accumulation and clipping: measured here,
independently, from the SGD update itself (``(before - after) / lr``, float64)."""
from __future__ import annotations

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

pytest.importorskip("lightning")
import lightning.pytorch as lightning  # noqa: E402
from lightning.pytorch.loggers import MLFlowLogger  # noqa: E402

import msprobe_mlflow  # noqa: E402
from msprobe_mlflow import GradProbeConfig  # noqa: E402
from msprobe_mlflow.dump import read_summary  # noqa: E402
from msprobe_mlflow.integrations.lightning import GradientProbeCallback  # noqa: E402

LR = 0.5
CLIP = 0.05
BATCHES = 6  # 3 optimizer steps of 2 accumulated micro-batches


class Regression(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))

    def training_step(self, batch, index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class AppliedGradients(lightning.Callback):
    """Snapshots the parameters before every batch and at the end: each optimizer step's applied gradient."""

    def __init__(self):
        self.snapshots = []
        self.norms_before_clipping = []

    def on_before_optimizer_step(self, trainer, module, optimizer):  # Lightning clips right after this hook
        grads = [p.grad.detach().double().numpy() for p in module.parameters()]
        self.norms_before_clipping.append(float(np.sqrt(sum(np.sum(g * g) for g in grads))))

    def on_train_batch_start(self, trainer, module, batch, index):
        self.snapshots.append([p.detach().double().clone() for p in module.parameters()])

    def on_train_end(self, trainer, module):
        self.snapshots.append([p.detach().double().clone() for p in module.parameters()])

    def norms(self, step: int) -> list[float]:
        before, after = self.snapshots[2 * step], self.snapshots[2 * step + 2]
        return [float(np.linalg.norm(((b - a) / LR).numpy())) for b, a in zip(before, after)]


def loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(BATCHES * 4, 4, generator=generator), 5 * torch.randn(BATCHES * 4, 2, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def fit(tracking_uri: str, experiment: str, callbacks: list, module: Regression | None = None,
        **trainer_options) -> tuple[MLFlowLogger, AppliedGradients]:
    applied = AppliedGradients()
    logger = MLFlowLogger(experiment_name=experiment, tracking_uri=tracking_uri)
    trainer = lightning.Trainer(max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=CLIP, logger=logger,
                                callbacks=[applied, *callbacks], accelerator="cpu", devices=1,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                log_every_n_steps=1, **trainer_options)
    trainer.fit(module or Regression(), loader())
    return logger, applied


def assert_applied_gradients_recorded(dump, applied: AppliedGradients) -> None:
    steps = BATCHES // 2
    assert sorted(p.name for p in (dump / "rank0").glob("*.csv")) == [f"grad_summary_{s}.csv" for s in range(steps)]
    for step in range(steps):
        table = read_summary(dump / "rank0" / f"grad_summary_{step}.csv")
        assert table.column("param_name") == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
        np.testing.assert_allclose(table.numbers("norm"), applied.norms(step), rtol=2e-5)
        assert np.linalg.norm(table.numbers("norm")) == pytest.approx(CLIP, rel=1e-4)  # clipped, as applied


def assert_one_run_with_every_step(tracking_uri: str, experiment: str, run_id: str) -> None:
    client = MlflowClient(tracking_uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    assert [r.info.run_id for r in client.search_runs([experiment_id])] == [run_id]
    history = client.get_metric_history(run_id, "grad/rank0/total_norm")
    assert [m.step for m in history] == [0, 1, 2]
    assert "loss" in client.get_run(run_id).data.metrics  # Lightning's own metrics, same run
    files = [f.path for f in client.list_artifacts(run_id, "grad_probe/rank0")]
    assert sum(path.endswith(".csv") for path in files) == 3


def test_lightning_callback_records_the_accumulated_clipped_gradients_into_the_loggers_run(tmp_path, tmp_sqlite_uri):
    config = GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1")
    logger, applied = fit(tmp_sqlite_uri, "lightning-callback", [GradientProbeCallback(config)])
    assert_applied_gradients_recorded(tmp_path / "dump", applied)
    assert_one_run_with_every_step(tmp_sqlite_uri, "lightning-callback", logger.run_id)
    client = MlflowClient(tmp_sqlite_uri)
    tags = client.get_run(logger.run_id).data.tags
    assert tags["msprobe_mlflow.gradients_recorded"] == \
        f"after clipping (gradient_clip_val={CLIP}); total_norm_before_clipping is the norm before clipping"
    # Beside total_norm, flat at the clip value, the norm the gradients had before clipping, measured here by hand.
    before = client.get_metric_history(logger.run_id, "grad/rank0/total_norm_before_clipping")
    assert [m.step for m in before] == [0, 1, 2]
    assert [m.value for m in before] == pytest.approx(applied.norms_before_clipping, rel=1e-5)
    assert min(applied.norms_before_clipping) > 2 * CLIP  # clipped at every step: the two charts differ


class ClippedWithoutClipGradNorm(Regression):
    """Clips by norm as accelerate 1.16 does: ``get_total_norm`` and ``clip_grads_with_norm_``, never
    ``torch.nn.utils.clip_grad_norm_``."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        parameters = list(self.parameters())
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        torch.nn.utils.clip_grads_with_norm_(parameters, gradient_clip_val, norm)


def test_a_norm_before_clipping_that_was_never_logged_is_not_announced_and_is_warned_about(tmp_path, tmp_sqlite_uri):
    """Before, the run's tag announced total_norm_before_clipping from the start, logged or not."""
    config = GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1")
    with pytest.warns(UserWarning, match=r"total_norm_before_clipping was not logged \(nor announced in the run's "
                                         r"tag\): no torch\.nn\.utils\.clip_grad_norm_ call returned a norm for the "
                                         r"model's parameters"):
        logger, applied = fit(tmp_sqlite_uri, "lightning-own-clipping", [GradientProbeCallback(config)],
                              ClippedWithoutClipGradNorm())
    assert_applied_gradients_recorded(tmp_path / "dump", applied)  # clipped, by the module's own code
    run = MlflowClient(tmp_sqlite_uri).get_run(logger.run_id)
    assert run.data.tags["msprobe_mlflow.gradients_recorded"] == f"after clipping (gradient_clip_val={CLIP})"
    assert "grad/rank0/total_norm_before_clipping" not in run.data.metrics


def test_clipping_by_value_is_tagged_as_such_with_no_norm_before_clipping(tmp_path, tmp_sqlite_uri):
    """``gradient_clip_algorithm="value"``: no norm is computed, so none is announced (before, the tag said it was
    logged); the recorded gradients are the clipped ones, each element within the clip value."""
    config = GradProbeConfig(dump_path=str(tmp_path / "dump"), level="L1")
    logger, applied = fit(tmp_sqlite_uri, "lightning-by-value", [GradientProbeCallback(config)],
                          gradient_clip_algorithm="value")
    for step in range(BATCHES // 2):
        table = read_summary(tmp_path / "dump/rank0" / f"grad_summary_{step}.csv")
        np.testing.assert_allclose(table.numbers("norm"), applied.norms(step), rtol=2e-5)
        assert max(np.abs(table.numbers("max")).max(), np.abs(table.numbers("min")).max()) <= CLIP * (1 + 1e-6)
    run = MlflowClient(tmp_sqlite_uri).get_run(logger.run_id)
    assert run.data.tags["msprobe_mlflow.gradients_recorded"] == f"after clipping (gradient_clip_val={CLIP}, by value)"
    assert "grad/rank0/total_norm_before_clipping" not in run.data.metrics


def test_autolog_finds_the_loggers_run(tmp_path, tmp_sqlite_uri):
    msprobe_mlflow.autolog(dump_path=str(tmp_path / "dump"))
    try:
        logger, applied = fit(tmp_sqlite_uri, "lightning-autolog", [])
        assert mlflow.active_run() is None
    finally:
        msprobe_mlflow.autolog(disable=True)  # stops (flushes) the monitors autolog started
    assert_applied_gradients_recorded(tmp_path / "dump" / logger.run_id, applied)
    assert_one_run_with_every_step(tmp_sqlite_uri, "lightning-autolog", logger.run_id)


@pytest.mark.parametrize("config, options, refused", [
    ({"task": "grad_probe"}, {}, r"config: dump_path = None is not accepted; expected a folder path \(the key is "
                                 r"missing\)"),
    (None, {"log_every_n_steps": 0}, r"log_every_n_steps = 0 is not accepted; expected an integer >= 1"),
])
def test_a_bad_config_or_option_is_refused_when_the_callback_is_made_leaving_no_run(config, options, refused,
                                                                                     tmp_sqlite_uri):
    """Made inside the user's fit(...) call: before the fix the error came at on_train_start, after the
    MLFlowLogger had created its run, which was left behind."""
    with pytest.raises(ValueError, match=refused):
        fit(tmp_sqlite_uri, "lightning-bad-config", [GradientProbeCallback(config, **options)])
    experiment = MlflowClient(tmp_sqlite_uri).get_experiment_by_name("lightning-bad-config")
    assert experiment is None or MlflowClient(tmp_sqlite_uri).search_runs([experiment.experiment_id]) == []
