"""``msprobe-mlflow compare A B``: direction similarity of two runs or dumps, a verdict, a comparison run."""
from __future__ import annotations

from pathlib import Path

import click

from msprobe_mlflow.commands import command, tracking_uri_option
from msprobe_mlflow.commands.exit_codes import OK, SUSPICIOUS_RESULT
from msprobe_mlflow.compare.verdict import BREAK, DEFAULT_RULE, GRADES, RULES, rule_settings
from msprobe_mlflow.formats import UNIT_ROUNDOFF
from msprobe_mlflow.localization import locate_hint

FOLDER = click.Path(file_okay=False)  # checked only if it exists: created when missing
TABLE_HEAD_AND_TAIL = 5  # lines of 10 steps printed at each end of a rank's table (--all: every one)


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
              help="name of the comparison run (default: '<A> vs <B>', each the source run's name or the folder's). "
                   "Example: --run-name 'bf16 vs fp32'")
@tracking_uri_option
@click.option("--rule", type=click.Choice(RULES), default=DEFAULT_RULE, show_default=True,
              help="how steps are judged: 'noise' against the pair's own numerical noise (runs that differ in "
                   "rounding from step 0, such as NPU against GPU), 'msprobe' msprobe's thresholds (runs that agree "
                   "bit for bit until a bug). Example: --rule msprobe")
@click.option("--first-threshold", type=float, default=None, metavar="X",
              help="--rule msprobe only: a first compared step with similarity below X is suspicious (default "
                   "0.97). Example: --rule msprobe --first-threshold 0.95")
@click.option("--drop-threshold", type=float, default=None, metavar="X",
              help="--rule msprobe only: a drop of more than X from one compared step to the next is suspicious "
                   "(default 0.03). Example: --rule msprobe --drop-threshold 0.05")
@click.option("--precision", type=click.Choice(list(UNIT_ROUNDOFF)), default=None, metavar="FORMAT",
              help="--rule noise: the coarsest floating-point format either run computed in (autocast and TF32 "
                   "count; one of " + ", ".join(UNIT_ROUNDOFF) + "). The first steps, before the pair's noise is "
                   "learnt, are judged against its rounding, so a bug present from step 0 that is smaller than "
                   "bfloat16 rounding is named there. Default: what both runs' PyTorch monitors recorded with each "
                   "step; bfloat16 where they did not (MindSpore, msprobe's dumps). Example: --precision float32 "
                   "(fp32 on CPU against fp64, TF32 off)")
@click.option("--name-map", metavar="FILE", type=click.Path(dir_okay=False),
              help="a JSON object, parameter name in A -> name in B, for parameters the automatic pairing does not "
                   "find (it pairs equal names, wrapper prefixes, MindSpore's gamma/beta with torch's weight/bias, "
                   "numbered SequentialCell children by order and shape). Example: --name-map names.json with "
                   "{\"encoder.norm.weight\": \"encoder.final_ln.gamma\"}")
@click.option("--skip-damaged", is_flag=True,
              help="compare the steps that can be read and list those that cannot (a file that fails its CRC-32 "
                   "check, is truncated or malformed) in the output, the comparison run and verdict.json, and call "
                   "the verdict partial; without it, a damaged step stops the comparison (exit 2) naming the file "
                   "and the step. Example: --skip-damaged")
@click.option("--no-mlflow", is_flag=True,
              help="log no comparison run: print (and with --output write) the result only; run IDs as sources "
                   "still need the tracking store")
@click.option("--fail-on-suspicious", type=click.Choice(GRADES), is_flag=False, flag_value=BREAK, default=None,
              metavar="[GRADE]",
              help=f"exit with code {SUSPICIOUS_RESULT} when a suspicious step of at least GRADE is found (for CI "
                   f"pipelines): 'break' (the default: beyond anything rounding can do) or 'departure' (also steps "
                   f"beyond the pair's learnt noise only); msprobe's rule grades nothing: any suspicious step fails. "
                   f"Example: --fail-on-suspicious departure")
@click.option("--per-param-plots", is_flag=True, help="also draw one similarity curve per parameter (slow for "
                                                      "large models)")
