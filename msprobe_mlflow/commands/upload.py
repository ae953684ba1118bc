"""``msprobe-mlflow upload``: send a local gradient dump (ours or msprobe 1.0.3's) into an MLflow run."""
from __future__ import annotations

from pathlib import Path

import click

from msprobe_mlflow.commands import command, tracking_uri_option


@command("upload", short_help="upload a gradient dump into an MLflow run (completes a run idempotently, or creates "
                              "one)")
@click.argument("dump_path", type=click.Path(path_type=Path))  # checked by dump_folder, which says more
@click.option("--run-id", metavar="RUN_ID", help="complete this run; without it a new run is created")
@click.option("--experiment", metavar="NAME", help="experiment name for a new run (default: MLflow's current one)")
@tracking_uri_option
@click.option("--param-metrics", multiple=True, metavar="PATTERN",
              help="a parameter name or glob pattern that also gets per-parameter metrics; repeat the option for "
                   "more. Example: --param-metrics 'layers.0.*' --param-metrics fc.weight")
def upload(dump_path: Path, run_id: str | None, experiment: str | None, tracking_uri: str | None,
           param_metrics: tuple[str, ...]) -> None:
    """Uploads a grad_probe dump folder (DUMP_PATH, the one holding rank0/, rank1/, ...) into an MLflow run:
    per-rank summary metrics for every step, the grad_summary CSVs and the directions (packed, one archive per
    rank and step).

    Completes a run whose live logging was interrupted (tracking server down): only what the run lacks is sent, so
    running it twice adds nothing. A run left RUNNING by a training that died without a word is ended FAILED,
    its silent ranks tagged missing: a job that lost ranks (a rank failed or was killed, the others never said how
    they ended), or ranks of DUMP_PATH whose process is gone (SIGKILL). Also imports dumps written by msprobe 1.0.3
    (boolean .npy directions, either CSV header spelling), so they get the MLflow UI and `compare`.

    \b
    Examples:
      msprobe-mlflow upload ./msprobe_dump/3f2a... --run-id 3f2a...
      msprobe-mlflow upload ./old_msprobe_dump --experiment npu-vs-gpu
    """
    from msprobe_mlflow.dump import dump_folder
    from msprobe_mlflow.tracking.server import require_existing_store, require_tracking_server
    from msprobe_mlflow.tracking.upload import close_abandoned_run_at, upload_dump

    dump_folder(dump_path, "DUMP_PATH")  # bad input is told before the server is asked
    require_tracking_server(tracking_uri)
    if run_id:  # a new run may create the store; a run to complete must be in one
        require_existing_store(tracking_uri, f"--run-id {run_id}", maybe_folder=False)
    report = upload_dump(dump_path, run_id, experiment=experiment, tracking_uri=tracking_uri,
                         param_patterns=param_metrics, progress=True)
    steps = sum(len(s) for s in report.steps_completed.values())
    click.echo(f"run {report.run_id}: {report.metrics_logged} metric values and {report.files_uploaded} files sent "
               f"({steps} step(s) completed)")
    if report.unsent_distributions:
        click.echo(f"steps {report.unsent_distributions}: their distributions over the ranks are not in the run, and "
                   f"{dump_path} does not hold every rank's dump to compute them; upload a folder that does")
    if run_id and (closed := close_abandoned_run_at(tracking_uri, run_id, dump_path)):
        click.echo(closed)
