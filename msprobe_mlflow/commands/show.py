"""``msprobe-mlflow show``: a comparison run's verdict again, or every comparison of a pair."""
from __future__ import annotations

import click

from msprobe_mlflow.commands import command, tracking_uri_option


@command("show", short_help="print a comparison run's verdict again, or list every comparison of two runs")
@click.argument("sources", metavar="RUN | A B", nargs=-1, required=True)
@tracking_uri_option
def show(sources: tuple[str, ...], tracking_uri: str | None) -> None:
    """With one comparison run's ID, print its verdict, the next command (locate) and the table as compare printed
    them (and the operator, where locate named one). With two sources (run IDs or dump folders, as given to
    compare), list every comparison of that pair, newest first: run ID, name, verdict, first suspicious step and
    grade.

    \b
    Examples:
      msprobe-mlflow show 7c1e...      # the comparison run's verdict
      msprobe-mlflow show $GPU_RUN $NPU_RUN
    """
    from msprobe_mlflow.tracking.comparison_history import list_comparisons, show_comparison
    from msprobe_mlflow.tracking.server import require_tracking_server

    if len(sources) > 2:
        raise click.UsageError(f"got {len(sources)} sources; give one comparison run, or the two compared sources")
    require_tracking_server(tracking_uri)
    if len(sources) == 1:
        click.echo(show_comparison(sources[0], tracking_uri))
        return
    lines = list_comparisons(*sources, tracking_uri)
    if not lines:
        click.echo(f"no comparison of A = {sources[0]} and B = {sources[1]} (in this order) yet: msprobe-mlflow "
                   f"compare {sources[0]} {sources[1]}")
    for line in lines:
        click.echo(line)
