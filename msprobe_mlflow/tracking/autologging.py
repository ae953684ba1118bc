"""MLflow's autologging machinery, as autolog and the frameworks' halves use it (``integrations/autolog.py``,
``pytorch/autolog.py``, ``mindspore/autologging.py``): the integration's stored configuration, ``safe_patch``,
import hooks, and the runs they look at."""
from __future__ import annotations

import mlflow
import mlflow.tracking.fluent
from mlflow.tracking import MlflowClient
from mlflow.utils.autologging_utils import autologging_integration, get_autologging_config, safe_patch
from mlflow.utils.import_hooks import register_post_import_hook

from msprobe_mlflow.vocabulary import MLFLOW_TAG_PREFIX


def integration(flavor: str):
    """MLflow's ``autologging_integration`` decorator: stores the call's configuration under ``flavor``, reverts the
    earlier patches and runs the body unless ``disable``."""
    return autologging_integration(flavor)


def patch(flavor: str, owner, name: str, wrapper) -> None:
    """``owner.name`` wrapped by ``wrapper(original, *args, **kwargs)`` (MLflow's ``safe_patch``: reverted by
    ``disable=True``)."""
    safe_patch(flavor, owner, name, wrapper)


def patch_end_run(flavor: str, wrapper) -> None:
    """``mlflow.end_run`` (both spellings) wrapped by ``wrapper``."""
    safe_patch(flavor, mlflow.tracking.fluent, "end_run", wrapper)
    safe_patch(flavor, mlflow, "end_run", wrapper)


def after_run_end(flavor: str, hook) -> None:
    """``hook(run_id, tags)`` once the fluent API ended its run and none is active any more (``mlflow.end_run``, a
    ``with`` block's end, MLflow's exit handler), with the run's tags; runs a client ends (msprobe-mlflow's own
    comparison and API-check runs) and nested runs are left out. A patch of ``flavor`` on
    ``MlflowClient.set_terminated``, through which ``mlflow.end_run`` ends a run: not on ``mlflow.end_run``, which
    ``msprobe_mlflow.autolog()`` patches already (``safe_patch`` wraps a function's original, so a second flavor's
    patch of it would replace the first one's)."""
    def set_terminated_then_hook(original, client, run_id, *args, **kwargs):
        result = original(client, run_id, *args, **kwargs)
        ended = mlflow.last_active_run() if mlflow.active_run() is None else None  # the run end_run just ended
        if ended is not None and ended.info.run_id == run_id:
            hook(run_id, ended.data.tags)
        return result

    safe_patch(flavor, MlflowClient, "set_terminated", set_terminated_then_hook)


def when_imported(hook, module: str) -> None:
    """``hook(module)`` once ``module`` is imported (at once if it is); replaces the earlier hook."""
    register_post_import_hook(hook, module, overwrite=True)


def silent(flavor: str) -> bool:
    """The ``silent`` setting of the integration's last call."""
    return bool(get_autologging_config(flavor, "silent", False))


def active_run_id() -> str | None:
    """The active run's ID in this thread, None without one."""
    active = mlflow.active_run()
    return active.info.run_id if active is not None else None


def start_run(run_name: str, tags: dict[str, str]) -> str:
    """Starts an active run; returns its ID."""
    return mlflow.start_run(run_name=run_name, tags=tags).info.run_id


def end_run(run_id: str, status: str) -> None:
    """Ends the run ``run_id`` with ``status``: through ``mlflow.end_run`` when it is the active run (so that the
    fluent API forgets it), else by the client."""
    if active_run_id() == run_id:
        mlflow.end_run(status)
    else:
        mlflow.MlflowClient().set_terminated(run_id, status)


def delete_if_empty(run_id: str) -> bool:
    """Deletes the run (MLflow's soft delete) when nothing was logged into it but MLflow's own tags; True if
    deleted."""
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    if run.data.metrics or run.data.params or client.list_artifacts(run_id) or any(
            not key.startswith(MLFLOW_TAG_PREFIX) for key in run.data.tags):
        return False
    client.delete_run(run_id)
    return True
