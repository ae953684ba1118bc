"""The entry point of an API-check worker process (``python -m msprobe_mlflow.api_check.replay_worker FD``).

A module of its own, which the package does not import, so that running it does not find it imported already.
"""
import sys
from multiprocessing.connection import Connection

from msprobe_mlflow.api_check.replay import serve

if __name__ == "__main__":
    try:
        serve(Connection(int(sys.argv[1])))
    except EOFError:  # the parent has gone: nothing is waiting for the results
        pass
