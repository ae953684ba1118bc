"""The entry point of an API-check worker process (``python -m msprobe_mlflow.api_check.replay_worker FD [CPUS]``).

A module of its own, which the package does not import, so that running it does not find it imported already.
``CPUS`` (``0,1``): the CPUs to run on, set before MindSpore and torch are imported, so that their thread pools
are sized to them.
"""
import os
import sys
from multiprocessing.connection import Connection

if __name__ == "__main__":
    if len(sys.argv) > 2:
        os.sched_setaffinity(0, {int(cpu) for cpu in sys.argv[2].split(",")})
    from msprobe_mlflow.api_check.replay import serve

    try:
        serve(Connection(int(sys.argv[1])))
    except EOFError:  # the parent has gone: nothing is waiting for the results
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # every result is sent: MindSpore's teardown (about a second) would only keep the parent waiting
