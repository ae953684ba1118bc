"""MindSpore's ``GradProbeCallback`` refuses a bad config or option when it is made, inside the user's
``model.train(...)`` call, before the callback could start an MLflow run (real MindSpore, CPU): no run is left."""
from __future__ import annotations

import mlflow
import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed (the torch-only stage)")
from mlflow.tracking import MlflowClient  # noqa: E402

from mindspore_training import batches, dense, sgd_model  # noqa: E402
from msprobe_mlflow.mindspore import GradProbeCallback  # noqa: E402


@pytest.mark.parametrize("config, options, refused", [
    ({"task": "grad_probe"}, {}, r"config: dump_path = None is not accepted; expected a folder path \(the key is "
                                 r"missing\)"),
    ({"task": "grad_probe", "dump_path": "dump"}, {"log_every_n_steps": 0},
     r"log_every_n_steps = 0 is not accepted; expected an integer >= 1"),
])
def test_a_bad_config_or_option_is_refused_when_the_callback_is_made_leaving_no_run(config, options, refused,
                                                                                     tmp_experiment):
    model = sgd_model(dense())
    with pytest.raises(ValueError, match=refused):
        model.train(1, batches(), callbacks=[GradProbeCallback(config, **options)], dataset_sink_mode=False)
    assert MlflowClient().search_runs([tmp_experiment]) == [] and mlflow.active_run() is None
