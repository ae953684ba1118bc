"""The comparator: how similar the gradient directions of two runs are, step by step, and where they part.

- ``similarity``: the pure math (XOR and popcount on packed sign bits).
- ``verdict``: the suspicious-step rule on the similarity series.
- ``engine``: reads two local dumps, streams the comparison, writes msprobe's outputs (``compare_dumps``).
- ``plots``: the summary curve and the parameter x step heat map.

MLflow sources and the comparison run live in ``msprobe_mlflow.tracking`` (``run_dump``, ``comparison_run``).
"""