@click.option("--no-plots", is_flag=True, help="draw no pictures (CSV and verdict only)")
@click.option("--all", "every_step", is_flag=True,
              help=f"print every step's summary similarity (default: the first and last {TABLE_HEAD_AND_TAIL * 10} "
                   f"steps of each rank; similarities.csv holds them all)")
@click.option("--cache-dir", metavar="DIR", type=FOLDER,
              help="where runs downloaded from a tracking server are cached by run ID (default "
                   "~/.cache/msprobe-mlflow/runs)")
def compare(a: str, b: str, output: str | None, experiment: str | None, run_name: str | None,
            tracking_uri: str | None, rule: str, first_threshold: float | None, drop_threshold: float | None,
            precision: str | None, name_map: str | None, skip_damaged: bool, no_mlflow: bool,
            fail_on_suspicious: str | None, per_param_plots: bool, every_step: bool, no_plots: bool,
            cache_dir: str | None) -> int:
    """Compares the gradient directions (signs) of two trainings, step by step: for each rank, parameter and step
    present in both, similarity = elements whose sign agrees / elements. The summary per step weighs parameters by
    size. A (the baseline) and B (the run to check against it) are each an MLflow run ID (a run logged by
    autolog(), GradientMonitor or 'msprobe-mlflow upload') or a grad_probe dump folder (ours, or msprobe 1.0.3's).
    Dumps must be grad_level L1 or L2 (L0 has no directions). Parameters are paired by name, across wrappers and
    across frameworks (a MindSpore run against its PyTorch twin: gamma/beta = weight/bias, numbered SequentialCell
    children by order and shape); --name-map pairs the rest. A verdict on part of either model says "partial".
    Every file read is checked (a direction archive against its CRC-32s): a damaged step is never compared, it
    stops the comparison naming the file and the step, or with --skip-damaged is skipped and listed. A step whose
    grad_summary_<S>.csv is absent is compared on its signs and listed.

    Verdict (--rule noise, the default): a step is suspicious when the runs differ there by more than their own
    numerical noise, learnt from the pair: in the directions, or (at L1/L2) in the gradient norms (and the weights'
    own, where both runs recorded param_norm) or the L2 distribution. Each suspicious step is graded: a 'break' is
    beyond anything rounding can do (a norm off by over 10%, or in the first steps over float16's rounding where
    the runs' formats are known, anti-aligned signs, a weight that jumped in one run, every weight parting at
    once, a format change, any difference after bit-for-bit agreement); a 'departure' is beyond the pair's learnt
    noise only (amplified rounding, as in a sharp region or a loss spike, or a small bug). Parameters whose signs
    differ only at rounding level are reported as "sign is noise". The first steps are judged at the coarsest
    format the runs computed in: --precision, else what both runs' monitors recorded; where neither says, at
    bfloat16's rounding, and first steps that differ beyond float32 rounding are noted ("first steps").
    --rule msprobe: the first compared step below --first-threshold, or a drop of more than --drop-threshold. The
    first suspicious step per rank is printed with the parameters that moved most beyond their noise.

    Outputs: a new MLflow run '<A> vs <B>' (metric summary_similarity/rank<R> over training steps, the verdict as
    tags and metrics, artifacts grad_compare/rank<R>/similarities.csv, plots, verdict.json), and with --output the
    same files locally. Comparing the same A and B again makes a new run with the same tag
    msprobe_mlflow.compare.pair, linked to the previous one (printed, and in its description).

    \b
    Examples:
      msprobe-mlflow compare 3f2a...c1 9b7e...04
      msprobe-mlflow compare ./dump_baseline ./dump_candidate --no-mlflow --output ./compare_out
      msprobe-mlflow compare $BASELINE_RUN $CANDIDATE_RUN --tracking-uri http://mlflow:5000 --fail-on-suspicious
      msprobe-mlflow compare ./dump_a ./dump_b --no-mlflow --rule msprobe --drop-threshold 0.05
      msprobe-mlflow compare ./dump_cpu_fp64 ./dump_cpu_fp32 --no-mlflow --precision float32
      msprobe-mlflow compare ./dump_torch_gpu ./dump_mindspore_npu --no-mlflow --name-map names.json
    """
    from msprobe_mlflow.compare.engine import compare_dumps

    options = dict(rule=_checked_rule_settings(rule, first_threshold, drop_threshold, precision), plots=not no_plots,
                   per_param_plots=per_param_plots, name_map=name_map, skip_damaged=skip_damaged)
    if no_mlflow and Path(a).exists() and Path(b).exists():  # two dumps: no tracking store involved
        comparison = compare_dumps(a, b, output, **options)
        _print_result(comparison, every_step=every_step)
        verdict = comparison.verdict
    else:
        verdict = _compare_through_mlflow(a, b, tracking_uri, experiment, run_name, output, cache_dir, no_mlflow,
                                          every_step, options)
    if (hint := locate_hint(a, b, verdict, no_mlflow)) is not None:  # after the run's lines: the next command
        click.echo(f"\n{hint}")
    return SUSPICIOUS_RESULT if fail_on_suspicious and verdict.fails(fail_on_suspicious) else OK


