"""The comparator: how similar the gradient directions of two runs are, step by step, and where they part.

- ``similarity``: the pure math (XOR and popcount on packed sign bits).
- ``step``: one step of two dumps compared (matching, agreeing signs, both sides' statistics), for ``compare`` and
  the live verdict alike.
- ``verdict``: the verdict types, the rule settings and msprobe's rule; ``noise_rule``: the noise-aware rule (the
  default); ``rules``: the judge of each rule.
- ``engine``: reads two local dumps, streams the comparison, writes msprobe's outputs (``compare_dumps``).
- ``plots``: the summary curve and the parameter x step heat map.

MLflow sources and the comparison run live in ``msprobe_mlflow.tracking`` (``run_dump``, ``comparison_run``).
"""
