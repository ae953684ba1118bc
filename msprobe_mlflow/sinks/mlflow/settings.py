"""The live MLflow sink's waits, read from the environment once (tests and benchmarks set them here)."""
import os

RANK_WAIT_SECONDS = float(os.environ.get("MSPROBE_MLFLOW_RANK_WAIT_SECONDS", "120"))
START_CHECK_SECONDS = float(os.environ.get("MSPROBE_MLFLOW_START_CHECK_SECONDS", "10"))
DRAIN_SECONDS = float(os.environ.get("MSPROBE_MLFLOW_DRAIN_SECONDS", "300"))
# Each round of requests costs the tracking store a commit (10-15 ms of CPU with SQLite): with fast steps, one
# round per step costs more than the step itself (benchmarks/), so steps are gathered for up to a second.
SEND_INTERVAL_SECONDS = 1.0
# A round carrying this many steps (they come faster than a few a second) moves the requests out of this process,
# where this process left this many of its CPUs idle since the last round: made here, their Python costs fast steps
# of many small tensors 1.3x (tracking.request_process); a process of its own on a busy CPU costs more (sender.py).
PROCESS_MIN_ROUND_STEPS = 4
PROCESS_MIN_SPARE_CPUS = 0.5
# The exponent pictures while training runs (sinks/mlflow/pictures.py): the first after this long, each next one
# after twice the last wait.
PICTURE_SECONDS = float(os.environ.get("MSPROBE_MLFLOW_PICTURE_SECONDS", "600"))
