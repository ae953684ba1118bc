"""Everything that calls MLflow: runs and their batches, uploads of dumps, reading a run's dump back, comparison
and API-check runs, autolog's MLflow side, and the small functions the monitors, callbacks and sinks call MLflow
through. The names a run is written with are ``msprobe_mlflow.vocabulary``'s (re-exported here for old imports).
"""
from msprobe_mlflow.vocabulary import (ARTIFACT_ROOT, FAILED_RANKS_TAG, FINDING_KINDS, MISSING_RANKS_TAG,
                                       RANK_ENDINGS, RANK_FAILURES, TAG_PREFIX, TAG_RANGES_LIMIT, earliest_findings,
                                       finding_tags)

__all__ = ["ARTIFACT_ROOT", "FAILED_RANKS_TAG", "FINDING_KINDS", "MISSING_RANKS_TAG", "RANK_ENDINGS", "RANK_FAILURES",
           "TAG_PREFIX", "TAG_RANGES_LIMIT", "earliest_findings", "finding_tags"]
