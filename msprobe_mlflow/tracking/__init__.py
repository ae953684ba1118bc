"""Everything that talks to MLflow: the per-step sink, autolog, uploads of dumps, comparison and API-check runs.

Artifact layout of a monitored run: ``grad_probe/`` mirrors the local dump (``grad_probe/rank{R}/grad_summary_{S}.csv``,
``grad_probe/rank{R}/step{S}/directions.npz``) plus ``grad_probe/config.json``.
"""
ARTIFACT_ROOT = "grad_probe"
TAG_PREFIX = "msprobe_mlflow."
