"""Sub-commands of the ``msprobe-mlflow`` CLI (see ``msprobe_mlflow.cli``)."""