def _checked_rule_settings(rule: str, first_threshold: float | None, drop_threshold: float | None,
                           precision: str | None):
    """The rule's settings; an option of the other rule is refused rather than silently ignored."""
    thresholds = {key: value for key, value in (("first_threshold", first_threshold),
                                                ("drop_threshold", drop_threshold)) if value is not None}
    if thresholds and rule != "msprobe":
        raise ValueError(f"--{next(iter(thresholds)).replace('_', '-')} applies to --rule msprobe only "
                         f"(the {rule} rule learns its tolerance from the pair); add --rule msprobe")
    if precision is not None and rule != "noise":
        raise ValueError(f"--precision applies to --rule noise only (msprobe's rule reads fixed thresholds); "
                         f"leave it out with --rule {rule}")
    return rule_settings(rule, precision=precision, **thresholds)


def _compare_through_mlflow(a: str, b: str, tracking_uri: str | None, experiment: str | None, run_name: str | None,
                            output: str | None, cache_dir: str | None, no_mlflow: bool, every_step: bool,
                            options: dict):
    """A side is a run ID, or the comparison run is logged: the tracking server is asked first, so that a wrong
    URI fails at once. Prints the result and returns its verdict."""
    from msprobe_mlflow.tracking.comparison_run import compare_runs
    from msprobe_mlflow.tracking.server import require_tracking_server

    require_tracking_server(tracking_uri)
    result = compare_runs(a, b, tracking_uri=tracking_uri, experiment=experiment, run_name=run_name,
                          output_dir=output, cache_dir=cache_dir, log_run=not no_mlflow, **options)
    _print_result(result.comparison, result, every_step)
    return result.verdict


def _print_result(comparison, result=None, every_step: bool = False) -> None:
    """The table (the first and last steps only, unless ``every_step``) and verdict; with ``result`` (a
    ``RunComparison`` that logged a run) the run, how to open it, and how to find every comparison of the same
    pair."""
    click.echo(comparison.table(head_and_tail=None if every_step else TABLE_HEAD_AND_TAIL))
    click.echo()
    click.echo(comparison.verdict.describe())
    if comparison.output_dir is not None:
        click.echo(f"\noutputs: {comparison.output_dir}")
    if result is None or not result.run_id:
        return
    from msprobe_mlflow.tracking.comparison_run import pair_search
    from msprobe_mlflow.tracking.experiments import run_page_url

    click.echo(f"\ncomparison run: {result.run_id}")
    if result.previous_run_id:
        click.echo(f"previous comparison of this pair: {result.previous_run_id}")
    click.echo(f"every comparison of this pair (runs table search): {pair_search(result.pair)}")
    if result.run_url():
        click.echo(f"open: {result.run_url()}")
    else:
        click.echo(f"open: mlflow ui --backend-store-uri {result.tracking_uri}")
        click.echo(f"      then {run_page_url('http://127.0.0.1:5000', result.experiment_id, result.run_id)}")
