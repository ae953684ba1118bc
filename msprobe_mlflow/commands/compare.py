"""``msprobe-mlflow compare A B``: direction similarity of two runs or dumps, a verdict, a comparison run."""
from __future__ import annotations

from pathlib import Path

import click

from msprobe_mlflow.commands import command, tracking_uri_option
from msprobe_mlflow.commands.exit_codes import OK, SUSPICIOUS_RESULT

FOLDER = click.Path(file_okay=False)  # checked only if it exists: created when missing


@command("compare", short_help="compare the gradient directions of two runs (or dump folders) and log the "
                               "comparison run")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option("--output", metavar="DIR", type=FOLDER,
              help="also keep the outputs in DIR (rank<R>/similarities.csv, plots, verdict.json); an earlier "
                   "comparison there is replaced, anything else is refused. Example: --output ./compare_out")
@click.option("--experiment", metavar="NAME",
              help="experiment of the comparison run (created if missing; default: the experiment of the first "
                   "source run). Example: --experiment grad-compare")
@click.option("--run-name", metavar="NAME",
              help="name of the comparison run (default: 'compare <A> vs <B>'). Example: --run-name 'bf16 vs fp32'")
@tracking_uri_option
@click.option("--first-threshold", type=float, default=0.97, metavar="X",
              help="a first compared step with similarity below X is suspicious (default 0.97). "
                   "Example: --first-threshold 0.95")
@click.option("--drop-threshold", type=float, default=0.03, metavar="X",
              help="a drop of more than X from one compared step to the next is suspicious (default 0.03). "
                   "Example: --drop-threshold 0.05")
@click.option("--no-mlflow", is_flag=True,
              help="log no comparison run: print (and with --output write) the result only; run IDs as sources "
                   "still need the tracking store")
@click.option("--fail-on-suspicious", is_flag=True,
              help=f"exit with code {SUSPICIOUS_RESULT} when a suspicious step is found (for CI pipelines)")
@click.option("--per-param-plots", is_flag=True, help="also draw one similarity curve per parameter (slow for "
                                                      "large models)")
@click.option("--no-plots", is_flag=True, help="draw no pictures (CSV and verdict only)")
@click.option("--cache-dir", metavar="DIR", type=FOLDER,
              help="where runs downloaded from a tracking server are cached by run ID (default "
                   "~/.cache/msprobe-mlflow/runs)")
def compare(a: str, b: str, output: str | None, experiment: str | None, run_name: str | None,
            tracking_uri: str | None, first_threshold: float, drop_threshold: float, no_mlflow: bool,
            fail_on_suspicious: bool, per_param_plots: bool, no_plots: bool, cache_dir: str | None) -> int:
    """Compares the gradient directions (signs) of two trainings, step by step: for each rank, parameter and step
    present in both, similarity = elements whose sign agrees / elements. The summary per step weighs parameters by
    size. A (the baseline) and B (the run to check against it) are each an MLflow run ID (a run logged by
    autolog(), GradientMonitor or 'msprobe-mlflow upload') or a grad_probe dump folder (ours, or msprobe 1.0.3's).
    Dumps must be grad_level L1 or L2 (L0 has no directions).

    Verdict: a step is suspicious when, for any parameter or the summary, the first compared step's similarity is
    below --first-threshold, or the similarity drops by more than --drop-threshold from one compared step to the
    next. The first suspicious step per rank is printed with the parameters that fell most.

    Outputs: a new MLflow run 'compare <A> vs <B>' (metric summary_similarity/rank<R> over training steps, the
    verdict as tags and metrics, artifacts grad_compare/rank<R>/similarities.csv, plots, verdict.json), and with
    --output the same files locally.

    \b
    Examples:
      msprobe-mlflow compare 3f2a...c1 9b7e...04
      msprobe-mlflow compare ./dump_baseline ./dump_candidate --no-mlflow --output ./compare_out
      msprobe-mlflow compare $BASELINE_RUN $CANDIDATE_RUN --tracking-uri http://mlflow:5000 --fail-on-suspicious
    """
    from msprobe_mlflow.compare.engine import compare_dumps

    options = dict(first_threshold=first_threshold, drop_threshold=drop_threshold, plots=not no_plots,
                   per_param_plots=per_param_plots)
    if no_mlflow and Path(a).exists() and Path(b).exists():  # two dumps: no tracking store involved
        comparison = compare_dumps(a, b, output, **options)
        _print_result(comparison, None, None, None)
        verdict = comparison.verdict
    else:
        from msprobe_mlflow.tracking.comparison_run import compare_runs
        from msprobe_mlflow.tracking.server import require_tracking_server

        require_tracking_server(tracking_uri)  # a side is a run ID, or the comparison run is logged
        result = compare_runs(a, b, tracking_uri=tracking_uri, experiment=experiment, run_name=run_name,
                              output_dir=output, cache_dir=cache_dir, log_run=not no_mlflow, **options)
        _print_result(result.comparison, result.run_id, result.run_url(), result.tracking_uri, result.experiment_id)
        verdict = result.verdict
    return SUSPICIOUS_RESULT if fail_on_suspicious and verdict.suspicious else OK


def _print_result(comparison, run_id: str | None, run_url: str | None, tracking_uri: str | None,
                  experiment_id: str | None = None) -> None:
    click.echo(comparison.table())
    click.echo()
    click.echo(comparison.verdict.describe())
    if comparison.output_dir is not None:
        click.echo(f"\noutputs: {comparison.output_dir}")
    if run_id:
        click.echo(f"\ncomparison run: {run_id}")
        if run_url:
            click.echo(f"open: {run_url}")
        else:
            from msprobe_mlflow.tracking.experiments import run_page_url

            click.echo(f"open: mlflow ui --backend-store-uri {tracking_uri}")
            click.echo(f"      then {run_page_url('http://127.0.0.1:5000', experiment_id, run_id)}")
