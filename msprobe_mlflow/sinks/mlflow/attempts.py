"""Each request of the live MLflow sink, and what is said when one fails: the first failure as a warning, every
one in the log; credentials the server refuses (401/403) stop the sink, told once."""
from __future__ import annotations

from msprobe_mlflow.notices import Notices
from msprobe_mlflow.tracking.live_run import refused_credentials


class Attempts:
    def __init__(self, run_id: str, tracking_uri: str, rank: int, dump_path: str, notices: Notices):
        self.run_id, self.tracking_uri, self.rank, self.dump_path = run_id, tracking_uri, rank, dump_path
        self.notices = notices
        self.failure: str | None = None  # the last request's failure; None once one succeeds
        self.refused: str | None = None  # set when the server refused the credentials: nothing more is sent
        self._refusal_told = False

    def __call__(self, what: str, action) -> bool:
        """Runs ``action``; False (said) when it raised."""
        try:
            action()
        except Exception as e:
            status = refused_credentials(e)
            if status is not None:
                self.refused = self._refusal_message(status)
                self.notices.log(self.refused)
                return False
            first = self.failure is None
            self.failure = f"could not {what} in run {self.run_id}: {e}"
            self.notices.log(self.failure)
            if first:
                self.notices.warn(f"{self.failure}. Training goes on and the local dump stays complete; "
                                  f"unsent steps are retried at stop().")
            return False
        self.failure = None
        return True

    def _refusal_message(self, status: str) -> str:
        return (f"rank {self.rank}: the MLflow tracking server at {self.tracking_uri} refused the "
                f"credentials ({status}) for run {self.run_id}; set MLFLOW_TRACKING_USERNAME and "
                f"MLFLOW_TRACKING_PASSWORD to an account that may edit this run's experiment. Nothing is sent to "
                f"MLflow; training goes on with the local dump in {self.dump_path}; once the credentials "
                f"are right, send it with: msprobe-mlflow upload {self.dump_path} --run-id {self.run_id}")

    def tell_refusal(self) -> None:
        """Warns once (at start, or at close when the answer came later) that the credentials were refused."""
        if self.refused and not self._refusal_told:
            self._refusal_told = True
            self.notices.warn(self.refused)
